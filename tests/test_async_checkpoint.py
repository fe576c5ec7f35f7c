"""Background checkpoints (`checkpoint.async_save`) that can be trusted: the write never sees a later step's
weights (the state is staged first), a rank killed in the middle of the background write leaves the previous
checkpoint the newest valid one and the run resumes with an uninterrupted run's losses, and Ctrl-C during a
background save waits for it (exit 130, the save complete and verified).

Faults are PARATRAIN_FAULTS' (paratrain/faults.py): `slowsave@N` pauses the write of step-N on the thread that
writes it, `killsave@N:R` makes rank R SIGKILL itself on that thread after its shards are written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import fast_overrides
from paratrain import cli
from paratrain.api import train_rank
from paratrain.config import load_config
from paratrain.faults import ENV as FAULTS_ENV
from paratrain.training.checkpoint import checkpoint_problem, complete_checkpoints
from paratrain.training.save_process import WriterProcess

ASYNC = "checkpoint.async_save=true"
BATCH = ["training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2", "optimizer.lr=3e-3",
         "checkpoint.keep=3"]


def saved_tensors(folder, tmp_path) -> dict:
    """Every tensor of a DCP checkpoint folder, by its flattened name."""
    out = tmp_path / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def test_background_write_saves_the_weights_of_its_step(char_data, tmp_path, monkeypatch):
    """The write of step-5 is held back 3 s while steps 6..9 update the weights in place: the checkpoint holds
    step 5's model and optimizer state, bit for bit as a synchronous save writes them. Its shard files were written
    by the rank's writer process, which is gone when the run returns; a run without async_save starts none."""
    writers = []
    write = WriterProcess.write
    monkeypatch.setattr(WriterProcess, "write", lambda self, *a: writers.append(self.process.pid) or write(self, *a))
    common = [*BATCH, "training.steps=10", "checkpoint.every=5"]
    sync = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "sync", *common)))
    assert writers == []
    monkeypatch.setenv(FAULTS_ENV, "slowsave@5")  # (under faults the write waits for the writer process to start)
    background = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "async", *common, ASYNC)))
    assert background.losses == sync.losses
    assert len(writers) == 1 and not Path(f"/proc/{writers[0]}").exists()  # (ended and reaped)
    ours, theirs = (saved_tensors(r.run_dir / "checkpoints" / "step-5", tmp_path) for r in (background, sync))
    assert set(ours) == set(theirs) and any(".model." in k for k in ours) and any(".optim." in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    later = saved_tensors(sync.run_dir / "checkpoints" / "step-10", tmp_path)
    assert any(not torch.equal(ours[k], later[k]) for k in ours if ".model." in k)  # (the weights did move on)


def _cli(tmp_path, char_data, name, faults, flags, *extra):
    args = [sys.executable, "-m", "paratrain", "train", *flags,
            *[f"--{o}" for o in fast_overrides(char_data, tmp_path, name, *BATCH, "metrics.progress=lines",
                                              "training.log_every=1", *extra)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAULTS_ENV: faults}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _left_behind(job, wait_s: float = 10.0) -> list[str]:
    """The live processes of `job`'s session (launcher, ranks, their checkpoint writer processes) still there
    `wait_s` after it ended (those its end kills, by the parent-death signal, take a moment to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if line.split()[1] == str(job.pid) and not line.split()[2][0] == "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_sigkill_during_background_write_resumes_from_the_previous_checkpoint(char_data, tmp_path):
    """2 ranks save step-4, then rank 1 dies (SIGKILL) in the middle of step-8's background write (once its writer
    process has written its shards); the relaunch finds step-4 the newest valid checkpoint, the losses of the whole run
    equal one uninterrupted process's, and no process of the job (a writer process included) is left."""
    steps = 10
    job = _cli(tmp_path, char_data, "killed", "killsave@8:1", ["--nproc=2", "--max-restarts=1"],
               "parallel.dp_mode=fsdp", "training.micro_batch=4", f"training.steps={steps}", "checkpoint.every=4",
               "resilience.collective_timeout_s=60", ASYNC)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
    assert "restarting all ranks from the last checkpoint" in err
    assert _left_behind(job) == []  # (the killed rank's writer process too)
    ckpts = tmp_path / "killed" / "checkpoints"
    # (.step-8.tmp is removed by the surviving rank when its write fails, or at the next start)
    assert not (ckpts / ".step-8.tmp").exists() and f"resumed from {ckpts / 'step-4'} at step 4" in out
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-4", "step-8", f"step-{steps}"]
    one = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "one", *BATCH, f"training.steps={steps}",
                                                      "training.micro_batch=8")))
    from test_faults import logged_losses

    logged = logged_losses(tmp_path / "killed")
    assert sorted(logged) == list(range(1, steps + 1))
    assert max(abs(logged[i + 1] - loss) for i, loss in enumerate(one.losses)) <= 1e-5


def test_ctrl_c_during_background_save_waits_for_it_and_exits_130(char_data, tmp_path, capsys):
    """SIGINT while step-5's background write is held back: the run finishes that save, saves the step it stopped
    at, and exits 130; both checkpoints are complete and `paratrain checkpoint verify` passes them."""
    job = _cli(tmp_path, char_data, "job", "slowsave@5", [], "training.steps=100000", "checkpoint.every=5", ASYNC)
    ckpts = tmp_path / "job" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (ckpts / ".step-5.tmp").is_dir():  # the save is under way (its write paused for 3 s)
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.01)
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err and _left_behind(job) == []
    saved = complete_checkpoints(ckpts)
    assert saved[0].name == "step-5" and len(saved) == 2 and all(checkpoint_problem(p) is None for p in saved)
    assert f"interrupted: saved {saved[-1]}" in out
    assert cli.main(["checkpoint", "verify", str(saved[0])]) == 0
