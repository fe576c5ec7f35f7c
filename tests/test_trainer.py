"""The training loop on one CPU process: learning, metrics log, checkpoints, exact resume, generate, bf16, accumulation."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import fast_config
from paratrain import cli
from paratrain.api import train_rank as train

LEARN = ["optimizer.warmup_steps=2", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_state_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def short_run(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("short")
    cfg = fast_config(char_data, out, "short", "training.steps=24", "checkpoint.every=8", "checkpoint.keep=2", *LEARN)
    return cfg, train(cfg)


def test_loss_decreases(short_run):
    cfg, result = short_run
    losses = result.losses
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert 3.5 < losses[0] < 5.5  # about ln(vocab) at init
    assert sum(losses[-4:]) / 4 < losses[0] - 0.8
    assert result.val_loss is not None and math.isfinite(result.val_loss) and result.val_loss < losses[0] - 0.5
    assert result.run_dir == cfg.run_dir and result.skipped_steps == 0


def test_metrics_log(short_run):
    cfg, result = short_run
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert [r["loss"] for r in steps] == result.losses
    for r in steps:
        for key in ("time", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "tokens"):
            assert key in r and math.isfinite(r[key]), key
        assert r["tokens"] == r["step"] * 4 * 32
    assert steps[0]["lr"] == pytest.approx(5e-3)  # warmup: step 1 of 2
    lrs = [r["lr"] for r in steps[2:]]
    assert all(x > y for x, y in zip(lrs, lrs[1:])) and 1e-3 <= lrs[-1] < 1.1e-3  # cosine decay towards min_lr
    assert records[-2] == {"time": records[-2]["time"], "step": 24, "val_loss": result.val_loss}
    assert {k: v for k, v in records[-1].items() if k != "time"} == {  # the last record: how the run ended
        "step": 24, "end": "finished", "checkpoint_save_s": records[-1]["checkpoint_save_s"], "checkpoint_step": 24}
    assert (cfg.run_dir / "config.toml").is_file()


def test_checkpoint_folder(short_run):
    cfg, _ = short_run
    root = cfg.run_dir / "checkpoints"
    # Saved at 8 and 16, and at the end (24); keep=2 prunes the oldest. No temporary folders left.
    assert sorted(p.name for p in root.iterdir()) == ["step-16", "step-24"]
    final = root / "step-24"
    names = {p.name for p in final.iterdir()}
    assert {"COMPLETE", "trainer.pt", ".metadata", "meta.json", "chars.json"} <= names
    assert any(n.endswith(".distcp") for n in names)
    assert (final / "COMPLETE").read_text().strip() == "24"
    state = torch.load(final / "trainer.pt", weights_only=True)
    assert state["step"] == 24 and state["model_args"]["dim"] == 64 and "config_toml" in state


def test_resume_is_exact(char_data, tmp_path):
    # A: 8 steps straight, saving at step 4 (and at the end).
    a_cfg = fast_config(char_data, tmp_path, "A", "training.steps=8", "checkpoint.every=4", *LEARN)
    a = train(a_cfg, want_final_weights=True)
    step4 = a_cfg.run_dir / "checkpoints" / "step-4"
    assert step4.is_dir() and len(a.losses) == 8

    # B: same config (same schedule: steps=8) resumed from A's step-4 folder by path.
    b = train(fast_config(char_data, tmp_path, "B", "training.steps=8", "checkpoint.every=4",
                          f"checkpoint.resume={step4}", *LEARN), want_final_weights=True)
    assert b.losses == a.losses[4:]  # bitwise
    assert b.val_loss == a.val_loss
    assert_state_equal(b.final_weights, a.final_weights)
    assert [r["step"] for r in read_jsonl(tmp_path / "B" / "metrics.jsonl") if "loss" in r] == [5, 6, 7, 8]

    # C: the step-4 folder copied into a fresh run's checkpoints, resumed with resume=auto.
    shutil.copytree(step4, tmp_path / "C" / "checkpoints" / "step-4")
    c = train(fast_config(char_data, tmp_path, "C", "training.steps=8", "checkpoint.every=4",
                          "checkpoint.resume=auto", *LEARN), want_final_weights=True)
    assert c.losses == a.losses[4:]
    assert_state_equal(c.final_weights, a.final_weights)


def test_generate_cli(trained_run, capsys):
    argv = ["generate", "--checkpoint", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "20"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ROMEO:") and out.endswith("\n")
    assert len(out) == len("ROMEO:") + 20 + 1  # char tokenizer: one character per token
    assert "\ufffd" not in out  # padding ids of the model's vocab are never sampled
    # Deterministic for a seed; a step folder works as well as the run folder.
    # stderr names the checkpoint and step it sampled from (a run folder: its newest), stdout is the text alone
    step_dir = next((trained_run / "checkpoints").iterdir())
    assert err == f"sampling from {step_dir} (step 3)\n"
    assert cli.main(["generate", "--checkpoint", str(step_dir), "--prompt", "ROMEO:", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr() == (out, err)


def test_resuming_a_finished_run_trains_nothing(char_data, tmp_path, capsys):
    """resume=auto on a run whose newest checkpoint is its final step: one line says so, exit 0, nothing trained or
    written (issue 35)."""
    from conftest import fast_overrides

    argv = ["train", *(f"--{o}" for o in fast_overrides(char_data, tmp_path, "done", "training.steps=2"))]
    assert cli.main(argv) == 0
    run = tmp_path / "done"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main([*argv, "--checkpoint.resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"{run} already finished at step 2: nothing to train" in out and "val loss" not in out
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_bf16_on_cpu(char_data, tmp_path):
    result = train(fast_config(char_data, tmp_path, "bf16", "training.precision=bf16", "training.steps=3", *LEARN))
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    assert math.isfinite(result.val_loss)
    assert 3.5 < result.losses[0] < 5.5


def test_gradient_accumulation_matches_big_batch(char_data, tmp_path):
    # Adam's eps 1e-6: with the default 1e-8 a rounding-level gradient difference on a rarely seen embedding row
    # (second moment near zero) becomes a step-sized weight difference, which says nothing about accumulation.
    common = ["training.steps=4", "checkpoint.save_final=false", *LEARN, "optimizer.eps=1e-6"]
    big = train(fast_config(char_data, tmp_path, "big", "training.micro_batch=8", "training.accum_steps=1", *common),
                want_final_weights=True)
    acc = train(fast_config(char_data, tmp_path, "acc", "training.micro_batch=2", "training.accum_steps=4", *common),
                want_final_weights=True)
    fixed = train(fast_config(char_data, tmp_path, "gb", "training.micro_batch=2", "training.global_batch=8", *common))
    assert len(big.losses) == len(acc.losses) == 4
    for x, y, z in zip(big.losses, acc.losses, fixed.losses):
        assert abs(x - y) < 1e-5 and abs(x - z) < 1e-5
    for k, v in big.final_weights.items():
        torch.testing.assert_close(acc.final_weights[k], v, rtol=0, atol=1e-5)
    assert not (tmp_path / "big" / "checkpoints").exists()  # save_final=false


def test_lr_reaches_min_lr_at_last_step():
    from paratrain.config import OptimizerConfig
    from paratrain.training.optim import lr_at

    cfg = OptimizerConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2)
    assert lr_at(0, cfg, 24) == pytest.approx(5e-3) and lr_at(1, cfg, 24) == pytest.approx(1e-2)
    assert lr_at(23, cfg, 24) == pytest.approx(1e-3)


def test_tied_embeddings_stay_tied_in_training(char_data, tmp_path):
    result = train(fast_config(char_data, tmp_path, "tied", "model.tie_embeddings=true", "training.steps=2",
                               "checkpoint.save_final=false", *LEARN), want_final_weights=True)
    w = result.final_weights
    assert torch.equal(w["output.weight"], w["tok_embeddings.weight"])
