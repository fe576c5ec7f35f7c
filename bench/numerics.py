"""What the troubleshooting tools cost a step: the numerics watch on the default run, the collective history on two
fsdp ranks.

Numerics watch: the default model (preset shakespeare-char, context 64, micro-batch 12, fp32, one process, log every
10 steps) trained by `paratrain.api.train_rank` with `metrics.numerics_every` = 0 (off: no hooks at all), 100 and 1
(every step watched), rounds alternating (every other one in reverse order). A step is the interval between the starts of consecutive steps
(bench/overhead.py's measure: the whole loop, the log steps' reads included), on this process's CPU clock
(time.process_time: one thread, so the work it did; the wall clock of a machine shared with other test suites moves
by tens of percent between runs). numerics_every=100 is costed from its parts: what the installed hooks add to a
step they do not watch (one forward + backward with and without them, alternating in one process: the quietest
measure), and what a watched step adds (its watched steps, each ending at a log step, against its other log steps;
and the every-step run's median against the off run's), spread over 100 steps; and directly, its mean and median
step against the off run's (on a shared machine mostly noise).

Collective history: two gloo ranks each running --collectives all-reduces of one float with torch's flight recorder
off (TORCH_FR_BUFFER_SIZE=0) and at paratrain's default (2000 entries, with the Python stack of each): rank 0's CPU
and wall time per collective, rounds alternating.

    python bench/numerics.py                    # 3 rounds of 300 steps each setting (~6 minutes on 2 quiet cores)
    python bench/numerics.py --rounds 2 --steps 200 --no-history
    python bench/numerics.py --smoke     # one round of 30 steps of 2 sequences watched every 20, no collective
                                         # history (its ranks' start-up alone is ~8 s of CPU) (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import config, paratrain_steps  # noqa: E402 - bench/overhead.py's run and measure

EVERY = 100


def watch_round(out: str, steps: int, reverse: bool, every_n: int = EVERY, training: dict | None = None) -> dict:
    """One round: per setting (0, `every_n`, 1), the CPU seconds of every step (index = step); every other round in
    reverse order, so a drift of the machine's speed over a round weighs on both sides alike. `training`: [training]
    values over the default run's (--smoke's smaller batch and evaluation)."""
    row = {}
    for every in (1, every_n, 0) if reverse else (0, every_n, 1):
        cfg = config(out, steps, "cpu")
        cfg.metrics.numerics_every = every
        for key, value in (training or {}).items():
            setattr(cfg.training, key, value)
        row[every] = paratrain_steps(cfg, time.process_time)
    return row


def costs(row: dict, warmup: int, every_n: int = EVERY) -> dict:
    """`every_n`: the watched setting (a multiple of the log interval, 10)."""
    off, hundred, each = (row[k][warmup:] for k in (0, every_n, 1))
    base = statistics.median(off)
    log_steps = [i for i in range(warmup, len(row[every_n])) if (i + 1) % 10 == 0]
    watched = [row[every_n][i] for i in log_steps if (i + 1) % every_n == 0]
    other_logs = [row[every_n][i] for i in log_steps if (i + 1) % every_n]
    per_watch = statistics.median(watched) - statistics.median(other_logs)
    return {"off_median": base, "off_mean": statistics.fmean(off), "hundred_mean": statistics.fmean(hundred),
            "each_median": statistics.median(each), "watched": per_watch,
            "ab": statistics.fmean(hundred) / statistics.fmean(off) - 1,
            "ab_median": statistics.median(hundred) / base - 1,
            "from_watched": per_watch / every_n / base,
            "from_each": (statistics.median(each) - base) / every_n / base}


def hook_cost(reps: int, every_n: int = EVERY) -> tuple[float, float]:
    """CPU seconds of one forward + backward of the default model's micro-batch (shakespeare-char, 12 x 64) without
    hooks and with the watch's hooks installed but not watching, alternating: what numerics_every adds to a step it
    does not watch, apart from everything else a run does."""
    import torch

    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.layout import Layout
    from paratrain.models import preset_args
    from paratrain.observe.numerics import NumericsWatch
    from paratrain.training.step import build_train_step

    args = preset_args("shakespeare-char", vocab_size=128)
    steps = [build_train_step(args, ParallelDims(Layout.resolve(1))) for _ in range(2)]
    NumericsWatch(steps[1], args.n_layers, every_n, "fp32")
    x = torch.randint(0, 128, (12, 64))
    times: list[list[float]] = [[], []]
    for _ in range(reps):
        for i, step in enumerate(steps):
            started = time.process_time()
            step.forward_backward([(x, x)])
            step.zero_grad()
            times[i].append(time.process_time() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def _collectives(n: int) -> tuple[float, float]:
    """On each of two launched ranks: n all-reduces of one float; this rank's CPU and wall seconds per collective."""
    import torch
    import torch.distributed as dist

    from paratrain.distributed.env import init_process_group

    init_process_group(torch.device("cpu"), 60)
    x = torch.ones(1)
    for _ in range(50):
        dist.all_reduce(x)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    dist.destroy_process_group()
    return cpu / n, wall / n


def history_run(entries: int, n: int) -> tuple[float, float]:
    """Rank 0's seconds per collective with torch's flight recorder keeping `entries` (0: off)."""
    from paratrain.distributed.launch import launch

    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    try:
        return launch(_collectives, (n,), 2)
    finally:
        del os.environ["TORCH_FR_BUFFER_SIZE"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of each run")
    parser.add_argument("--no-history", action="store_true", help="skip the collective-history rounds")
    parser.add_argument("--collectives", type=int, default=3000, help="all-reduces per history round and setting")
    parser.add_argument("--hook-reps", type=int, default=200, help="forward + backward passes per side (hook cost)")
    parser.add_argument("--every", type=int, default=EVERY, help="the watched setting (metrics.numerics_every; a "
                        "multiple of 10, the log interval)")
    parser.add_argument("--smoke", action="store_true", help="one round of 30 steps of 2 sequences watched every 20, "
                        "2 hook passes, no history rounds (seconds; the test suite)")
    a = parser.parse_args(argv)
    training = {}
    if a.smoke:
        a.steps, a.rounds, a.warmup, a.every, a.hook_reps, a.no_history = 30, 1, 0, 20, 2, True
        training = {"micro_batch": 2, "eval_sequences": 4}
    every = a.every
    rows, history = [], []
    bare, hooked = hook_cost(a.hook_reps, every)
    print(f"forward + backward: {bare * 1e3:.2f} ms without hooks, {hooked * 1e3:.2f} ms with the watch's hooks "
          f"installed, not watching ({hooked / bare - 1:+.2%})", flush=True)
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.rounds):
            rows.append(costs(watch_round(out, a.steps, reverse=r % 2 == 1, every_n=every, training=training),
                              a.warmup, every))
            c = rows[-1]
            print(f"round {r + 1}: off {c['off_median'] * 1e3:.2f} ms, a watched step +{c['watched'] * 1e3:.2f} ms, "
                  f"every {every}: {c['ab']:+.2%} (means)", flush=True)
    if not a.no_history:
        for r in range(a.rounds):
            history.append((history_run(0, a.collectives), history_run(2000, a.collectives)))
            print(f"history round {r + 1}: off {history[-1][0][0] * 1e6:.1f} us CPU, 2000 entries "
                  f"{history[-1][1][0] * 1e6:.1f} us CPU per collective", flush=True)
    print(f"\n| round | off: median / mean CPU ms per step | every {every}: mean | every step: median | a watched "
          f"step's extra CPU ms | every {every} vs off: means / medians | from the watched steps | from the every-step "
          "run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, c in enumerate(rows):
        print(f"| {i + 1} | {c['off_median'] * 1e3:.2f} / {c['off_mean'] * 1e3:.2f} | {c['hundred_mean'] * 1e3:.2f} | "
              f"{c['each_median'] * 1e3:.2f} | {c['watched'] * 1e3:.2f} | {c['ab']:+.2%} / {c['ab_median']:+.2%} | "
              f"{c['from_watched']:+.3%} | {c['from_each']:+.3%} |")
    med = {k: statistics.median(c[k] for c in rows) for k in ("watched", "ab", "ab_median", "from_watched",
                                                              "from_each")}
    print(f"| median | | | | {med['watched'] * 1e3:.2f} | {med['ab']:+.2%} / {med['ab_median']:+.2%} | "
          f"{med['from_watched']:+.3%} | {med['from_each']:+.3%} |")
    if history:
        print("\n| round | history off: CPU / wall us per all-reduce | 2000 entries: CPU / wall us | CPU difference |")
        print("| --- | ---: | ---: | ---: |")
        for i, (off, on) in enumerate(history):
            print(f"| {i + 1} | {off[0] * 1e6:.1f} / {off[1] * 1e6:.1f} | {on[0] * 1e6:.1f} / {on[1] * 1e6:.1f} | "
                  f"{(on[0] - off[0]) * 1e6:+.1f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
