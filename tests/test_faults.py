"""Faults from outside the process tree, as a scheduler or an operator causes them (no PARATRAIN_FAULTS):
SIGTERM to the launcher, to its whole process group, or to one rank; SIGKILL in the middle of a save; a disk that
fills up during a save; a checkpoint changed in place without changing its size.

Signals go only to processes these tests started (the launcher is started in its own session, so its process group
holds just it and its ranks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import fast_overrides
from mounts import small_disk
from paratrain import cli
from paratrain.api import train_rank
from paratrain.config import load_config
from paratrain.observe.metrics import in_effect
from paratrain.training.checkpoint import checkpoint_problem, complete_checkpoints

GRACE_S = 10


class Job:
    """`paratrain train ...` in its own session, its output collected with the time each line arrived."""

    def __init__(self, args: list[str], preexec_fn=None):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PARATRAIN_FAULTS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                                     preexec_fn=preexec_fn)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                        for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for r in self.readers:
            r.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.out):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"never printed {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.02)

    def ranks(self) -> list[psutil.Process]:
        from paratrain.distributed.launch import rank_processes

        return rank_processes(self.proc.pid)

    def finish(self, timeout: float = 240) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for r in self.readers:
            r.join(5)
        return rc

    def kill(self) -> None:
        for p in [*self.ranks(), psutil.Process(self.proc.pid)]:
            try:
                p.kill()
            except psutil.Error:
                pass

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


def train_args(data, out, name, *extra) -> list[str]:
    return [f"--{o}" for o in fast_overrides(data, out, name, "training.eval_every=0", "training.log_every=1",
                                              "metrics.progress=lines", *extra)]


@pytest.mark.parametrize("target", ["launcher", "group", "rank"])
def test_sigterm_from_outside_saves_and_exits_within_grace(char_data, tmp_path, target):
    job = Job(["--nproc", "2", *train_args(char_data, tmp_path, "job", "training.steps=100000",
                                           f"resilience.preempt_grace_s={GRACE_S}")])
    job.wait_for(r"^step +2/")
    ranks = job.ranks()
    assert len(ranks) == 2
    sent = time.monotonic()
    if target == "launcher":
        os.kill(job.proc.pid, signal.SIGTERM)
    elif target == "group":
        os.killpg(job.proc.pid, signal.SIGTERM)  # what Slurm and Kubernetes send: every process of the job
    else:
        ranks[1].send_signal(signal.SIGTERM)  # not rank 0: the others learn of it at the next step boundary
    rc = job.finish()
    took = time.monotonic() - sent
    assert rc == 0, job.text()[-3000:]
    assert took < GRACE_S, f"took {took:.1f} s to stop after SIGTERM"
    assert "Traceback" not in job.text() and "error" not in "".join(job.err).lower(), job.text()[-3000:]
    saved = complete_checkpoints(tmp_path / "job" / "checkpoints")
    assert len(saved) == 1 and checkpoint_problem(saved[0]) is None
    step = int(saved[0].name.split("-")[1])
    assert step >= 2 and (tmp_path / "job" / "PREEMPTED").read_text().strip() == str(step)
    assert f"preempted: saved {saved[0]}" in job.text()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)


def test_sigkill_to_the_launcher_ends_every_rank(char_data, tmp_path):
    """What a scheduler's hard kill or the OOM killer does: SIGKILL to the launcher of a 2-rank run. Its forkserver,
    the ranks and the helpers end within a few seconds (the parent-death signal, distributed/orphans.py), and no
    checkpoint is written after the kill."""
    job = Job(["--nproc", "2", *train_args(char_data, tmp_path, "job", "training.steps=100000",
                                           "checkpoint.every=5")])
    job.wait_for(r"^step +7/")
    started = [psutil.Process(job.proc.pid), *psutil.Process(job.proc.pid).children(recursive=True)]
    assert len(job.ranks()) == 2 and len(started) >= 4  # the launcher, its forkserver, the ranks (and helpers)
    ckpts = tmp_path / "job" / "checkpoints"
    os.kill(job.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    saved = [p.name for p in complete_checkpoints(ckpts)]
    job.finish()
    while time.monotonic() - killed < 10:
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.1)
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # (only what this test started)
        p.kill()
    assert not alive, f"still running 10 s after the launcher's SIGKILL: {[p.cmdline()[:4] for p in alive]}"
    time.sleep(1)
    # no checkpoint from ranks without their launcher (a save under way at the kill's instant stays `.step-N.tmp`,
    # which is never loaded: test_sigkill_during_save_keeps_the_previous_checkpoint)
    assert [p.name for p in complete_checkpoints(ckpts)] == saved


def test_one_live_writer_per_run_folder(char_data, tmp_path, capsys):
    """A second train of a live run's name, or a resume of it, exits 2 with one line naming the live run's pid and
    writes nothing; so does a report into its folder. The run's metrics.jsonl holds one series."""
    first = Job(["--nproc", "2", *train_args(char_data, tmp_path, "dup", "training.steps=100000",
                                             f"resilience.preempt_grace_s={GRACE_S}")])
    first.wait_for(r"^step +3/")
    run = tmp_path / "dup"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PARATRAIN_FAULTS", None)
    for extra in ([], ["--checkpoint.resume=auto"], ["--run.overwrite=true"]):
        before = {p.name for p in run.iterdir()}
        done = subprocess.run([sys.executable, "-m", "paratrain", "train",
                               *train_args(char_data, tmp_path, "dup", "training.steps=10"), *extra],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and f"in use by a live run (pid {first.proc.pid} on host" in done.stderr
        assert {p.name for p in run.iterdir()} >= before and (run / "metrics.jsonl").is_file()
    assert cli.main(["report", str(run)]) == 2
    assert "in use by a live run" in capsys.readouterr().err and not (run / "report").exists()
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.finish() == 0, first.text()[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open() if '"loss"' in line]
    assert steps == sorted(set(steps)) and steps[0] == 1  # one series: no second run's steps mixed in
    assert cli.main(["report", str(run)]) == 0  # the run has ended: its folder is free


CONSTANT_LR = ["optimizer.lr=0.001", "optimizer.min_lr=0.001", "optimizer.warmup_steps=0"]  # steps= changes nothing


def logged_losses(run_dir) -> dict[int, float]:
    """The loss of every step the run stands on (metrics.jsonl read as `paratrain report` reads it)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in in_effect(records)[0] if "loss" in r}


def test_ctrl_c_saves_exits_130_and_resume_continues_the_same_losses(char_data, tmp_path, capsys):
    """Ctrl-C at a terminal (SIGINT to the job's process group: the launcher and both ranks, and the launcher's relay
    a moment later) saves at the next step boundary and exits 130; `resume=auto` continues with the losses of one
    uninterrupted process, and report shows one series."""
    batch = ["training.global_batch=8", *CONSTANT_LR]
    # the wall-clock save timer runs out at every step on both ranks' clocks: they agree to save at the same steps
    job = Job(["--nproc", "2", *train_args(char_data, tmp_path, "job", "training.steps=100000",
                                           "checkpoint.every_minutes=1e-9", *batch)])
    job.wait_for(r"^step +3/")
    os.killpg(job.proc.pid, signal.SIGINT)
    assert job.finish() == 130, job.text()[-3000:]
    assert "Traceback" not in job.text() and "error:" not in job.text(), job.text()[-3000:]
    saved = complete_checkpoints(tmp_path / "job" / "checkpoints")
    assert len(saved) == 2 and all(checkpoint_problem(p) is None for p in saved)  # checkpoint.keep=2
    step = int(saved[-1].name.split("-")[1])
    assert int(saved[0].name.split("-")[1]) == step - 1
    assert f"interrupted: saved {saved[-1]} at step {step}" in job.text()

    total = step + 3
    resumed = Job(["--nproc", "2", *train_args(char_data, tmp_path, "job", f"training.steps={total}", *batch,
                                               "checkpoint.resume=auto")])
    assert resumed.finish() == 0, resumed.text()[-3000:]
    assert f"resumed from {saved[-1]} at step {step}" in resumed.text()
    one = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "one", f"training.steps={total}",
                                                      "training.eval_every=0", *batch)))
    logged = logged_losses(tmp_path / "job")
    assert sorted(logged) == list(range(1, total + 1))
    assert max(abs(logged[i + 1] - loss) for i, loss in enumerate(one.losses)) <= 1e-5
    assert cli.main(["report", str(tmp_path / "job")]) == 0
    summary = json.loads((tmp_path / "job" / "report" / "summary.json").read_text())["runs"][0]
    assert summary["status"] == "finished" and summary["steps"] == total and summary["abandoned_steps"] == 0


def test_an_interrupted_default_run_resumes_and_reports_one_series(char_data, tmp_path):
    """`make run` (`train --checkpoint.resume=auto`, one process): killed before any checkpoint, the next start says
    so and starts over; Ctrl-C then saves (exit 130) and the next start continues; report shows the steps the run
    stands on, not the abandoned ones."""
    args = train_args(char_data, tmp_path, "default", "training.steps=100000", "checkpoint.resume=auto", *CONSTANT_LR)
    killed = Job(args)
    killed.wait_for(r"^step +3/")
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.finish()
    run = tmp_path / "default"
    assert not (run / "checkpoints").is_dir() or not complete_checkpoints(run / "checkpoints")

    again = Job(args)
    again.wait_for(r"^step +2/")
    assert f"no checkpoint in {run}: starting from step 0" in again.text()
    again.proc.send_signal(signal.SIGINT)
    assert again.finish() == 130, again.text()[-3000:]
    step = int(complete_checkpoints(run / "checkpoints")[-1].name.split("-")[1])

    last = Job([a for a in args if "training.steps" not in a] + [f"--training.steps={step + 2}"])
    assert last.finish() == 0, last.text()[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step-{step}'} at step {step}" in last.text()
    assert sorted(logged_losses(run)) == list(range(1, step + 3))
    assert cli.main(["report", str(run)]) == 0
    summary = json.loads((run / "report" / "summary.json").read_text())["runs"][0]
    assert summary["status"] == "finished" and summary["abandoned_steps"] >= 3
    assert "a later start of the run went back over" in (run / "report" / "report.md").read_text()


def test_a_second_ctrl_c_stops_at_once():
    """A second SIGINT (a second press, not the first one's relayed copy) ends the process at once with 130, even
    while the main thread is blocked."""
    script = ("import time\nfrom paratrain.training.preemption import watching\n"
              "with watching(60):\n    print('ready', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        first = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # within INTERRUPT_REPEAT_S: the same press (the launcher's relay)
        time.sleep(1.2 - (time.monotonic() - first))
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        err = proc.stderr.read()
        assert "interrupted: saving a checkpoint" in err and "interrupted again: stopping now" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigterm_while_the_grace_period_starts_is_not_a_deadlock():
    """SIGTERM to the job's process group reaches a rank twice at once (directly, and relayed by the launcher): the
    second lands while the first is starting the grace-period watchdog. The watch must still stop in time (it once
    waited for itself forever: the run was killed when the launcher's grace period ran out)."""
    script = ("import os, signal, threading, time\n"
              "from paratrain.training import preemption\n"
              "class Nesting(threading.Timer):\n"
              "    def start(self):\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(0.1)\n"  # the handler runs here, inside notice()
              "        super().start()\n"
              "preemption.threading.Timer = Nesting\n"
              "watch = preemption.PreemptionWatch(60).start()\n"
              "watch.notice()\n"
              "time.sleep(0.2)\n"
              "print('stopping', watch.requested, watch.noticed_at is not None, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the watch deadlocked on a second SIGTERM") from None
    assert proc.returncode == 0 and out.strip() == "stopping True True", out + err


def session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (a job started with start_new_session: the launcher and all it started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def test_nothing_outlives_a_refused_launch(char_data, tmp_path):
    """A launch refused after its ranks' forkserver was started (it starts first, so its imports overlap the checks):
    one line, exit 2, and within a few seconds nothing of the job left, whatever the refusal."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in (["--nproc", "4096"], ["--nproc", "2", f"--metrics.prometheus_port={port}"]):
            job = Job([*extra, *train_args(char_data, tmp_path, "refused")])
            assert job.finish() == 2 and "".join(job.err).startswith("error: "), job.text()[-3000:]
            deadline = time.monotonic() + 5
            while session_processes(job.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = session_processes(job.proc.pid)
            for p in left:  # (only what this test started: its own session)
                p.kill()
            assert not left, f"{extra}: still running after the refused launch: {[p.cmdline()[:4] for p in left]}"


def test_sigkill_during_save_keeps_the_previous_checkpoint(char_data, tmp_path, capsys):
    # A model big enough that a save takes a while (about 40 MB with the optimizer state), saved every step.
    model = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=1024"]
    job = Job(train_args(char_data, tmp_path, "job", "training.steps=200", "checkpoint.every=1", *model))
    ckpts = tmp_path / "job" / "checkpoints"
    deadline = time.monotonic() + 240
    while True:  # SIGKILL the moment a save is under way (its temporary folder exists) once one is committed
        if time.monotonic() > deadline or job.proc.poll() is not None:
            job.kill()
            raise AssertionError("no save was caught in progress:\n" + job.text()[-3000:])
        if ckpts.is_dir() and complete_checkpoints(ckpts) and any(p.name.endswith(".tmp") for p in ckpts.iterdir()):
            os.kill(job.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    job.finish()
    torn = [p for p in ckpts.iterdir() if p.name.endswith(".tmp")]
    good = complete_checkpoints(ckpts)[-1]
    assert torn and checkpoint_problem(good) is None
    rc = cli.main(["checkpoint", "verify", str(tmp_path / "job")])
    out = capsys.readouterr().out
    assert rc == 0 and f"resume=auto would use {good}" in out and "interrupted save" in out
    # The next start removes the torn save and continues from the newest complete checkpoint.
    step = int(good.name.split("-")[1])
    cfg = load_config(None, fast_overrides(char_data, tmp_path, "job", "checkpoint.resume=auto", "training.eval_every=0",
                                           f"training.steps={step + 1}", *model))
    result = train_rank(cfg)
    out, err = capsys.readouterr()
    assert f"resumed from {good}" in out and "removed .step-" in err
    assert len(result.losses) == 1 and not any(p.name.endswith(".tmp") for p in ckpts.iterdir())


def test_full_disk_during_save_is_one_line_and_leaves_nothing(char_data, tmp_path):
    # Room for the run's config and metrics, not for a checkpoint (1.4 MiB for the tiny model and its optimizer).
    with small_disk(tmp_path / "disk", 600 * 1024) as (disk, limit):
        job = Job(["--nproc", "2", *train_args(char_data, disk, "job", "training.steps=4", "checkpoint.every=2")],
                  preexec_fn=limit)
        rc = job.finish()
        err = [line for line in job.err if line.strip() and not line.startswith("warning:")]
        assert rc == 2, job.text()[-3000:]
        assert "Traceback" not in job.text()
        assert len(err) == 1 and err[0].startswith("error: "), job.text()[-3000:]
        assert re.search(r"cannot save checkpoint step-2 in .*checkpoints: (No space left on device|File too large|a write stopped short)",
                         err[0]) and "the partial save .step-2.tmp was removed" in err[0]
        assert os.listdir(disk / "job" / "checkpoints") == []
        assert (disk / "job" / "config.toml").is_file()


def test_same_size_corruption_is_caught_everywhere(char_data, tmp_path, capsys):
    """A shard changed in place: resume=auto falls back naming the reason, verify and generate refuse it, and pruning
    never deletes the last good checkpoint while newer, damaged ones are still around."""
    base = ["training.eval_every=0", "checkpoint.every=2", "checkpoint.keep=2"]
    run = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "r", *base, "training.steps=4")))
    ckpts = run.run_dir / "checkpoints"
    good, bad = ckpts / "step-2", ckpts / "step-4"
    for name in ("step-6", "step-8"):  # two newer damaged ones: the old pruning would have deleted step-2 and more
        shutil.copytree(bad, ckpts / name)
    for folder, victim in ((bad, "__0_0.distcp"), (ckpts / "step-6", ".metadata"), (ckpts / "step-8", "trainer.pt")):
        f = folder / victim
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0x01  # one bit, same size
        f.write_bytes(bytes(data))
    capsys.readouterr()

    assert cli.main(["checkpoint", "verify", str(run.run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"OK   {good}" in out and f"resume=auto would use {good}" in out
    for name, victim in (("step-4", "__0_0.distcp"), ("step-6", ".metadata"), ("step-8", "trainer.pt")):
        assert re.search(rf"BAD  {re.escape(str(ckpts / name))}: checksum mismatch in {re.escape(victim)}", out), out

    assert cli.main(["generate", "--checkpoint", str(bad), "--max-new-tokens", "3"]) == 2
    assert "checksum mismatch in __0_0.distcp" in capsys.readouterr().err
    assert cli.main(["generate", "--checkpoint", str(run.run_dir), "--max-new-tokens", "3"]) == 0
    assert f"skipping checkpoint {ckpts / 'step-8'}: checksum mismatch" in capsys.readouterr().err

    resumed = train_rank(load_config(None, fast_overrides(char_data, tmp_path, "r", *base, "training.steps=5",
                                                          "checkpoint.resume=auto")))
    out, err = capsys.readouterr()
    assert f"skipping checkpoint {bad}: checksum mismatch in __0_0.distcp" in err
    assert f"resumed from {good} at step 2" in out
    assert resumed.losses == run.losses[2:4] + resumed.losses[2:]  # bitwise the same steps 3 and 4
    # step-4 was saved again (replacing the damaged one) and step-5 written; step-6 and step-8 are newer than the run
    # and stay for the operator, so the last good checkpoints are never the ones deleted.
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-4", "step-5", "step-6", "step-8"]
    assert checkpoint_problem(ckpts / "step-4") is None and checkpoint_problem(ckpts / "step-5") is None
