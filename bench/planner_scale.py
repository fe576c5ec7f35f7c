"""How long `paratrain plan` takes at scale: wall and CPU time of whole plans, from 8 to 8,192 GPUs.

Each plan runs in this process after one warm-up plan (imports and first-use caches out of the way), as
`paratrain plan` runs it: enumerate, predict every layout, memory-check the fastest until enough fit. CPU time is
what the planner costs; wall time also counts whatever else shares the machine.

Then the command itself, as a user runs it: `paratrain plan ... --json --no-write` in a fresh process (Python's
start, the imports, the plan, the JSON), wall time of --repeat runs and their median, with the load average of the
machine at the start (other work slows the wall time).

    python bench/planner_scale.py
    python bench/planner_scale.py --smoke    # one small plan, no warm-up; the command once (the test suite)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [
    ("llama3-8b", 8, 8192, 128),
    ("llama3-70b", 1024, 8192, 1024),
    ("llama3-405b", 8192, 8192, 2048),
    ("llama3-405b", 8192, 8192, 16384),
]
ROOT = Path(__file__).resolve().parents[1]
COMMAND_CASE = CASES[2]  # the command timed whole: 405B on 8,192 GPUs, 16Mi tokens per step (issue 53)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the first case only, without the warm-up plan (the test suite)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of the whole command (median reported)")
    a = ap.parse_args(argv)
    from paratrain.estimate.planner import PlanRequest, plan_context

    def run(model, gpus, seq, seqs):
        planning = plan_context(PlanRequest(model, gpus=gpus, gpu="H100", seq=seq, global_batch_tokens=seq * seqs))
        w0, c0 = time.perf_counter(), time.process_time()
        p = planning.plan()
        return p, time.perf_counter() - w0, time.process_time() - c0

    if not a.smoke:
        run("llama3-8b", 8, 4096, 64)  # warm-up
    print("| model | GPUs | tokens per step | layouts considered | wall s | CPU s | first choice | predicted MFU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    worst = 0.0
    cases = CASES[:1] if a.smoke else CASES
    for model, gpus, seq, seqs in cases:
        p, wall, cpu = run(model, gpus, seq, seqs)
        best = p.ranked[0]
        worst = max(worst, cpu) if gpus == 8192 else worst
        print(f"| {model} | {gpus:,} | {seq * seqs:,} | {p.considered:,} | {wall:.2f} | {cpu:.2f} | "
              f"{best.cand.name} | {best.pred.mfu:.1%} |", flush=True)
    if any(gpus == 8192 for _, gpus, _, _ in cases):
        print(f"\n8,192 GPUs: at most {worst:.2f} s of CPU time per plan (target < 10 s: "
              f"{'MET' if worst < 10 else 'MISSED'})")
    command_table(CASES[0] if a.smoke else COMMAND_CASE, 1 if a.smoke else a.repeat)
    return 0


def command_table(case: tuple, repeat: int) -> None:
    """Wall time of the whole `paratrain plan` command (a fresh process each run), median of `repeat`."""
    model, gpus, seq, seqs = case
    words = ["plan", "--model", model, "--gpus", str(gpus), "--gpus-per-node", "8", "--gpu", "H100", "--seq", str(seq),
             "--global-batch-tokens", str(seq * seqs), "--json", "--no-write"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    load = os.getloadavg()[0]
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "paratrain", *words], env=env, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
    print(f"\n`paratrain {' '.join(words)}` ({os.cpu_count()} CPUs, load average {load:.1f} at the start)")
    print("| runs | wall s, each | median wall s |")
    print("| ---: | --- | ---: |")
    print(f"| {repeat} | {', '.join(f'{w:.2f}' for w in walls)} | {statistics.median(walls):.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
