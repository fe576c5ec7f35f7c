"""How long a preempted job takes to stop: SIGTERM sent from outside to the launcher, to the job's process group, or
to one rank of `paratrain train --nproc N`, while it trains; the time until the checkpoint is saved and until the
launcher has exited. Prints a table (median of --repeat runs per target).

    python bench/preemption.py [--nproc 2] [--repeat 1] [--grace 30] [--targets launcher,group,rank]
                               [--set section.key=value ...]
    python bench/preemption.py --smoke     # SIGTERM to one rank of 2, once (the test suite)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from paratrain.data import DEFAULT_CORPUS, prepare_dataset
from paratrain.distributed.launch import rank_processes

TARGETS = ("launcher", "group", "rank")


def one(target: str, data: str, out: str, nproc: int, grace: float, extra: list[str]) -> tuple[float, float, int]:
    args = [sys.executable, "-m", "paratrain", "train", "--nproc", str(nproc), "--model.preset=tiny",
            "--training.seq_len=32", "--training.micro_batch=4", "--training.steps=1000000", "--training.device=cpu",
            "--training.eval_every=0", "--training.log_every=1", "--sample.max_new_tokens=0",
            "--metrics.progress=lines", "--metrics.peak_tflops=1", f"--data.dir={data}", f"--run.out_dir={out}",
            f"--run.name={target}", f"--resilience.preempt_grace_s={grace}", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), x)) for x in proc.stdout], daemon=True)
    reader.start()
    while not any(x.startswith("step     3") for _, x in lines):
        if proc.poll() is not None:
            raise SystemExit("".join(x for _, x in lines)[-3000:])
        time.sleep(0.02)
    ranks = rank_processes(proc.pid)
    sent = time.monotonic()
    if target == "launcher":
        os.kill(proc.pid, signal.SIGTERM)
    elif target == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        max(ranks, key=lambda p: p.pid).send_signal(signal.SIGTERM)
    rc = proc.wait(600)
    ended = time.monotonic()
    reader.join(5)
    saved = next((t for t, x in lines if x.startswith("preempted: saved")), float("nan"))
    return saved - sent, ended - sent, rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--grace", type=float, default=30)
    p.add_argument("--set", action="append", default=[], help="extra --section.key=value for the run")
    p.add_argument("--targets", default=",".join(TARGETS), help="where SIGTERM goes (launcher, group, rank)")
    p.add_argument("--smoke", action="store_true", help="one target (a rank), once (seconds; the test suite)")
    a = p.parse_args()
    if a.smoke:
        a.targets, a.repeat = "rank", 1
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        p.error(f"--targets: '{unknown[0]}' is not one of {', '.join(TARGETS)}")
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        prepare_dataset(DEFAULT_CORPUS, data, tokenizer="char")
        print(f"| SIGTERM to | ranks | saved after | launcher exited after | exit code | grace |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for target in targets:
            runs = [one(target, data, os.path.join(tmp, f"runs{i}"), a.nproc, a.grace,
                        [f"--{s}" for s in a.set]) for i in range(a.repeat)]
            saved = statistics.median(r[0] for r in runs)
            ended = statistics.median(r[1] for r in runs)
            print(f"| {target} | {a.nproc} | {saved:.2f} s | {ended:.2f} s | {sorted({r[2] for r in runs})} | "
                  f"{a.grace:g} s |")


if __name__ == "__main__":
    main()
