"""Pipeline parallelism: every schedule and the pp x dp x tp layouts against one process, bad inputs, the
bubble report, evaluation/generation through the stages, and checkpoints between pipelined and plain layouts."""

from __future__ import annotations

import json

import pytest

from paratrain.config import load_config
from paratrain.errors import ConfigError

from conftest import assert_plan_rejected, fast_overrides
from test_distributed import MATRIX_STEPS

TOL = 1e-5
VAL_TOL = 1e-6  # one checkpoint's val loss on the layout against one process


def check_rows(layouts, char_data, steps=MATRIX_STEPS):
    from paratrain.verify import run_verify

    rows, _ = run_verify(layouts, steps=steps, tolerance=TOL, extra_args=[f"data.dir={char_data}"], echo=lambda line: None,
                         share_launches=True)
    report = "\n".join(f"{r.layout}: dloss {r.max_loss_diff:.2e} dweight {r.max_weight_diff:.2e} dval {r.val_diff:.2e} "
                       f"{r.note}" for r in rows)
    assert [r.layout for r in rows] == layouts
    for r in rows:
        assert len(r.losses) == steps, report
        assert r.max_loss_diff <= TOL and r.max_weight_diff <= TOL and r.val_diff <= VAL_TOL, report


def test_verify_pp_schedules(char_data):
    """pp2 with each schedule (gpipe, 1f1b, interleaved 1f1b, zero bubble) against one process at 1e-5."""
    check_rows(["pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zb"], char_data)


def test_verify_pp_composed(char_data):
    """pp2 x dp2 (fsdp), pp2 x tp2 and the 3-D pp2 x dp2 x tp2 on 8 ranks, against one process at 1e-5."""
    check_rows(["pp2xdp2", "pp2xtp2", "pp2xdp2xtp2"], char_data, steps=8)


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["parallel.pp=2", "model.n_layers=1"], "= 2 pipeline stages, but the model has only 1 blocks"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=3"], "parallel.pp_microbatches=3 does not divide"),
    (4, ["parallel.pp=4", "parallel.pp_schedule=zbv", "model.n_layers=6"],
     "parallel.pp=4 x 2 virtual stages (zbv) = 8 pipeline stages, but the model has only 6 blocks"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=3", "model.n_layers=4"],
     "= 6 pipeline stages, but the model has only 4 blocks"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=1"], "needs at least parallel.pp=2"),
    (2, ["parallel.pp=2", "parallel.pp_virtual_stages=2"], "needs an interleaved schedule"),
    (2, ["parallel.pp=2", "parallel.pp_split=1,2", "model.n_layers=4"], "parallel.pp_split='1,2' must give 2 stages"),
    (2, ["parallel.pp=2", "model.tie_embeddings=true"], "tied embeddings do not compose with pipeline"),
    (3, ["parallel.pp=2"], "does not divide the world size 3"),
])
def test_bad_pipeline_inputs_fail_before_launch(char_data, tmp_path, world, overrides, message):
    assert_plan_rejected(char_data, tmp_path, world, overrides, message, micro_batch=4)


def test_unknown_schedule_name_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["parallel.pp_schedule=1f1f"])
    assert "did you mean '1f1b'" in str(e.value) and "\n" not in str(e.value)


def test_balanced_split_and_bubble_formula():
    from paratrain.layout import predicted_bubble
    from paratrain.stage_split import balanced_split
    from paratrain.models.presets import preset_args

    args = preset_args("tiny", vocab_size=128, n_layers=8)
    split = balanced_split(args, 4)
    assert sum(split) == 8 and len(split) == 4 and min(split) >= 1
    assert split[0] <= split[1] and split[-1] <= split[1]  # the embedding/output stages take fewer blocks
    assert predicted_bubble(2, 4) == pytest.approx(1 / 5)
    assert predicted_bubble(4, 8, virtual=2) == pytest.approx(3 / 11 / 2)


def test_pp_run_evaluates_generates_reports_bubble_and_resumes_unpipelined(char_data, tmp_path):
    """A pp2 run with evaluation, a sample and a final checkpoint; its metrics carry the measured bubble; the
    checkpoint resumes on one process (the stages saved their own parameter names)."""
    from paratrain.api import run_rank
    from paratrain.distributed.launch import launch
    from paratrain.api import train_rank as train

    common = ("training.steps=4", "training.global_batch=8", "training.eval_every=2", "checkpoint.every=2")
    pp = launch(run_rank, (load_config(None, fast_overrides(
        char_data, tmp_path, "pp", *common, "parallel.pp=2", "sample.max_new_tokens=8")),), 2)
    assert len(pp.losses) == 4 and pp.val_loss is not None and len(pp.sample_text) == 8
    records = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert all(0.0 <= r["pp_bubble_measured"] <= 1.0 and len(r["pp_bubble_per_stage"]) == 2 for r in steps)
    one = train(load_config(None, fast_overrides(char_data, tmp_path, "one", *common, "training.micro_batch=8")))
    assert abs(pp.val_loss - one.val_loss) <= TOL
    # resume the pipelined run's step-2 checkpoint on one process: steps 3-4 match the uninterrupted run
    resumed = train(load_config(None, fast_overrides(
        char_data, tmp_path, "resumed", *common, "training.micro_batch=8",
        f"checkpoint.resume={tmp_path / 'pp' / 'checkpoints' / 'step-2'}")))
    assert max(abs(a - b) for a, b in zip(resumed.losses, one.losses[2:])) <= TOL


@pytest.mark.parametrize("extra, message", [
    (["--model.n_layers=1"], "but the model has only 1 blocks"),
    (["--parallel.pp_schedule=zbv", "--model.n_layers=3"], "(zbv) = 4 pipeline stages"),
    (["--parallel.pp_microbatches=3"], "does not divide the batch of each data-parallel rank"),
    (["--parallel.pp_schedule=gpipe2"], "parallel.pp_schedule: 'gpipe2' is not one of"),
])
def test_cli_pipeline_errors_are_one_line_before_launch(char_data, tmp_path, capsys, monkeypatch, extra, message):
    from paratrain import cli

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "bad")]
    rc = cli.main(["train", "--nproc", "2", *args, "--parallel.pp=2", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "bad").exists()
