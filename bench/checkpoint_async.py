"""What a checkpoint save costs the training steps it overlaps, saved synchronously and in the background.

One process trains the default model (`paratrain train`'s recipe) with a checkpoint every 10 steps, once with
`checkpoint.async_save=false` and once with `true` (alternating, --repeat times each). A step's time is the wall time
from the start of one step to the start of the next, so it includes whatever the loop does between them (the
synchronous save; the background save's staging copy and its commit at a later step boundary). A step *overlaps a
save* when that interval meets a save's time from its start to its commit (the folder renamed into place); the others
are the steps without one. Prints the median of each, their ratio, and the save's own time (the blocking part: the
whole save when synchronous, the staging copy + start of the write in the background).

    python bench/checkpoint_async.py [--steps 300] [--repeat 2] [--set section.key=value ...]
    python bench/checkpoint_async.py --smoke     # the tiny model, 30 steps, once (the test suite)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from paratrain.api import train_rank
from paratrain.config import load_config
from paratrain.training.checkpoint import CheckpointWriter
from paratrain.training.loop import Trainer

EVERY = 10


class Clock:
    """Each step's start, and each save's (start, blocking end, commit end), recorded by wrapping the trainer's step
    and the writer's save and commit."""

    def __init__(self):
        self.starts: list[float] = []
        self.saves: list[tuple[float, float]] = []  # (start, return of save(): what blocks the loop)
        self.commits: list[float] = []

    def __enter__(self):
        step, save, commit = Trainer._step, CheckpointWriter.save, CheckpointWriter._commit
        self.originals = step, save, commit

        def timed_step(trainer, *a, **k):
            self.starts.append(time.perf_counter())
            return step(trainer, *a, **k)

        def timed_save(writer, *a, **k):
            start = time.perf_counter()
            path = save(writer, *a, **k)
            self.saves.append((start, time.perf_counter()))
            return path

        def timed_commit(writer, *a, **k):
            out = commit(writer, *a, **k)
            self.commits.append(time.perf_counter())
            return out

        Trainer._step, CheckpointWriter.save, CheckpointWriter._commit = timed_step, timed_save, timed_commit
        return self

    def __exit__(self, *exc):
        Trainer._step, CheckpointWriter.save, CheckpointWriter._commit = self.originals

    def split(self, skip: int = 2) -> tuple[list[float], list[float], list[float]]:
        """(times of the steps overlapping a save, of the others, each save's blocking time); the first `skip` steps
        (warm-up) left out. A save lasts from its start to the first commit after it (a save still in flight at the
        end of the run: to the end)."""
        windows = [(s, min((c for c in self.commits if c > s), default=float("inf"))) for s, _ in self.saves]
        overlapping, clean = [], []
        for a, b in zip(self.starts[skip:], self.starts[skip + 1:]):
            (overlapping if any(a < end and start < b for start, end in windows) else clean).append(b - a)
        return overlapping, clean, [end - start for start, end in self.saves]


def run(mode: bool, steps: int, data: str, out: str, name: str, extra: list[str]) -> Clock:
    overrides = [f"training.steps={steps}", f"checkpoint.every={EVERY}", f"checkpoint.async_save={str(mode).lower()}",
                 "checkpoint.every_minutes=0", "checkpoint.save_final=false", "checkpoint.keep=2",
                 "training.eval_every=0", "sample.max_new_tokens=0", "metrics.progress=none", "training.device=cpu",
                 f"data.dir={data}", "data.source=tinyshakespeare", "data.tokenizer=char", f"run.out_dir={out}",
                 f"run.name={name}", *extra]
    with Clock() as clock:
        train_rank(load_config(None, overrides))
    return clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 30 steps, once (seconds; the test suite)")
    a = p.parse_args()
    extra = list(a.set)
    if a.smoke:
        a.steps, a.repeat = 3 * EVERY, 1
        extra = ["model.preset=tiny", "training.seq_len=32", "training.micro_batch=4", *extra]
    results = {False: ([], [], []), True: ([], [], [])}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeat):
            for mode in (False, True):
                clock = run(mode, a.steps, f"{tmp}/data", tmp, f"{'async' if mode else 'sync'}-{r}", extra)
                for into, values in zip(results[mode], clock.split()):
                    into.extend(values)
    print(f"checkpoint every {EVERY} steps, {a.steps} steps x {a.repeat} runs per mode; medians (ms)")
    # (added per save: what the overlapping steps took beyond as many steps without a save, per save: the save's
    # whole cost to the run, however many steps it is spread over)
    print("| save | steps overlapping a save | steps without one | ratio | save blocks the loop | added per save |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, (overlapping, clean, blocking) in results.items():
        over, free = statistics.median(overlapping), statistics.median(clean)
        added = (sum(overlapping) - len(overlapping) * free) / len(blocking)
        print(f"| {'async_save=true' if mode else 'async_save=false'} | {over * 1e3:.1f} (n={len(overlapping)}) | "
              f"{free * 1e3:.1f} (n={len(clean)}) | {over / free:.2f}x | {statistics.median(blocking) * 1e3:.1f} | "
              f"{added * 1e3:.0f} |")


if __name__ == "__main__":
    main()
