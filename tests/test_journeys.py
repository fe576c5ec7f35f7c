"""The documentation's commands, run as a new user pastes them: each in a fresh working folder, through the real CLI,
to the end of the run (final eval, sample, export), at tiny sizes on CPU ranks.

The documentation is README.md and every page of docs/ (`doc_files`). Every command of a ```bash block there
belongs to one journey below (JOURNEYS); a documented command that no journey runs fails
`test_every_doc_command_has_a_journey`, and a journey may only run commands the documentation holds (`Journey.doc`),
so the two cannot drift apart. Every ```toml block there loads as a config (`test_doc_config_blocks_load`).
Sizes are made tiny by config overrides put *before* the documented options (the documentation's choices win), and
by a few forced ones after them (steps, sequence length).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import noise
from paratrain.data import DEFAULT_CORPUS
from paratrain.training.checkpoint import complete_checkpoints

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    """README.md and the pages of docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# Which journey runs each documented command (the command as shlex reads it: comments and line continuations gone).
JOURNEYS = {
    "make": [
        "make run",
        "make test",
    ],
    "default_run": [
        "paratrain train --training.steps=500 --run.name=short",
        "paratrain train --checkpoint.resume=auto",
        "paratrain train --run.name=short --run.overwrite=true",
        'paratrain generate --checkpoint runs/default --prompt "ROMEO:" --max-new-tokens 300',
        'paratrain generate --checkpoint runs/default --prompt "" --max-new-tokens 100',
        "paratrain checkpoint verify runs/default",
        "paratrain train --run.name=background --checkpoint.every=10 --checkpoint.async_save=true",
        "paratrain estimate --model runs/default/config.toml --gpu-memory 24GiB --json",
    ],
    "layouts": [
        "paratrain train --nproc 4 --parallel.dp_mode=fsdp --training.micro_batch=3 --run.name=fsdp4",
        "paratrain train --nproc 4 --parallel.tp=2 --run.name=tp2",
        "paratrain train --nproc 2 --parallel.tp=2 --parallel.sequence_parallel=false --run.name=tp2-nosp",
        "paratrain train --nproc 4 --parallel.dp_mode=hsdp --parallel.dp_replicate=2 --run.name=hsdp",
        "paratrain train --nproc 2 --parallel.pp=2 --run.name=pp2",
        "paratrain train --nproc 2 --model.preset=tiny-moe --parallel.ep=2 --run.name=ep2",
        "paratrain train --nproc 2 --parallel.cp=2 --run.name=cp2",
        "paratrain report runs/default runs/fsdp4 runs/tp2 --out report",
    ],
    "diloco": ["paratrain train --nproc 2 --parallel.dp_mode=ddp --parallel.dp_sync=diloco --diloco.inner_steps=2 "
               "--run.name=diloco",
               "paratrain plan --model llama3-8b --gpus 16 --gpus-per-node 8 --gpu RTX4090 "
               "--inter-node-bandwidth 1Gbit",
               "paratrain train --nproc 2 --parallel.dp_mode=ddp --parallel.dp_sync=diloco --diloco.inner_steps=10 "
               "--diloco.fragments=2 --diloco.outer_compression=sign_ef --diloco.outer_lr=1.4 "
               "--diloco.outer_momentum=0 --run.name=diloco-sign"],
    "custom_corpus": [
        "paratrain prepare --input corpus.jsonl --out data/mycorpus --tokenizer bpe --vocab-size 8000",
        "paratrain train --data.dir=data/mycorpus --run.name=mine",
        "paratrain train --data.dir=data/mycorpus --run.name=mine --checkpoint.resume=auto",
    ],
    "prepare_formats": [
        "paratrain prepare --input fineweb/*.jsonl.gz --out data/web --tokenizer bpe --vocab-size 32000",
        "paratrain prepare --input dolma/ --out data/dolma --tokenizer data/web/tokenizer.json --text-field text",
        "paratrain prepare --input corpus.parquet --out data/c --tokenizer byte --val-input heldout.jsonl",
    ],
    "hugging_face": [
        "paratrain train --nproc 2 --model.init_from=hf:llama-3.2-1b --data.source=corpus.jsonl "
        "--data.dir=data/corpus-llama --training.seq_len=1024 --training.precision=bf16 --optimizer.lr=2e-5 "
        "--optimizer.warmup_steps=20 --run.name=ft",
        "paratrain export runs/ft --format hf --out ft-hf --dtype bf16",
        'python -c "from transformers import pipeline; print(pipeline(\'text-generation\', \'ft-hf\')(\'Hello\')'
        '[0][\'generated_text\'])"',
    ],
    "fine_tune": [
        "paratrain prepare --input chat.jsonl --out data/chat --tokenizer llama-3.2-1b/tokenizer.json --chat",
        "paratrain estimate --model llama3-8b --gpu RTX4090 --lora-rank 16 --checkpointing full",
        "paratrain train --model.init_from=hf:llama-3.2-1b --data.dir=data/chat --lora.rank=16 --training.seq_len=2048 "
        "--training.precision=bf16 --optimizer.lr=2e-4 --optimizer.warmup_steps=20 --run.name=chat",
        "paratrain export runs/chat --format peft --out chat-adapter --dtype fp32",
        "paratrain export runs/chat --format hf --out chat-hf --dtype bf16",
        'python -c "from peft import AutoPeftModelForCausalLM as M; m = M.from_pretrained(\'chat-adapter\'); '
        'print(type(m.base_model).__name__)"',
        'python -c "from transformers import pipeline; print(pipeline(\'text-generation\', \'chat-hf\')'
        '([{\'role\': \'user\', \'content\': \'Hello\'}])[0][\'generated_text\'][-1][\'content\'])"',
    ],
    "profile": [
        "paratrain profile --nproc 2 --parallel.dp_mode=fsdp --steps 3",
    ],
    "verify": [],  # every `paratrain verify` line of the documentation (doc_verify_commands, below)
    "estimate": [
        "paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --seq-len 8192 --checkpointing selective",
        "paratrain estimate --model llama3-8b --accounting classic",
        "paratrain estimate --model plan/config.toml --gpu H100",
    ],
    "muon": [
        "paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --optimizer muon",
        "paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576 "
        "--optimizer muon",
    ],
    "deepseek": [
        "paratrain train --nproc 2 --model.preset=tiny-deepseek --parallel.ep=2 --run.name=deepseek",
        "paratrain eval runs/deepseek --tasks shakespeare --nproc 2 --parallel.ep=2",
        "paratrain export runs/deepseek --format hf --out deepseek-hf",
        'python -c "from transformers import pipeline; print(pipeline(\'text-generation\', \'deepseek-hf\')(\'ROMEO:\', '
        'max_new_tokens=20)[0][\'generated_text\'])"',
    ],
    "qwen": [
        "paratrain estimate --model qwen3-8b --gpu H100 --dp-shard 8 --seq-len 4096 --checkpointing selective",
        "paratrain estimate --model qwen3-30b-a3b --gpu H100 --dp-shard 8 --ep 8",
    ],
    "plan": [  # docs/estimate-and-plan.md's block, every line in its order but the calibration's (journey calibrate)
        "paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576",
        "paratrain estimate --model plan/config.toml --gpu H100",
        "paratrain plan --model llama3-70b --gpus 64 --gpu H100 --intra nvlink --inter ib400 --seq 8192 "
        "--global-batch-tokens 4194304 --out plan-70b-64",
        "paratrain plan ... --compile --out plan-compile",
        "paratrain plan ... --json --no-write",
        "paratrain plan ... --check --no-write",
        "paratrain plan ... --explain fsdp,tp=16",
        "paratrain plan ... --explain ddp,ac=none,mb=2",
        "paratrain plan ... --gpu-memory 40GiB --no-write",
        "paratrain plan ... --precision fp32 --tf32 false --no-write",
        "paratrain plan --model llama3-8b --gpus 8xH100,8xA100 --seq 4096 --global-batch-tokens 1048576 "
        "--out plan-hetero",
        "paratrain plan --model llama3-405b --gpus 8192 --gpu H100 --seq 8192 --global-batch-tokens 16777216 "
        "--no-write",
    ],
    "troubleshooting": [
        "paratrain train --nproc 2 --parallel.dp_mode=ddp --training.precision=bf16 --metrics.numerics_every=100 "
        "--run.name=watched",
        "paratrain report runs/watched",
        "paratrain replay runs/watched step-6",
        "paratrain doctor --hang runs/stuck",
        "paratrain plan --model llama3-70b --gpus 512 --gpu H100 --seq 8192 --global-batch-tokens 8388608",
        "paratrain train --dry-run --world 512 --config plan/config.toml",
    ],
    "memory_tiers": [
        "paratrain estimate --model llama3-8b --gpu RTX4090 --dp-shard 4 --seq-len 4096",
        "paratrain plan --model llama3-8b --gpus 4 --gpus-per-node 4 --gpu RTX4090 --intra pcie4 --seq 4096 "
        "--global-batch-tokens 65536 --host-memory 256GiB --out plan-4090",
        "paratrain plan --model llama3-70b --gpus 8 --gpu H100 --seq 4096 --global-batch-tokens 262144 "
        "--host-memory 2TiB --out plan-70b",
    ],
    "calibrate": [
        "paratrain plan --calibrate --name mybox --nproc 4",
        "paratrain plan --calibrate --name mybox --nproc 1 --model llama3.2-1b --seq 2048 --micro-batches 1,2",
        "paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576",
    ],
    "evaluation": [
        "paratrain train --eval.tasks=shakespeare --eval.every=100 --run.name=evaluated",
        "paratrain eval runs/evaluated --tasks shakespeare",
        "paratrain eval runs/evaluated --tasks shakespeare --nproc 2 --parallel.tp=2 --output-path eval-tp2",
        "paratrain eval runs/evaluated --tasks shakespeare_choice --num-fewshot 2 --limit 20 --log-samples",
    ],
    "architecture": [
        "paratrain train --training.z_loss=1e-4 --run.name=zloss",
    ],
    "precision": [
        "paratrain train --training.precision=fp8 --run.name=fp8",
        "paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576 "
        "--precision fp8 --compile",
    ],
    "scaling": [
        "paratrain scaling --weak --nproc 1,2,4",
        "paratrain scaling --strong --layouts ddp2,fsdp2,fsdp4",
    ],
}

# Small and quick: put before the documented options, which win.
TINY = ["--model.preset=tiny", "--training.seq_len=32", "--training.micro_batch=2", "--training.eval_sequences=8",
        "--sample.max_new_tokens=16", "--metrics.progress=lines", "--training.device=cpu"]
STEPS = ["--training.steps=4"]  # forced after the documented options


def canonical(command: str) -> str:
    """A shell command without comments, with its words quoted one way."""
    return shlex.join(shlex.split(command, comments=True))


def doc_blocks(language: str) -> list[tuple[str, str]]:
    """Every ```<language> block of README.md and docs/*.md: (file relative to the repository, its body)."""
    return [(str(path.relative_to(ROOT)), body) for path in doc_files()
            for body in re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)]


def doc_commands() -> dict[str, str]:
    """Every command of the ```bash blocks of README.md and docs/*.md, one string each (comments and continuations
    removed), with the first file that shows it."""
    out: dict[str, str] = {}
    for where, body in doc_blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                out.setdefault(canonical(line), where)
    return out


def doc_verify_commands() -> list[str]:
    """Every `paratrain verify` command the documentation shows: test_journey_verify runs each exactly as written."""
    return [c for c in doc_commands() if c.startswith("paratrain verify")]


JOURNEYS["verify"] = doc_verify_commands()


def test_every_doc_command_has_a_journey():
    covered = [canonical(c) for commands in JOURNEYS.values() for c in commands]
    shown = doc_commands()
    missing = [f"{where}: {c}" for c, where in shown.items() if c not in covered]
    assert not missing, f"documented commands that no journey runs (add them to tests/test_journeys.py): {missing}"
    stale = [c for c in covered if c not in shown]
    assert not stale, f"journeys run commands that neither README.md nor docs/*.md show any more: {stale}"


def test_doc_config_blocks_load(tmp_path):
    """Every ```toml block of README.md and docs/*.md is a valid paratrain config (each key exists, each value is
    accepted)."""
    from paratrain.config import load_config
    from paratrain.errors import ConfigError

    blocks = doc_blocks("toml")
    assert blocks
    for i, (where, body) in enumerate(blocks):
        path = tmp_path / f"block{i}.toml"
        path.write_text(body)
        try:
            load_config(path)
        except ConfigError as e:
            raise AssertionError(f"a ```toml block of {where} is not a valid config: {e}") from None


class Journey:
    """A fresh working folder and the documented commands run there as processes of their own (`paratrain ...`
    forked from a process that imported torch already: tests/prewarmed.py; `python -c ...` as a new interpreter)."""

    def __init__(self, name: str, folder: Path, prewarmed):
        self.name, self.cwd, self.prewarmed = name, folder, prewarmed
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "XDG_CACHE_HOME": str(folder / ".cache"), "PYTHONUNBUFFERED": "1",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def doc(self, command: str, before: list[str] = (), after: list[str] = (), expect: int = 0,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Run documented command `command` (as listed for this journey), with `before` inserted right after the
        subcommand and `after` appended."""
        assert canonical(command) in map(canonical, JOURNEYS[self.name]), \
            f"{command!r} is not one of journey {self.name}'s documented commands"
        assert canonical(command) in doc_commands(), f"{command!r} is in neither README.md nor docs/*.md"
        words = shlex.split(command)
        if "..." in words:  # "paratrain plan ... --json": the options of the example before it, given as `before`
            assert before, f"{command}: say what '...' stands for"
            words.remove("...")
        if words[0] == "paratrain":
            sub = 3 if words[1] == "checkpoint" else 2
            words = [sys.executable, "-m", "paratrain", *words[1:sub], *before, *words[sub:], *after]
            done = self.prewarmed.run(words, cwd=self.cwd, env=self.env, timeout=timeout)
        else:
            assert words[0] == "python", command
            done = subprocess.run([sys.executable, *words[1:]], cwd=self.cwd, env=self.env, capture_output=True,
                                  text=True, timeout=timeout)
        output = done.stdout + done.stderr
        assert done.returncode == expect, f"{command}: exit {done.returncode}\n{output[-4000:]}"
        assert "Traceback" not in output, f"{command}: a traceback\n{output[-4000:]}"
        # paratrain prints no Python warning (fixed where ours, filtered with its reason where not: paratrain/quiet.py),
        # progress bar or profiler marker. (`python -c` runs transformers and peft, whose output is theirs: peft 0.21
        # reads transformers 5's deprecated is_gradient_checkpointing, a FutureWarning.)
        found = noise(output) if command.startswith("paratrain") else []
        assert not found, f"{command}: noise\n" + "\n".join(found[:6])
        return done

    def train(self, command: str, *extra: str, **kw) -> subprocess.CompletedProcess:
        """A documented train command at tiny size; it must end with a validation loss and a sample."""
        done = self.doc(command, TINY, [*STEPS, *extra], **kw)
        if kw.get("expect", 0) == 0:
            out = done.stdout + done.stderr
            assert re.search(r"val loss \d+\.\d+", out), f"{command}: no final validation loss\n{out[-3000:]}"
            assert "sample:" in out, f"{command}: no final sample\n{out[-3000:]}"
        return done

    def files(self, folder: str) -> dict[str, bytes]:
        root = self.cwd / folder
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def journey(request, tmp_path, prewarmed):
    name = request.node.name.removeprefix("test_journey_").split("[")[0]
    return Journey(name, tmp_path, prewarmed)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- journeys

def test_journey_make():
    """`make run` trains the default config (continuing runs/default when run again); `make test` is this suite."""
    makefile = (ROOT / "Makefile").read_text()
    run_recipe = re.search(r"^run:.*\n\t\$\(BYTECODE\)\n\t(.*)", makefile, re.M).group(1)
    assert shlex.split(run_recipe, comments=True) == ["$(VENV)/bin/paratrain", "train", "--checkpoint.resume=auto"]
    assert "TORCH_VERSION ?= 2.13.0" in makefile
    assert re.search(r"^test:.*\n\t\$\(BYTECODE\)\n\t\$\(PY\) -m pytest", makefile, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_journey_default_run(journey):
    """make run's training (tiny), then resume, generate (also from an empty prompt), checkpoint verify, estimate
    on the written config, and a reused run name: refused, then started over."""
    j = journey
    j.doc("paratrain train --checkpoint.resume=auto", TINY, ["--training.steps=3"])
    first = metrics(j.cwd / "runs" / "default")
    # the same command again: continues runs/default from its final checkpoint (nothing left to train: no
    # evaluation or sample either)
    done = j.doc("paratrain train --checkpoint.resume=auto", TINY, [*STEPS, "--training.steps=3"])
    assert "resumed from" in done.stdout + done.stderr and "runs/default already finished at step 3" in done.stdout
    assert [r["step"] for r in metrics(j.cwd / "runs" / "default") if "loss" in r] == \
        [r["step"] for r in first if "loss" in r]  # no step trained twice
    out = j.doc('paratrain generate --checkpoint runs/default --prompt "ROMEO:" --max-new-tokens 300').stdout
    assert out.startswith("ROMEO:") and len(out) > 100
    out = j.doc('paratrain generate --checkpoint runs/default --prompt "" --max-new-tokens 100').stdout
    assert len(out.strip()) > 20
    out = j.doc("paratrain checkpoint verify runs/default").stdout
    assert "OK" in out and "step-3" in out
    j.train("paratrain train --run.name=background --checkpoint.every=10 --checkpoint.async_save=true",
            "--training.steps=4", "--checkpoint.every=2")  # saved in the background at step 2, committed before 4
    assert [p.name for p in complete_checkpoints(j.cwd / "runs/background/checkpoints")] == ["step-2", "step-4"]
    report = json.loads(j.doc("paratrain estimate --model runs/default/config.toml --gpu-memory 24GiB --json").stdout)
    assert report["fits"] is True and report["total_bytes"] > 0 and report["layout"]["world_size"] == 1

    # a new run under an existing name: one line, nothing touched; --run.overwrite=true starts over
    j.train("paratrain train --training.steps=500 --run.name=short", "--training.steps=2")
    before = j.files("runs/short")
    done = j.doc("paratrain train --training.steps=500 --run.name=short", TINY, expect=2)
    assert done.stderr.count("\n") == 1 and "--checkpoint.resume=auto" in done.stderr and "--run.overwrite" in done.stderr
    assert j.files("runs/short") == before
    j.train("paratrain train --run.name=short --run.overwrite=true", "--model.preset=tiny-moe")
    steps = [r["step"] for r in metrics(j.cwd / "runs" / "short") if "loss" in r]
    assert steps == sorted(set(steps)) and sorted(p.name for p in (j.cwd / "runs/short/checkpoints").iterdir()) == ["step-4"]


LAYOUT_RUNS = {
    "paratrain train --nproc 4 --parallel.dp_mode=fsdp --training.micro_batch=3 --run.name=fsdp4": {"dp_shard": 4},
    "paratrain train --nproc 4 --parallel.tp=2 --run.name=tp2": {"dp_shard": 2, "tp": 2},
    "paratrain train --nproc 2 --parallel.tp=2 --parallel.sequence_parallel=false --run.name=tp2-nosp": {"tp": 2},
    "paratrain train --nproc 4 --parallel.dp_mode=hsdp --parallel.dp_replicate=2 --run.name=hsdp":
        {"dp_replicate": 2, "dp_shard": 2},
    "paratrain train --nproc 2 --parallel.pp=2 --run.name=pp2": {"pp": 2},
    "paratrain train --nproc 2 --model.preset=tiny-moe --parallel.ep=2 --run.name=ep2": {"dp_shard": 2},
    "paratrain train --nproc 2 --parallel.cp=2 --run.name=cp2": {"cp": 2},
}


def test_journey_layouts(journey):
    """Every layout example trains to its final sample; the same seed gives every layout the same val loss;
    the report reads the runs."""
    j = journey
    val = {}
    for command, mesh in LAYOUT_RUNS.items():
        # one global batch for all (micro-batches and accumulation follow): the same training on every layout
        done = j.train(command, "--sample.prompt=ROMEO:", "--training.micro_batch=1", "--training.global_batch=4",
                       "--verbose")  # (the ranks' mesh positions)
        out = done.stdout + done.stderr
        for axis, size in mesh.items():
            assert f"'{axis}': {size - 1}" in out, f"{command}: no rank at {axis}={size - 1}\n{out[-2000:]}"
        val[command] = float(re.search(r"val loss (\d+\.\d+)", out).group(1))
        assert "ROMEO:" in out.split("sample:")[-1]
    dense = [v for c, v in val.items() if "moe" not in c]
    assert max(dense) - min(dense) <= 2e-4, f"layouts disagree about the validation loss: {val}"
    import shutil

    shutil.copytree(j.cwd / "runs" / "pp2", j.cwd / "runs" / "default")  # the report's first run (another model)
    done = j.doc("paratrain report runs/default runs/fsdp4 runs/tp2 --out report")
    assert (j.cwd / "report" / "report.md").is_file() and (j.cwd / "report" / "loss.png").is_file()


def write_corpus(path: Path, docs: int = 400) -> Path:
    text = DEFAULT_CORPUS.read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": text[i * 400:(i + 1) * 400]}) + "\n")
    return path


def test_journey_custom_corpus(journey):
    """prepare -> train -> resume on a custom corpus; --data.dir alone uses the prepared dataset as it is, and a
    contradicting option leaves every file of it byte-identical."""
    j = journey
    write_corpus(j.cwd / "corpus.jsonl")
    j.doc("paratrain prepare --input corpus.jsonl --out data/mycorpus --tokenizer bpe --vocab-size 8000")
    prepared = j.files("data/mycorpus")
    j.train("paratrain train --data.dir=data/mycorpus --run.name=mine")
    assert j.files("data/mycorpus") == prepared
    saved = (j.cwd / "runs/mine/checkpoints/step-4").is_dir()
    assert saved
    done = j.train("paratrain train --data.dir=data/mycorpus --run.name=mine --checkpoint.resume=auto",
                   "--training.steps=6", "--data.source=corpus.jsonl", "--data.tokenizer=bpe",
                   "--data.vocab_size=8000")  # options that agree with the dataset are fine
    assert "resumed from" in done.stdout + done.stderr
    assert [r["step"] for r in metrics(j.cwd / "runs/mine") if "loss" in r][-1] == 6
    for wrong in ("--data.tokenizer=char", "--data.vocab_size=500", "--data.source=tinyshakespeare"):
        done = j.doc("paratrain train --data.dir=data/mycorpus --run.name=mine", TINY, [wrong, "--run.name=x"],
                        expect=2)
        assert done.stderr.startswith("error: data/mycorpus holds a dataset") and done.stderr.count("\n") == 1
        assert not (j.cwd / "runs" / "x").exists()
    assert j.files("data/mycorpus") == prepared
    (j.cwd / "data/empty").mkdir()
    done = j.doc("paratrain train --data.dir=data/mycorpus --run.name=mine", TINY,
                    ["--data.dir=data/empty", "--run.name=y"], expect=2)
    assert "holds no prepared dataset" in done.stderr and not any((j.cwd / "data/empty").iterdir())


def test_journey_prepare_formats(journey):
    """The three prepare examples on tiny inputs of their formats."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    j = journey
    text = DEFAULT_CORPUS.read_text()
    (j.cwd / "fineweb").mkdir()
    for k in range(2):
        with gzip.open(j.cwd / "fineweb" / f"part{k}.jsonl.gz", "wt") as f:
            for i in range(100):
                f.write(json.dumps({"text": text[(k * 100 + i) * 300:(k * 100 + i + 1) * 300]}) + "\n")
    (j.cwd / "dolma" / "a").mkdir(parents=True)
    write_corpus(j.cwd / "dolma" / "a" / "docs.jsonl", 50)
    pq.write_table(pa.table({"text": [text[i * 500:(i + 1) * 500] for i in range(60)]}), j.cwd / "corpus.parquet")
    write_corpus(j.cwd / "heldout.jsonl", 5)
    j.doc("paratrain prepare --input fineweb/*.jsonl.gz --out data/web --tokenizer bpe --vocab-size 32000")
    j.doc("paratrain prepare --input dolma/ --out data/dolma --tokenizer data/web/tokenizer.json --text-field text")
    j.doc("paratrain prepare --input corpus.parquet --out data/c --tokenizer byte --val-input heldout.jsonl")
    web, dolma, c = (json.loads((j.cwd / "data" / d / "meta.json").read_text()) for d in ("web", "dolma", "c"))
    assert web["train_documents"] + web["val_documents"] == 200 and web["tokenizer"] == "bpe"
    assert dolma["tokenizer"] == "tokenizer.json" and dolma["vocab_size"] == web["vocab_size"]
    assert c["tokenizer"] == "byte" and c["val_documents"] == 5 and c["train_documents"] == 60


def test_journey_hugging_face(journey):
    """A local Hugging Face folder -> train on 2 ranks (bf16) -> export -> transformers loads and generates."""
    from test_hf import make_llama

    j = journey
    make_llama(j.cwd / "llama-3.2-1b")
    write_corpus(j.cwd / "corpus.jsonl")
    done = j.doc("paratrain train --nproc 2 --model.init_from=hf:llama-3.2-1b --data.source=corpus.jsonl "
                    "--data.dir=data/corpus-llama --training.seq_len=1024 --training.precision=bf16 --optimizer.lr=2e-5 "
                    "--optimizer.warmup_steps=20 --run.name=ft", TINY, [*STEPS, "--training.seq_len=32"])
    out = done.stdout + done.stderr
    assert "initialised from Hugging Face folder" in out and "sample:" in out and "val loss" in out
    assert "0.000 B" not in out
    # the same with tensor parallelism (+ sequence parallel): the imported vocabulary and the sample too
    done = j.doc(JOURNEYS["hugging_face"][0], TINY, [*STEPS, "--training.seq_len=32", "--parallel.tp=2",
                                                        "--run.name=ft-tp", "--sample.prompt=Hello"])
    assert "sample:\nHello" in done.stdout + done.stderr
    j.doc("paratrain export runs/ft --format hf --out ft-hf --dtype bf16")
    config = json.loads((j.cwd / "ft-hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype" if "torch_dtype" in config
                                                                        else "dtype"] == "bfloat16"
    out = j.doc(JOURNEYS["hugging_face"][-1]).stdout
    assert out.startswith("Hello")


def test_journey_fine_tune(journey):
    """A local Hugging Face folder and a chat jsonl -> chat data with loss masks -> the estimate that fits -> LoRA
    training (bf16, packed conversations) -> a PEFT adapter peft loads onto the base, and the merged model
    transformers chats with."""
    from test_chat import save_chat_tokenizer, write_chats
    from test_hf import make_llama

    j, commands = journey, JOURNEYS["fine_tune"]
    save_chat_tokenizer(make_llama(j.cwd / "llama-3.2-1b"))
    write_chats(j.cwd / "chat.jsonl", 40, long_every=9)
    assert "chat: 40 conversations" in j.doc(commands[0]).stdout
    out = j.doc(commands[1]).stdout
    assert "FITS" in out and "frozen parameters (LoRA base)" in out and "41.9M trainable" in out
    out = j.train(commands[2], "--training.seq_len=48")
    text = out.stdout + out.stderr
    assert "LoRA:" in text and "packed into" in text and "initialised from Hugging Face folder" in text
    j.doc(commands[3])
    assert json.loads((j.cwd / "chat-adapter" / "adapter_config.json").read_text())["r"] == 16
    j.doc(commands[4])
    assert (j.cwd / "chat-hf" / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (j.cwd / "chat-hf" / "tokenizer_config.json").read_text())
    assert j.doc(commands[5]).stdout.strip() == "LoraModel"
    j.doc(commands[6])


def test_journey_profile(journey):
    j = journey
    for nproc in ("1", "2"):  # again: the earlier profile is replaced
        out = j.doc("paratrain profile --nproc 2 --parallel.dp_mode=fsdp --steps 3", TINY, ["--nproc", nproc]).stdout
    run = j.cwd / "runs" / "profile" / "profile"
    assert (run / "rank0.json").is_file() and (run / "rank1.json").is_file() and "traces:" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary


def test_journey_scaling(journey):
    """Both sweeps at a tiny size, two timed steps per point: the weak one calibrates this machine for the
    predictions, the strong one reuses that profile."""
    j = journey
    tiny = [a for a in TINY if not a.startswith(("--sample", "--metrics"))]
    j.doc("paratrain scaling --weak --nproc 1,2,4", tiny, ["--steps", "2", "--warmup", "1"])
    weak = json.loads((j.cwd / "runs/scaling-weak/scaling.json").read_text())
    assert [(p["ranks"], p["global_batch"]) for p in weak["points"]] == [(1, 2), (2, 4), (4, 8)]
    assert weak["points"][0]["efficiency"] == 1.0 and all(p["predicted_step_s"] > 0 for p in weak["points"])
    profile = ["--gpu", "scaling", "--profile-dir", "runs/scaling-weak/profile"]
    out = j.doc("paratrain scaling --strong --layouts ddp2,fsdp2,fsdp4", tiny, ["--steps", "2", "--warmup", "1",
                                                                                 *profile]).stdout
    strong = json.loads((j.cwd / "runs/scaling-strong/scaling.json").read_text())
    assert [(p["label"], p["global_batch"]) for p in strong["points"]] == [("ddp2", 8), ("fsdp2", 8), ("fsdp4", 8)]
    assert all(p["samples_per_s"] == pytest.approx(p["tokens_per_s"] / 32) for p in strong["points"])
    assert "| 4 | fsdp4 | 8 |" in out and (j.cwd / "runs/scaling-strong/scaling.png").is_file()


def test_journey_evaluation(journey):
    """docs/evaluation.md's downstream tasks: trained with [eval] (the bundled shakespeare group at the end), then
    `paratrain eval` of the run on one process and on tp2 (the same numbers), and few-shot with samples."""
    evaluation = JOURNEYS["evaluation"]
    done = journey.train(evaluation[0])
    assert "shakespeare_choice" in done.stdout + done.stderr
    run = journey.cwd / "runs" / "evaluated"
    in_loop = [r for r in metrics(run) if "downstream" in r][-1]["downstream"]
    assert set(in_loop) == {"shakespeare_choice", "shakespeare_perplexity", "shakespeare_speaker"}, in_loop
    one = journey.doc(evaluation[1]).stdout
    assert "bits_per_byte" in one and "exact_match" in one
    journey.doc(evaluation[2])

    def results(folder):
        return json.loads(sorted((journey.cwd / folder).rglob("results_*.json"))[-1].read_text())

    tp2, single = results("eval-tp2"), results("runs/evaluated/eval")
    for task, values in in_loop.items():
        for metric, value in values.items():
            for got in (tp2, single):
                assert abs(got["results"][task][f"{metric},none"] - value) <= 1e-6 * max(1.0, abs(value)), (task, metric)
    journey.doc(evaluation[3])
    assert list((run / "eval").rglob("samples_shakespeare_choice_*.jsonl"))
    assert results("runs/evaluated/eval")["n-shot"]["shakespeare_choice"] == 2


@pytest.mark.parametrize("command", JOURNEYS["verify"], ids=JOURNEYS["verify"])
def test_journey_verify(journey, command):
    """Each documented `paratrain verify` command exactly as written (a row runs its own steps at its own tolerance:
    fp8's), in a fresh folder: every row it names passes (docs/architecture.md's z-loss rows, docs/precision.md's fp8
    rows, docs/models.md's DeepSeek rows with a resume among them)."""
    out = journey.doc(command).stdout
    if "--layouts" in command:
        rows = command.split("--layouts")[1].split()[0].split(",")
        assert f"{len(rows)} passed, 0 failed" in out and "FAIL" not in out, out
    else:
        assert "--list" in command and "fsdp2" in out, out


def test_journey_diloco(journey):
    """docs/layouts.md's DiLoCo runs: two replicas synchronise every second step and send nothing in between; the plan
    across 1 Gbit/s ranks DiLoCo first; the measured best setting trains to the end."""
    journey.train(JOURNEYS["diloco"][0])
    sent = [r["diloco_bytes"] for r in metrics(journey.cwd / "runs" / "diloco") if "loss" in r and "step" in r]
    assert [b > 0 for b in sent] == [False, True, False, True], sent
    out = journey.doc(JOURNEYS["diloco"][1]).stdout  # the planner weighs DiLoCo across a 1 Gbit/s link: first
    first = next(line for line in out.splitlines() if line.startswith(" 1 "))
    assert "dp_sync=diloco H=" in first and "MB/step per rank across nodes" in first, out
    assert "DiLoCo ranks first (" in out and 'dp_sync = "diloco"' in (journey.cwd / "plan" / "config.toml").read_text()
    journey.train(JOURNEYS["diloco"][2])  # the measured best setting: streamed 1-bit syncs, plain averaging x 1.4
    config = (journey.cwd / "runs" / "diloco-sign" / "config.toml").read_text()
    assert 'outer_compression = "sign_ef"' in config and "fragments = 2" in config, config


def test_journey_architecture(journey):
    """docs/architecture.md's worked capability, z-loss: a run logs it (its verify rows: test_journey_verify)."""
    journey.train(JOURNEYS["architecture"][0])
    logged = [r["z_loss"] for r in metrics(journey.cwd / "runs" / "zloss") if "loss" in r and "step" in r]
    assert logged and all(z > 0 for z in logged), logged


def test_journey_precision(journey):
    """fp8 (docs/precision.md): a tiny run trains to the end in emulated float8 and the plan predicts it and writes an
    fp8 config (its layouts' verify: test_journey_verify)."""
    journey.train(JOURNEYS["precision"][0])
    config = (journey.cwd / "runs" / "fp8" / "config.toml").read_text()
    assert 'precision = "fp8"' in config
    out = journey.doc(JOURNEYS["precision"][1]).stdout
    assert "float8 linears" in out, out
    assert 'precision = "fp8"' in (journey.cwd / "plan" / "config.toml").read_text()


def test_journey_estimate(journey):
    """The estimate examples; estimating the plan's config.toml gives the per-rank memory the plan printed."""
    plan = journey.cwd / "plan"
    out = subprocess.run([sys.executable, "-m", "paratrain", *shlex.split(PLAN)[1:], "--top", "1"],
                         cwd=journey.cwd, env=journey.env, capture_output=True, text=True, timeout=120).stdout
    planned = float(re.search(r"^ 1 \S+\s+[\d,]+\s+[\d.]+%\s+([\d.]+) GiB", out, re.M).group(1))
    out = journey.doc("paratrain estimate --model plan/config.toml --gpu H100").stdout
    estimated = float(re.search(r"^  total\s+([\d.]+) GiB", out, re.M).group(1))
    assert abs(estimated - planned) <= 0.01 * planned and "FITS" in out and "limit 90%" in out
    assert (plan / "config.toml").is_file()
    out = journey.doc("paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --seq-len 8192 "
                         "--checkpointing selective").stdout
    assert "FITS" in out or "DOES NOT FIT" in out
    out = journey.doc("paratrain estimate --model llama3-8b --accounting classic").stdout
    assert "GiB" in out or "GB" in out


def test_journey_muon(journey):
    """Muon's state and step in the estimate and the plan (docs/optimizers.md): the optimizer state per rank the page
    states, and the plan's optimizer step with the iterations and its written config running Muon."""
    out = journey.doc("paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --optimizer muon").stdout
    assert re.search(r"^  optimizer states\s+4\.23 GiB", out, re.M), out
    out = journey.doc("paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 "
                      "--global-batch-tokens 1048576 --optimizer muon").stdout
    assert float(re.search(r"^best: .* optimizer ([\d.]+) ms", out, re.M).group(1)) > 100, out
    assert 'name = "muon"' in (journey.cwd / "plan" / "config.toml").read_text()


def test_journey_deepseek(journey):
    """docs/models.md's DeepSeek-V3 journey: tiny-deepseek trained on 2 ranks with expert parallelism (its balance and
    multi-token prediction metrics logged), evaluated on 2 ranks, exported as DeepseekV3ForCausalLM that transformers
    generates with (its layouts' verify: test_journey_verify)."""
    j = journey
    steps = JOURNEYS["deepseek"]
    j.train(steps[0], "--training.log_every=1")
    records = [r for r in metrics(j.cwd / "runs" / "deepseek") if "loss" in r]
    assert records and all("moe_max_violation" in r and "mtp_loss" in r for r in records), records[-1]
    out = j.doc(steps[1], after=["--limit", "4"]).stdout
    assert "shakespeare_choice" in out
    j.doc(steps[2])
    config = json.loads((j.cwd / "deepseek-hf" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["n_group"] == 4
    assert j.doc(steps[3]).stdout.startswith("ROMEO:")


def test_journey_qwen(journey):
    """The Qwen presets' estimates print the published parameter counts (docs/models.md's table)."""
    out = journey.doc(JOURNEYS["qwen"][0]).stdout
    assert "model qwen3-8b: 8.19B parameters (8,190,735,360)" in out and "FITS" in out
    out = journey.doc(JOURNEYS["qwen"][1]).stdout
    assert "30.53B parameters (30,532,122,624), 3.35B active per token (3,353,032,704)" in out and "ep=8" in out


PLAN = "paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576"


def doc_block(page: str, first: str) -> list[str]:
    """The commands of the ```bash block of `page` that holds command `first`, in order (comments removed)."""
    for where, body in doc_blocks("bash"):
        lines = body.replace("\\\n", " ").splitlines()
        commands = [canonical(line) for line in lines if shlex.split(line, comments=True)]
        if where == page and canonical(first) in commands:
            return commands
    raise AssertionError(f"{page} has no ```bash block with {first!r}")


def test_journey_plan(journey):
    """The planner's examples run as written, one after another in one folder, every line in the page's order (the
    calibration's in journey calibrate: they write only the profile); what each says."""
    j = journey
    shown = [c for c in doc_block("docs/estimate-and-plan.md", PLAN) if "--calibrate" not in c]
    assert shown == [canonical(c) for c in JOURNEYS["plan"]], "run the page's plan examples in its order"
    plan_args = shlex.split(PLAN)[2:]
    out = {c: j.doc(c, before=plan_args if " ... " in c else ()).stdout for c in JOURNEYS["plan"]}
    assert (j.cwd / "plan" / "config.toml").is_file() and (j.cwd / "plan-70b-64" / "config.toml").is_file()
    assert "compile = true" in (j.cwd / "plan-compile" / "config.toml").read_text()
    assert json.loads(out["paratrain plan ... --json --no-write"])["written"] is None
    assert "agree within 1% on every rank built" in out["paratrain plan ... --check --no-write"]
    assert "tp=16" in out["paratrain plan ... --explain fsdp,tp=16"]
    assert "does not fit" in out["paratrain plan ... --explain ddp,ac=none,mb=2"]
    assert "limit 90% = 36.00 GiB" in out["paratrain plan ... --gpu-memory 40GiB --no-write"]
    assert ", fp32 (matmuls at the fp32 peak" in out["paratrain plan ... --precision fp32 --tf32 false --no-write"]  # no TF32
    assert (j.cwd / "plan-hetero" / "config.toml").is_file()
    assert sorted(p.name for p in j.cwd.iterdir() if p.name.startswith("plan")) == [
        "plan", "plan-70b-64", "plan-compile", "plan-hetero"]


def test_journey_memory_tiers(journey):
    """What does not fit: the estimate names a tier on the same 4 GPUs; both plans use tiers and their configs load as
    `paratrain train --config` reads them (checked without the data: the models are too big for a CPU run)."""
    from paratrain.config import load_config
    from paratrain.spec import check

    j = journey
    out = j.doc("paratrain estimate --model llama3-8b --gpu RTX4090 --dp-shard 4 --seq-len 4096").stdout
    best = next(line for line in out.splitlines() if line.startswith("would fit:"))
    assert "GPUs instead" not in best and "host" in best and "GPU time per token" in best
    for command, world in (("paratrain plan --model llama3-8b --gpus 4 --gpus-per-node 4 --gpu RTX4090 --intra pcie4 "
                            "--seq 4096 --global-batch-tokens 65536 --host-memory 256GiB --out plan-4090", 4),
                           ("paratrain plan --model llama3-70b --gpus 8 --gpu H100 --seq 4096 --global-batch-tokens "
                            "262144 --host-memory 2TiB --out plan-70b", 8)):
        assert "memory tiers" in j.doc(command).stdout
        cfg = load_config(j.cwd / shlex.split(command)[-1] / "config.toml")
        assert cfg.memory.cpu_offload and check(cfg, world).world_size == world


def test_journey_calibrate(journey):
    j = journey
    quick = ["--calibrate-seconds", "0.005"]
    j.doc("paratrain plan --calibrate --name mybox --nproc 4", after=[*quick, "--nproc", "2"])  # tiny: 2 ranks
    profile = j.cwd / ".cache" / "paratrain" / "profiles" / "mybox.json"
    assert profile.is_file()
    # the model's own shapes, at a tiny model's size (llama3.2-1b at 2048 tokens takes minutes on a CPU)
    j.doc("paratrain plan --calibrate --name mybox --nproc 1 --model llama3.2-1b --seq 2048 --micro-batches 1,2",
             after=[*quick, "--model", "tiny", "--vocab-size", "256", "--seq", "32"])
    out = j.doc(PLAN, after=["--gpu", "mybox", "--gpus", "4", "--gpus-per-node", "4", "--model", "tiny",
                               "--vocab-size", "256", "--seq", "32", "--global-batch-tokens", "256"]).stdout
    assert "mybox" in out


def test_journey_troubleshooting(journey):
    """Rank 1's weight made to overflow before step 6 (PARATRAIN_FAULTS): the run names the layer, the rank and the
    step in one line, rolls back and finishes; the report draws the heat map; the replay names them again. Rank 1
    of 4 stopped in the middle of a step: one timeout line, and `doctor --hang` names rank 1 and the collective it
    holds up. The planner's 70B layout for 64 nodes (world 512) built here in under a minute of CPU, its model states
    within 1% of the estimate."""
    import resource
    import signal
    import time

    import psutil

    j = journey
    watched = JOURNEYS["troubleshooting"][0]
    j.env["PARATRAIN_FAULTS"] = "overflow@5:1"
    done = j.train(watched, "--training.steps=8", "--checkpoint.every=4", "--resilience.max_bad_steps=2",
                   "--metrics.numerics_every=2")
    out = done.stdout + done.stderr
    assert ("step 6: non-finite loss or gradient norm, update skipped (1 skipped so far); first non-finite output: "
            "layers.1.attention.wo (rank 1, step 6, batch 5); replay: paratrain replay runs/watched step-6") in out
    assert "rolled back to runs/watched/checkpoints/step-4" in out
    bad = [r for r in metrics(j.cwd / "runs/watched") if "nonfinite" in r]
    assert [r["step"] for r in bad] == [6, 7]  # both bad steps keep their records, marked skipped
    assert all(r["skipped"] for r in bad)
    assert bad[0]["nonfinite"] == {"module": "layers.1.attention.wo", "rank": 1, "batch": 5}
    assert bad[0]["numerics"]["grad_max"][0] is not None  # a watched step: its own numbers, gradients included
    j.doc("paratrain report runs/watched")
    assert (j.cwd / "runs/watched/report/numerics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = j.doc("paratrain replay runs/watched step-6").stdout
    assert "replayed step 6 of runs/watched from checkpoint step-4: batch 5, loss nan" in out
    assert "first non-finite output: layers.1.attention.wo (rank 1)" in out
    del j.env["PARATRAIN_FAULTS"]

    # a hung rank: rank 1 of 4 (tp2 x fsdp2) SIGSTOPs itself in the middle of step 4's forward
    started = time.monotonic()
    stuck = subprocess.run([sys.executable, "-m", "paratrain", "train", "--nproc", "4", *TINY, "--parallel.tp=2",
                            "--training.steps=6", "--run.name=stuck", "--resilience.collective_timeout_s=8"],
                           cwd=j.cwd, env={**j.env, "PARATRAIN_FAULTS": "hang@3:1"}, capture_output=True, text=True,
                           timeout=300)
    records = [json.loads(p.read_text()) for p in sorted((j.cwd / "runs/stuck/hang").glob("rank*.json"))]
    left = [pid for r in records for pid in [r["pid"], *(p["pid"] for p in r["peers"].values())]
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # only the ranks this run started (their pids are in its records)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks left running: {left}"
    assert stuck.returncode == 3, stuck.stderr[-3000:]
    assert stuck.stderr.count("error:") == 1 and "resilience.collective_timeout_s=8" in stuck.stderr
    assert "every rank's collective history: paratrain doctor --hang runs/stuck" in stuck.stderr
    assert time.monotonic() - started < 240
    lines = j.doc("paratrain doctor --hang runs/stuck").stdout.splitlines()
    assert lines[0] == "hang records of runs/stuck: 3 of 4 ranks (at step 4); none from rank 1"
    behind = [line for line in lines if " is behind" in line]
    assert len(behind) == 1 and behind[0].startswith("rank 1 is behind: rank") and "all_gather #" in behind[0]
    assert "stopped (SIGSTOP, or a debugger)" in behind[0]
    assert sorted(int(line.split()[1]) for line in lines if line.startswith("  rank ")) == [0, 2, 3]

    # the 70B plan for 64 nodes, built here
    j.doc("paratrain plan --model llama3-70b --gpus 512 --gpu H100 --seq 8192 --global-batch-tokens 8388608")
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = j.doc("paratrain train --dry-run --world 512 --config plan/config.toml").stdout
    spent = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert spent.ru_utime + spent.ru_stime - cpu.ru_utime - cpu.ru_stime < 60, out
    assert "on 512 ranks" in out and "agree within 1% on every rank built" in out
    assert re.findall(r"^ +(\d+) \| pp=(\d) ", out, re.M) == [("0", "0"), ("128", "1"), ("256", "2"), ("384", "3")]
