"""Long runs survive: exact resume (same and other layouts), crashes, preemption, bad steps, OOM. (A hung rank,
rank 1 of 4 stopped mid-step, runs in tests/test_journeys.py's troubleshooting journey, with its diagnosis.)

Faults are real: PARATRAIN_FAULTS makes a rank SIGKILL or SIGTERM itself, or injects a NaN loss / an out-of-memory
error at a chosen step (paratrain/faults.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from paratrain.training.checkpoint import checkpoint_problem, complete_checkpoints
from paratrain.api import run_rank
from paratrain.config import load_config
from paratrain.distributed.launch import launch
from paratrain.api import train_rank as train

from conftest import fast_overrides

TOL = 1e-5
STEPS = 20
BASE = ["training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2", "optimizer.lr=3e-3",
        "checkpoint.keep=3", f"training.steps={STEPS}", "resilience.collective_timeout_s=60"]
LAYOUTS = {
    "single": (1, ["training.micro_batch=8"]),
    "ddp2": (2, ["parallel.dp_mode=ddp", "training.micro_batch=4"]),
    "zero1x2": (2, ["parallel.dp_mode=zero1", "training.micro_batch=4"]),
    "fsdp2": (2, ["parallel.dp_mode=fsdp", "training.micro_batch=4"]),
    "fsdp4": (4, ["parallel.dp_mode=fsdp", "training.micro_batch=2"]),
    "fsdp2xtp2": (4, ["parallel.dp_mode=fsdp", "parallel.tp=2", "training.micro_batch=4"]),
}


def run_layout(char_data, out, name, layout, *extra):
    nproc, overrides = LAYOUTS[layout]
    cfg = load_config(None, fast_overrides(char_data, out, name, *BASE, *overrides, *extra))
    return train(cfg) if nproc == 1 else launch(run_rank, (cfg,), nproc)


def jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def step_losses(run_dir):
    """Loss per step as last logged (a restarted run logs the replayed steps again)."""
    return {r["step"]: r["loss"] for r in jsonl(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def straight(char_data, tmp_path_factory):
    """Uninterrupted 20-step runs, saving at step 10, on one process and on fsdp2."""
    out = tmp_path_factory.mktemp("straight")
    return {layout: run_layout(char_data, out, layout, layout, "checkpoint.every=10")
            for layout in ("single", "fsdp2")}


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
def test_resume_is_bitwise(char_data, tmp_path, straight, layout):
    ref = straight[layout]
    ckpt = ref.run_dir / "checkpoints" / "step-10"
    resumed = run_layout(char_data, tmp_path, "resumed", layout, f"checkpoint.resume={ckpt}")
    assert resumed.losses == ref.losses[10:]  # bitwise: ==, not approx
    assert resumed.val_loss == ref.val_loss


@pytest.mark.parametrize("saved_on, resumed_on", [("fsdp4", "ddp2"), ("fsdp2xtp2", "fsdp4"), ("fsdp2", "single"),
                                                  ("zero1x2", "single")])
def test_resharded_resume(char_data, tmp_path, saved_on, resumed_on):
    # Shorter runs than the bitwise test: what matters is the hand-over at the checkpoint.
    short = ["training.steps=8", "checkpoint.every=4"]
    saved = run_layout(char_data, tmp_path, "saved", saved_on, *short)
    resumed = run_layout(char_data, tmp_path, "resumed", resumed_on, *short, "checkpoint.save_final=false",
                         f"checkpoint.resume={saved.run_dir / 'checkpoints' / 'step-4'}")
    assert len(resumed.losses) == 4
    assert max(abs(a - b) for a, b in zip(resumed.losses, saved.losses[4:])) <= TOL


def test_async_save_and_safetensors_export(char_data, tmp_path, straight):
    from safetensors.torch import load_file

    run = run_layout(char_data, tmp_path, "async", "fsdp2", "checkpoint.every=5", "checkpoint.async_save=true",
                     "checkpoint.export_safetensors=true")
    assert run.losses == straight["fsdp2"].losses  # saving in the background changes nothing
    assert [p.name for p in complete_checkpoints(run.run_dir / "checkpoints")] == ["step-10", "step-15", "step-20"]
    assert all(checkpoint_problem(p) is None for p in complete_checkpoints(run.run_dir / "checkpoints"))
    weights = load_file(str(run.run_dir / "model.safetensors"))
    resumed = run_layout(char_data, tmp_path, "from-async", "single", "checkpoint.save_final=false",
                         f"checkpoint.resume={run.run_dir / 'checkpoints' / 'step-15'}")
    assert max(abs(a - b) for a, b in zip(resumed.losses, run.losses[15:])) <= TOL
    assert set(weights) >= {"tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight"}
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_truncated_newest_checkpoint_falls_back(char_data, tmp_path, capsys):
    run = run_layout(char_data, tmp_path, "r", "single", "checkpoint.every=5", "training.steps=10")
    newest = run.run_dir / "checkpoints" / "step-10"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "truncated shard" in checkpoint_problem(newest)
    resumed = run_layout(char_data, tmp_path, "r", "single", "checkpoint.resume=auto", "training.steps=12",
                         "checkpoint.save_final=false")
    out = capsys.readouterr()
    assert "skipping checkpoint" in out.out + out.err and "truncated shard" in out.out + out.err
    assert "resumed from" in out.out and "step-5" in out.out
    assert len(resumed.losses) == 7  # steps 6..12


def _cli(tmp_path, char_data, name, faults, flags, *extra, timeout=240):
    args = [sys.executable, "-m", "paratrain", "train", *flags,
            *[f"--{o}" for o in fast_overrides(char_data, tmp_path, name, *BASE, *extra)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARATRAIN_FAULTS": faults}
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.perf_counter() - start


def test_sigkill_rank_restarts_and_matches(char_data, tmp_path, straight):
    proc, _ = _cli(tmp_path, char_data, "killed", "kill@13:1", ["--nproc", "2", "--max-restarts", "1"],
                   *LAYOUTS["fsdp2"][1], "checkpoint.every=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting all ranks from the last checkpoint" in proc.stderr
    assert "resumed from" in proc.stdout
    losses = step_losses(tmp_path / "killed")
    ref = straight["fsdp2"].losses
    assert abs(losses[STEPS] - ref[-1]) <= TOL
    assert max(abs(losses[s + 1] - ref[s]) for s in range(STEPS)) <= TOL


def test_sigterm_saves_exits_zero_and_resumes_exactly(char_data, tmp_path, straight):
    proc, _ = _cli(tmp_path, char_data, "preempted", "term@7:0", ["--nproc", "2"], *LAYOUTS["fsdp2"][1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "preempted"
    assert "preempted: saved" in proc.stdout
    assert (run_dir / "PREEMPTED").read_text().strip() == "7"
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step-7"]
    resumed = run_layout(char_data, tmp_path, "preempted", "fsdp2", "checkpoint.resume=auto")
    assert resumed.losses == straight["fsdp2"].losses[7:]


def test_nan_step_skipped_on_all_ranks(char_data, tmp_path, monkeypatch, straight):
    monkeypatch.setenv("PARATRAIN_FAULTS", "nan@5:1")  # bad data on one rank only
    run = run_layout(char_data, tmp_path, "nan", "fsdp2")
    records = [r for r in jsonl(run.run_dir) if "loss" in r]
    assert len(run.losses) == STEPS and all(map(torch.isfinite, map(torch.tensor, run.losses[:5])))
    assert records[-1]["skipped_steps"] == 1 and run.skipped_steps == 1
    assert records[5]["skipped_steps"] == 1 and records[4]["skipped_steps"] == 0  # data batch 5 is step index 5
    # Skipping one update changes what follows; the update before it is untouched.
    assert run.losses[:5] == straight["fsdp2"].losses[:5]
    assert torch.isfinite(torch.tensor(run.losses[6:])).all()


def test_repeated_bad_steps_roll_back_and_skip_batches(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_FAULTS", "nan@5,nan@6,nan@7")
    run = run_layout(char_data, tmp_path, "rollback", "single", "checkpoint.every=4", "resilience.max_bad_steps=3",
                     "training.steps=12")
    out = capsys.readouterr().out
    assert "rolled back to" in out and "skipping batches [5, 6, 7]" in out
    assert len(run.losses) == 12 and torch.isfinite(torch.tensor(run.losses)).all()
    from paratrain.training.checkpoint import load_trainer_state

    state = load_trainer_state(run.run_dir / "checkpoints" / "step-12")
    assert state["skip_batches"] == [5, 6, 7] and state["data_step"] == 15
    # Every step that ran keeps its record (the skipped ones marked), a segment record says where the run went back
    # to, the skipped-steps counter never goes backwards, and report counts what the rollback undid.
    records = jsonl(run.run_dir)
    assert [r["step"] for r in records if r.get("skipped")] == [6, 7, 8]
    assert [(r["step"], r["batches"]) for r in records if r.get("segment") == "rollback"] == [(4, [5, 6, 7])]
    counts = [r["skipped_steps"] for r in records if "skipped_steps" in r]
    assert counts == sorted(counts) and counts[-1] == 3
    from paratrain.observe.report import load_run, summarize

    summary = summarize(load_run(run.run_dir))
    assert summary["rolled_back_steps"] == 4 and summary["skipped_steps"] == 3 and summary["steps"] == 12


def test_fp16_overflow_is_a_bad_streak_and_never_a_nan_checkpoint(char_data, tmp_path, monkeypatch, capsys):
    """fp16 is guarded like the other precisions: a weight that overflows makes every later loss non-finite, which the
    scaler cannot skip its way out of: after max_bad_steps the run rolls back to its checkpoint (the fault fires once,
    so it then trains on), and the loss scale each step ran at is in metrics.jsonl. Without a checkpoint to go back
    to: one line, exit 2, and no checkpoint holding the non-finite weights."""
    from paratrain.errors import UserError

    monkeypatch.setenv("PARATRAIN_FAULTS", "overflow@5")
    run = run_layout(char_data, tmp_path, "fp16", "single", "training.precision=fp16", "checkpoint.every=4",
                     "resilience.max_bad_steps=3", "training.steps=12")
    out = capsys.readouterr().out
    assert "rolled back to" in out and len(run.losses) == 12 and torch.isfinite(torch.tensor(run.losses)).all()
    records = [r for r in jsonl(run.run_dir) if "loss" in r]
    assert all(r["loss_scale"] > 0 for r in records) and run.skipped_steps >= 3
    assert {p.name for p in complete_checkpoints(run.run_dir / "checkpoints")} >= {"step-12"}

    monkeypatch.setenv("PARATRAIN_FAULTS", "overflow@2")
    with pytest.raises(UserError, match="3 consecutive non-finite steps and no checkpoint to roll back to"):
        run_layout(char_data, tmp_path, "fp16-lost", "single", "training.precision=fp16", "training.steps=8",
                   "resilience.max_bad_steps=3")
    assert not complete_checkpoints(tmp_path / "fp16-lost" / "checkpoints")


def test_checkpoints_by_wall_time(char_data, tmp_path):
    """checkpoint.every_minutes: a save once that much wall time has passed since the last (here: at every step)."""
    run = train(load_config(None, fast_overrides(char_data, tmp_path, "timed", "training.steps=4", "checkpoint.keep=10",
                                                 "checkpoint.every_minutes=1e-9")))
    assert [p.name for p in complete_checkpoints(run.run_dir / "checkpoints")] == [f"step-{i}" for i in range(1, 5)]


def test_memory_checked_on_every_rank_before_the_model_is_built(char_data, tmp_path, monkeypatch):
    """With the real vocabulary, on the ranks (the node's ranks share its host memory): over it, one UserError and no
    run folder; resilience.memory_check=false (`train --force`) tries anyway."""
    from paratrain.errors import UserError
    from paratrain.training import memory_fit

    monkeypatch.setattr(memory_fit, "host_memory_available", lambda: 2**20)
    with pytest.raises(UserError, match=r"this run needs about .* and this machine has 1.0 MiB of host memory"):
        train(load_config(None, fast_overrides(char_data, tmp_path, "tight", "training.steps=1")))
    assert not (tmp_path / "tight").exists()
    forced = train(load_config(None, fast_overrides(char_data, tmp_path, "forced", "training.steps=1",
                                                    "resilience.memory_check=false")))
    assert len(forced.losses) == 1


def test_a_checkpoint_with_a_nonfinite_value_is_refused(char_data, tmp_path):
    """The ranks check their weights and optimizer state before a save: a NaN anywhere refuses it in one line and
    leaves the checkpoints on disk as they were."""
    from paratrain.errors import UserError
    from paratrain.training.checkpoint import nonfinite_state

    run = run_layout(char_data, tmp_path, "finite", "single", "training.steps=2")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert nonfinite_state(model, optimizer) is None
    next(iter(optimizer.state.values()))["exp_avg_sq"][0, 1] = float("inf")
    assert nonfinite_state(model, optimizer) == "optimizer state exp_avg_sq of parameter 0"
    with torch.no_grad():
        model.bias[1] = float("nan")
    assert nonfinite_state(model, optimizer) == "parameter bias"
    from paratrain.training.checkpoint import Checkpointer

    saver = Checkpointer.__new__(Checkpointer)  # its save's check runs before anything of it is used
    saver.model, saver.optimizer, saver.root = model, optimizer, run.run_dir / "checkpoints"
    before = sorted(p.name for p in saver.root.iterdir())
    with pytest.raises(UserError, match="checkpoint at step 3 refused: parameter bias holds a NaN or an infinity"):
        saver.save(3)
    assert sorted(p.name for p in saver.root.iterdir()) == before


@pytest.mark.parametrize("how", ["injected", "budget"])
def test_out_of_memory_halves_micro_batch_same_losses(char_data, tmp_path, monkeypatch, capsys, straight, how):
    if how == "injected":
        monkeypatch.setenv("PARATRAIN_FAULTS", "oom@3")
        extra = []
    else:
        # the tiny model saves ~3.4 MiB of activations at micro-batch 8 and ~1.9 MiB at micro-batch 4
        extra = ["resilience.memory_budget_gib=0.0025"]
    run = run_layout(char_data, tmp_path, "oom", "single", *extra)
    out = capsys.readouterr().out
    assert out.count("out of memory") == 1 and "micro-batch 8 x accumulation 1 -> 4 x 2" in out
    assert max(abs(a - b) for a, b in zip(run.losses, straight["single"].losses)) <= TOL
    assert [r["micro_batch"] for r in jsonl(run.run_dir) if "loss" in r][-1] == 4


def test_out_of_memory_names_one_step(char_data, tmp_path, monkeypatch):
    """One out-of-memory event names one step everywhere, counted as the progress lines count (issue 35)."""
    import re

    from paratrain.training.resilience import OutOfMemory

    monkeypatch.setenv("PARATRAIN_FAULTS", "oom@2")  # the third step (PARATRAIN_FAULTS counts from 0)
    with pytest.raises(OutOfMemory) as e:
        run_layout(char_data, tmp_path, "oom", "single", "training.micro_batch=1", "training.steps=4")
    evidence = (tmp_path / "oom" / "oom" / "step-3" / "rank0.txt").read_text().splitlines()[0]
    for text in (str(e.value), evidence):
        assert "injected out-of-memory in step 3" in text and set(re.findall(r"step[ -](\d+)", text)) == {"3"}, text


def test_out_of_memory_at_micro_batch_one_is_a_clear_error(char_data, tmp_path):
    from paratrain.training.resilience import OutOfMemory

    with pytest.raises(OutOfMemory, match="micro-batch 1"):
        run_layout(char_data, tmp_path, "oom1", "single", "resilience.memory_budget_gib=0.0000001")
