"""How long `paratrain plan` takes at scale: wall and CPU time of whole plans, from 8 to 8,192 GPUs.

Each plan runs in this process after one warm-up plan (imports and first-use caches out of the way), as
`paratrain plan` runs it: enumerate, predict every layout, memory-check the fastest until enough fit. CPU time is
what the planner costs; wall time also counts whatever else shares the machine.

    python bench/planner_scale.py
    python bench/planner_scale.py --smoke    # one small plan, no warm-up (the test suite)
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the first case only, without the warm-up plan (the test suite)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
