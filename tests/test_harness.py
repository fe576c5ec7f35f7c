"""`paratrain eval`: lm-evaluation-harness's tasks on paratrain's model against lm-eval's own Hugging Face backend,
on one process and on 2 ranks in each kind of layout (fsdp, tp, pp, cp, ddp, ep on a MoE checkpoint, LoRA), with task
folders written here (local JSONL, no network)."""

import json
import math

import pytest

pytest.importorskip("lm_eval")

from conftest import fast_config  # noqa: E402
from paratrain.data import DEFAULT_CORPUS  # noqa: E402
from test_hf import make_llama, make_mixtral  # noqa: E402

TASKS = ["t_choice", "t_rolling", "t_gen"]


def write_tasks(folder) -> str:
    """Three tasks over held-out corpus text: multiple choice (4 lines, one true continuation), whole passages
    scored with lm-eval's rolling windows (longer than the model's 64-token context), and a greedy completion
    up to the end of the line."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line for line in DEFAULT_CORPUS.read_text()[-40_000:].split("\n") if len(line) > 20]
    choice = [{"context": lines[i] + "\n", "choices": [lines[i + 1], lines[i + 7], lines[i + 13], lines[i + 19]],
               "label": 0} for i in range(0, 160, 20)]
    rolling = [{"text": "\n".join(lines[i:i + 6])} for i in range(200, 260, 10)]
    gen = [{"context": "\n".join(lines[i:i + 2]) + "\n", "target": lines[i + 2]} for i in range(300, 340, 10)]
    common = "test_split: test\nfewshot_split: test\ndataset_path: json\nmetadata:\n  version: 1.0\n"
    for name, docs, body in [
        ("t_choice", choice, 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
                             'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\ntarget_delimiter: ""\n'
                             "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        ("t_rolling", rolling, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                               "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                               "  - metric: bits_per_byte\n"),
        ("t_gen", gen, 'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
                       'target_delimiter: ""\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n'
                       "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")]:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(f"task: {name}\n{common}dataset_kwargs:\n  data_files:\n"
                                             f"    test: {data}\n{body}")
    return str(folder)


@pytest.fixture(scope="module")
def harness_root(tmp_path_factory):
    """A folder holding a tiny random Hugging Face Llama (`llama`); runs from it share its data folder (`data`)."""
    root = tmp_path_factory.mktemp("harness")
    make_llama(root / "llama")
    return root


def train_from(root, name: str, hf, steps: int, *extra: str):
    """The last checkpoint of run `name`, started from the Hugging Face folder `hf` on the shared data folder."""
    from paratrain.api import train_rank

    train_rank(fast_config(root / "data", root, name, f"model.init_from=hf:{hf}", f"training.steps={steps}", *extra))
    return root / name / "checkpoints" / f"step-{steps}"


@pytest.fixture(scope="module")
def trained(harness_root):
    """(checkpoint, fp32 Hugging Face export, task folder): a tiny imported Llama trained 3 steps."""
    root = harness_root
    checkpoint = train_from(root, "ft", root / "llama", 3, "checkpoint.export_hf=true",
                            "checkpoint.export_hf_dtype=fp32")
    return checkpoint, root / "ft" / "hf", write_tasks(root / "tasks")


def settings(tasks, out, **changes):
    from paratrain.harness.tasks import HarnessSettings

    return HarnessSettings(**{"tasks": list(TASKS), "include_path": tasks, "output_path": str(out),
                              "log_samples": True, "batch_size": 3, **changes})


def one_process(source, tasks, out):
    from paratrain.downstream import EvalJob, eval_rank

    return eval_rank(EvalJob(str(source), settings(tasks, out)))


def eval_command(source, tasks, out, *flags: str) -> dict:
    """`paratrain eval SOURCE` of every task (batches of 3 requests, samples logged) with `flags`; lm-eval's results
    file."""
    from paratrain.cli import main

    code = main(["eval", str(source), "--tasks", ",".join(TASKS), "--include-path", tasks, "--batch-size", "3",
                 "--output-path", str(out), "--log-samples", *flags])
    assert code == 0
    return json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())


def assert_same_answers(got: dict, out, reference: dict, reference_out) -> None:
    """Every metric of a results file within 1e-6 of the reference's, and the same greedy generations."""
    for task, metrics in reference["metrics"].items():
        for name, value in metrics.items():
            assert math.isclose(got["results"][task][f"{name},none"], value, rel_tol=1e-6, abs_tol=1e-9), (
                task, name)
    assert generations(out, "t_gen") == generations(reference_out, "t_gen")


def results_file(outcome) -> dict:
    return json.loads(open(outcome["path"]).read())


def generations(out, task: str) -> list:
    found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert found, list(out.rglob("*"))
    rows = [json.loads(line) for line in found[-1].read_text().splitlines()]
    return [r["resps"] for r in sorted(rows, key=lambda r: r["doc_id"])]


@pytest.fixture(scope="module")
def reference(trained, tmp_path_factory):
    """paratrain eval of the checkpoint on one process (metrics, its output folder)."""
    checkpoint, _, tasks = trained
    out = tmp_path_factory.mktemp("one")
    return one_process(checkpoint, tasks, out), out


def test_one_process_equals_lm_eval_on_the_export(trained, reference, tmp_path):
    """acc / acc_norm / exact_match and the greedy generations equal lm-eval's HF backend on the fp32 export;
    word / byte perplexity and bits per byte within 1e-4."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, export, tasks = trained
    ours, out = reference
    hflm = HFLM(pretrained=str(export), batch_size=1, dtype="float32", device="cpu")
    theirs = simple_evaluate(model=hflm, tasks=list(TASKS), log_samples=True, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=tasks, include_defaults=False))
    for task, metrics in ours["metrics"].items():
        for name, value in metrics.items():
            expected = theirs["results"][task][f"{name},none"]
            if "perplexity" in name or name == "bits_per_byte":
                assert math.isclose(value, expected, rel_tol=1e-4), (task, name, value, expected)
            else:
                assert value == expected, (task, name, value, expected)
    assert set(ours["metrics"]) == set(TASKS)
    assert ours["metrics"]["t_rolling"]["byte_perplexity"] > 1
    expected = [s["resps"] for s in sorted(theirs["samples"]["t_gen"], key=lambda s: s["doc_id"])]
    assert generations(out, "t_gen") == expected
    written = results_file(ours)
    assert written["paratrain"]["step"] == 3 and written["paratrain"]["precision"] == "fp32"
    assert "layout" in written["paratrain"] and written["config"]["model"] == "paratrain"


LAYOUTS = {"fsdp2": ["--parallel.dp_shard=2"], "tp2": ["--parallel.tp=2"], "pp2": ["--parallel.pp=2"],
           "pp2-batch1": ["--parallel.pp=2", "--batch-size", "1"], "cp2": ["--parallel.cp=2"],
           "ddp2": ["--parallel.dp_mode=ddp"]}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_layouts_equal_one_process(trained, reference, tmp_path, layout, capsys):
    """`paratrain eval CHECKPOINT --nproc 2` on each kind of layout: every metric within 1e-6 of one process's, the
    same generations, lm-eval's table on stdout. pp2-batch1: every batch smaller than the pipeline's stages (the
    pipeline runs a batch's stages one after the other, never its training schedule)."""
    checkpoint, _, tasks = trained
    ours, one_out = reference
    out = tmp_path / "out"
    got = eval_command(checkpoint, tasks, out, "--nproc", "2", *layout)
    printed = capsys.readouterr().out
    assert "t_choice" in printed and "acc_norm" in printed
    assert_same_answers(got, out, ours, one_out)
    assert got["paratrain"]["layout"] != results_file(ours)["paratrain"]["layout"]


def test_moe_checkpoint_on_expert_parallel_ranks(harness_root, trained, tmp_path):
    """A mixture-of-experts checkpoint (a tiny imported Mixtral, 4 experts, trained a step) evaluated with its experts
    over 2 ranks (ep2) gives one process's metrics within 1e-6 and its generations."""
    _, _, tasks = trained
    checkpoint = train_from(harness_root, "moe", make_mixtral(harness_root / "mixtral"), 1)
    one = one_process(checkpoint, tasks, tmp_path / "one")
    got = eval_command(checkpoint, tasks, tmp_path / "ep2", "--nproc", "2", "--parallel.ep=2")
    assert "ep=2" in got["paratrain"]["layout"]
    assert_same_answers(got, tmp_path / "ep2", one, tmp_path / "one")


def test_lora_checkpoint_on_tensor_parallel_ranks(harness_root, trained, tmp_path):
    """A LoRA checkpoint (adapters on the imported Llama, its base read from the Hugging Face folder) evaluated on tp2
    gives one process's metrics within 1e-6 and its generations; the adapters count (not the base's numbers)."""
    _, _, tasks = trained
    checkpoint = train_from(harness_root, "lora", harness_root / "llama", 1, "lora.rank=4", "lora.alpha=8",
                            "optimizer.lr=2e-2")
    one = one_process(checkpoint, tasks, tmp_path / "one")
    base = one_process(f"hf:{harness_root / 'llama'}", tasks, tmp_path / "base")
    assert one["metrics"]["t_rolling"] != base["metrics"]["t_rolling"]
    got = eval_command(checkpoint, tasks, tmp_path / "tp2", "--nproc", "2", "--parallel.tp=2")
    assert_same_answers(got, tmp_path / "tp2", one, tmp_path / "one")


def test_hf_folder_is_evaluated_through_the_same_code(trained, tmp_path):
    """hf:DIR (the fp32 export) gives the checkpoint's numbers: a baseline before fine-tuning is the same code."""
    from paratrain.downstream import EvalJob, eval_rank

    checkpoint, export, tasks = trained
    one = eval_rank(EvalJob(str(checkpoint), settings(tasks, tmp_path / "a", log_samples=False)))
    hf = eval_rank(EvalJob(f"hf:{export}", settings(tasks, tmp_path / "b", log_samples=False)))
    for task, metrics in one["metrics"].items():
        for name, value in metrics.items():
            assert math.isclose(hf["metrics"][task][name], value, rel_tol=1e-6), (task, name)


BAD = [
    (["--tasks", "t_choise"], "unknown task 't_choise' (close: t_choice"),
    (["--tasks", "t_choice", "--include-path", "/nonexistent/tasks"], "/nonexistent/tasks: no such folder"),
    (["--tasks", "t_choice", "--limit", "0"], "--limit must be at least 1"),
    (["--tasks", "t_choice", "--num-fewshot", "99"], "more than task t_choice's few-shot split holds (8 documents)"),
    (["--tasks", "t_choice", "--parallel.tp=3", "--nproc", "3"], "tp"),
    (["--tasks", "t_choice", "--training.steps=3"], "eval takes --parallel.*"),
    (["--tasks", "t_choice", "--max-length", "65"], "--max-length 65 is longer than the model's context (64 tokens)"),
]


@pytest.mark.parametrize("extra, message", BAD,
                         ids=["unknown", "include", "limit", "fewshot", "tp", "setting", "max-length"])
def test_bad_input_is_one_line(trained, tmp_path, capsys, extra, message):
    from paratrain.cli import main

    checkpoint, _, tasks = trained
    if "--include-path" not in extra:
        extra = [*extra, "--include-path", tasks]
    out = tmp_path / "out"
    assert main(["eval", str(checkpoint), *extra, "--output-path", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and message in err[-1], err
    assert not out.exists()


def test_weights_of_another_model(trained, tmp_path, capsys):
    """hf:DIR whose weights are not the model its config.json describes: one line, nothing written."""
    from paratrain.cli import main

    _, export, tasks = trained
    other = tmp_path / "other"
    other.mkdir()
    for f in export.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    out = tmp_path / "out"
    assert main(["eval", f"hf:{other}", "--tasks", "t_choice", "--include-path", tasks, "--output-path", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "intermediate" in err[-1] or "shape" in err[-1], err
    assert not out.exists()


def test_in_loop_evaluation_equals_paratrain_eval_of_the_final_checkpoint(trained, tmp_path, capsys):
    """`[eval]` every 2 of 4 steps: metrics.jsonl holds the tasks' metrics at steps 2 and 4, the end writes lm-eval's
    files in RUN_DIR/eval, and the last metrics equal `paratrain eval RUN_DIR` of the final checkpoint."""
    from paratrain.api import train
    from paratrain.cli import main

    _, _, tasks = trained
    cfg = fast_config(tmp_path / "data", tmp_path, "loop", "training.steps=4", f"eval.tasks={','.join(TASKS)}",
                      f"eval.include_path={tasks}", "eval.every=2", "eval.batch_size=3")
    result = train(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "downstream" in r]
    assert [r["step"] for r in evaluated] == [2, 4], evaluated
    assert evaluated[-1]["downstream"] == result.downstream and set(result.downstream) == set(TASKS)
    assert list((cfg.run_dir / "eval" / "paratrain").glob("results_*.json"))
    capsys.readouterr()
    out = tmp_path / "after"
    assert main(["eval", str(cfg.run_dir), "--tasks", ",".join(TASKS), "--include-path", tasks,
                 "--batch-size", "3", "--output-path", str(out)]) == 0
    got = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())
    for task, metrics in result.downstream.items():
        for name, value in metrics.items():
            assert math.isclose(got["results"][task][f"{name},none"], value, rel_tol=1e-6, abs_tol=1e-9), (task, name)
    assert got["paratrain"]["step"] == 4
    from paratrain.observe.report import write_report

    files = write_report([cfg.run_dir], tmp_path / "report")
    assert "downstream.png" in files
    summary = json.loads(files["summary.json"].read_text())["runs"][0]["downstream"]
    assert summary == {"step": 4, "tasks": result.downstream}
