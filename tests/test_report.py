"""`paratrain report` tells runs apart correctly (saves, layouts, unfinished runs, scaling curves of sweeps only),
and the trainer's header and MFU say what they measure (model name, M/B parameter counts, no MFU without a peak)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import fast_config
from paratrain import cli
from paratrain.observe.report import load_run, scaling_note, summarize, write_report


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def row_of(md: str, name: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {name} |"))


@pytest.fixture(scope="module")
def cpu_run(char_data, tmp_path_factory):
    """One process, no configured peak (the CPU's matmul is measured), a save after every step and the final one."""
    import contextlib
    import io

    from paratrain.api import train_rank as train

    out = tmp_path_factory.mktemp("report")
    cfg = fast_config(char_data, out, "saves", "training.steps=4", "checkpoint.every=1", "checkpoint.keep=10",
                      "metrics.peak_tflops=0", "metrics.progress=lines", "training.log_every=1")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        train(cfg)
    return cfg.run_dir, text.getvalue()


def test_no_mfu_percentage_without_a_datasheet_peak(cpu_run):
    run_dir, out = cpu_run
    header = next(line for line in out.splitlines() if line.startswith("model tiny:"))
    assert "MFU n/a on cpu: no datasheet peak" in header and "set metrics.peak_tflops" in header
    assert "0.11M parameters" in header  # 108,864: an M-unit count, not "0.000 B"
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps and not any("mfu" in line or "%" in line for line in steps)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert all(r["mfu"] is None for r in records)
    assert "0.11M parameters (108,864)" in (run_dir / "memory-estimate.txt").read_text()  # the estimate's table
    assert summarize(load_run(run_dir))["mfu"] is None


def test_is_datasheet_peak():
    from paratrain.observe.flops import is_datasheet_peak

    assert is_datasheet_peak("configured") and is_datasheet_peak("datasheet (NVIDIA H100 80GB HBM3)")
    assert not is_datasheet_peak("measured CPU matmul") and not is_datasheet_peak("measured (X not in table)")


def test_format_params():
    from paratrain.models import format_params

    assert [format_params(n) for n in (108_864, 800_000, 124_439_808, 6_738_415_616)] == \
        ["0.11M", "0.80M", "124.4M", "6.74B"]


def test_report_counts_every_checkpoint_save(cpu_run, tmp_path):
    run_dir, _ = cpu_run
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert records[-1]["end"] == "finished" and records[-1]["checkpoint_step"] == 4  # the final save
    write_report([run_dir], tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert s["checkpoint_saves"] == 4 and s["status"] == "finished"
    assert "| saves | 4 |" in (tmp_path / "report.md").read_text()


def test_report_marks_unfinished_runs(cpu_run, tmp_path):
    run_dir, _ = cpu_run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copy(run_dir / "config.toml", crashed / "config.toml")
    (crashed / "config.toml").write_text((crashed / "config.toml").read_text().replace('name = "saves"',
                                                                                     'name = "crashed"'))
    steps = [line for line in lines if '"loss"' in line]
    (crashed / "metrics.jsonl").write_text("\n".join(steps[:2]) + "\n")  # killed after step 2 of 4
    ended_early = tmp_path / "no-end"  # every step, but no final record (died in the final save)
    shutil.copytree(crashed, ended_early)
    (ended_early / "metrics.jsonl").write_text("\n".join(steps) + "\n")
    (ended_early / "config.toml").write_text((crashed / "config.toml").read_text().replace('"crashed"', '"no-end"'))
    assert load_run(crashed).status == "unfinished (no final record; stopped at step 2 of 4)"
    assert load_run(ended_early).status == "unfinished (no final record; stopped at step 4 of 4)"
    assert load_run(run_dir).status == "finished"
    write_report([run_dir, crashed], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| finished |" in row_of(md, "saves")
    assert "unfinished (no final record; stopped at step 2 of 4)" in row_of(md, "crashed")
    assert "Note: crashed is unfinished" in md


def fake_run(root, name: str, world: int, model: str = "tiny", params: int = 108_864, tokens_per_step: int = 128,
             tok_s: float = 1000.0):
    """A run folder as the trainer writes it, with made-up numbers."""
    d = root / name
    d.mkdir()
    (d / "config.toml").write_text(f'[run]\nname = "{name}"\n[training]\nsteps = 3\n')
    records = []
    for step in (1, 2, 3):
        r = {"step": step, "loss": 4.0 - step / 10, "tokens": step * tokens_per_step, "tokens_per_s": tok_s * world,
             "tokens_per_s_per_device": tok_s, "mfu": None, "step_time_s": 0.1}
        if step == 1:
            r.update(layout=f"fsdp {world}" if world > 1 else "1 rank", world_size=world, model=model, params=params)
        records.append(r)
    records += [{"step": 3, "val_loss": 3.5}, {"step": 3, "end": "finished"}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_report_marks_a_preempted_run_and_its_resumption(tmp_path):
    d = fake_run(tmp_path, "pre", 1)
    records = read_jsonl(d / "metrics.jsonl")[:2] + [{"step": 2, "end": "preempted", "checkpoint_save_s": 0.5,
                                                        "checkpoint_step": 2}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(d)
    assert run.status == "preempted at step 2 of 3 (resumable)" and run.saves == {2: 0.5}
    resumed = records + [{"step": 3, "loss": 3.0, "tokens": 384}]  # resumed, then killed: no end record
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in resumed))
    assert load_run(d).status == "unfinished (no final record; stopped at step 3 of 3)"


def fake_sweep(root, kind: str, points: list[tuple[str, int, float]]):
    """A `paratrain scaling` sweep's folder: scaling.json and one run per point (run name, ranks, tokens/s)."""
    root.mkdir()
    runs = [fake_run(root, name, ranks, tok_s=tok_s / ranks) for name, ranks, tok_s in points]
    (root / "scaling.json").write_text(json.dumps({"kind": kind, "title": "fake", "points": [
        {"label": name, "run": name, "ranks": ranks, "tokens_per_s": tok_s} for name, ranks, tok_s in points]}))
    return runs


def test_scaling_curves_come_from_one_sweep_only(tmp_path, capsys):
    """A strong and a weak sweep each draw their curve with the sweep's numbers; an ordinary run and a point whose
    sweep has no other device count given are left out, named in one line."""
    strong = fake_sweep(tmp_path / "scaling-strong", "strong", [("ddp2", 2, 2000.0), ("fsdp2", 2, 1900.0),
                                                                ("fsdp4", 4, 3600.0)])
    weak = fake_sweep(tmp_path / "scaling-weak", "weak", [("fsdp-1", 1, 1000.0), ("fsdp-2", 2, 1800.0)])
    other = fake_sweep(tmp_path / "other-weak", "weak", [("fsdp-1", 1, 900.0), ("fsdp-4", 4, 3000.0)])
    ordinary = fake_run(tmp_path, "a1", 1)
    out = tmp_path / "out"
    assert cli.main(["report", *map(str, [*strong, *weak, other[1], ordinary]), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(p["devices"], p["run"], p["tokens_per_s"]) for p in summary["scaling"]] == [(2, "ddp2", 2000.0),
                                                                                         (4, "fsdp4", 3600.0)]
    assert summary["scaling"][1]["efficiency"] == pytest.approx(0.9)
    assert [(p["devices"], p["efficiency"]) for p in summary["weak_scaling"]] == [(1, 1.0), (2, pytest.approx(0.9))]
    left = {x["run"]: x["reason"] for x in summary["scaling_left_out"]}
    assert left == {"a1": "not a point of a `paratrain scaling` sweep",
                    "fsdp-4": "no other device count of its sweep given (other-weak)"}
    note = summary["scaling_note"]
    assert note.startswith("Left out of the scaling curves") and "\n" not in note
    assert note in capsys.readouterr().out and note in (out / "report.md").read_text()
    assert (out / "scaling.png").is_file()


def test_ordinary_runs_get_no_scaling_curve_and_the_reason(tmp_path, capsys):
    """Two ordinary runs of different step counts (and devices): no scaling plot, and one printed line says why."""
    one = fake_run(tmp_path, "one", 1)
    four = fake_run(tmp_path, "four", 4, tok_s=300.0)
    lines = (four / "metrics.jsonl").read_text().splitlines()
    (four / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[-2:]) + "\n")  # 2 steps, not 3
    (four / "config.toml").write_text('[run]\nname = "four"\n[training]\nsteps = 2\n')
    out = tmp_path / "out"
    assert cli.main(["report", str(one), str(four), "--out", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "scaling" in line]
    assert len(printed) == 1 and printed[0].startswith("No scaling curve: one (not a point of a `paratrain scaling` "
                                                       "sweep); four (not a point")
    assert "paratrain scaling --weak|--strong" in printed[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scaling"] == summary["weak_scaling"] == [] and not (out / "scaling.png").exists()
    md = (out / "report.md").read_text()
    assert printed[0] in md and "## Scaling" not in md
    assert scaling_note(1, False, summary["scaling_left_out"][:1]) is None  # one run: nothing to compare


def test_memory_plot_starts_at_zero(tmp_path):
    """25 MiB of jitter on 383 MiB is drawn on an axis from 0, not as a cliff."""
    from paratrain.observe.report import plot_memory, pyplot

    d = fake_run(tmp_path, "mem", 2)
    records = read_jsonl(d / "metrics.jsonl")
    for r, rss in zip((r for r in records if "loss" in r), (383, 408, 390)):
        r["rank_memory"] = [{"rank": rank, "node": 0, "rss_bytes": (rss + rank) * 2**20} for rank in (0, 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = plot_memory([load_run(d)])
    try:
        bottom, top = fig.axes[0].get_ylim()
        assert bottom == 0 and 409 < top < 450
        assert [list(line.get_ydata()) for line in fig.axes[0].lines] == [[383, 408, 390], [384, 409, 391]]
    finally:
        pyplot().close(fig)


def test_layout_label_from_an_older_log(tmp_path):
    """A log without the trainer's layout record: the label comes from config.toml through Layout."""
    d = fake_run(tmp_path, "old", 2)
    records = [{k: v for k, v in r.items() if k not in ("layout", "world_size", "model", "params")}
               for r in read_jsonl(d / "metrics.jsonl")]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "config.toml").write_text('[run]\nname = "old"\n[parallel]\ntp = 2\n[training]\nsteps = 3\n')
    assert load_run(d).layout == "tp2"
    (d / "config.toml").write_text('[run]\nname = "old"\n[parallel]\nep = 2\n[training]\nsteps = 3\n')
    assert load_run(d).layout == "fsdp 2 x ep2"


def test_report_labels_tp_ep_pp_runs(char_data, tmp_path):
    """Three layouts trained by one launch of two ranks: the report names each by its Layout's short name. The
    numerics watch on every step: each row's numbers gathered over the ranks that hold it (a pipeline's first step
    is not watched: torch's shape inference runs the later stage over uninitialised tensors then)."""
    from paratrain.distributed.launch import launch

    base = ["training.steps=2", "training.global_batch=8", "training.eval_every=0", "checkpoint.save_final=false",
            "resilience.collective_timeout_s=60", "metrics.numerics_every=1"]
    cfgs = [fast_config(char_data, tmp_path, "tp", *base, "parallel.tp=2"),
            fast_config(char_data, tmp_path, "ep", *base, "model.preset=tiny-moe", "parallel.ep=2"),
            fast_config(char_data, tmp_path, "pp", *base, "parallel.pp=2")]
    launch(_train_all, tuple(cfgs), 2)
    write_report([tmp_path / n for n in ("tp", "ep", "pp")], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    layouts = {s["name"]: s["layout"] for s in json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]}
    assert layouts["tp"] == "tp2" and layouts["ep"] == "fsdp 2 x ep2"
    assert layouts["pp"].startswith("pp2 1f1b m=") and "m=0" not in layouts["pp"]
    assert "| tp2 |" in row_of(md, "tp") and "| fsdp 2 x ep2 |" in row_of(md, "ep")
    assert all("| 2 |" in row_of(md, n) for n in ("tp", "ep", "pp"))  # devices
    for name, steps in (("tp", [1, 2]), ("ep", [1, 2]), ("pp", [2])):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        watched = [r for r in records if "numerics" in r]
        assert [r["step"] for r in watched] == steps, name
        n = watched[-1]["numerics"]
        assert all(0 < v < 10 for k in ("act_max", "grad_max", "weight_max") for v in n[k]), (name, n)
        assert all(v is not None for v in n["attn_logit_max"][1:-1]), (name, n)
        assert (n["mlp_max"][2] is None) == (name == "ep"), (name, n)  # tiny-moe's second block: experts


def _train_all(*cfgs):
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]
