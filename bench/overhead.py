"""paratrain's per-step overhead: `paratrain train` against a plain PyTorch loop over the same model, batch and
optimizer, in one process, rounds alternating.

Both sides train the default model (preset shakespeare-char, context 64, micro-batch 12, fp32, one process) on the
same batches (paratrain's data reader, seed 1337) with the same AdamW (the kernels `optimizer.impl=auto` picks on the
device, `paratrain.modes.resolve_impl`: fused, foreach for fp16 on a CPU; the trainer's weight-decay groups),
gradient clipping at 1.0 and warmup + cosine learning rate. The plain loop is what one would write by hand: forward,
cross-entropy, backward, `clip_grad_norm_`, `step`, a LambdaLR, `zero_grad`, the losses kept as tensors. paratrain's
side is `paratrain.api.train_rank` with the default config (its log steps every 10, the metrics record, the guard,
the checkpointer's polls: everything but the final evaluation). A step's time is the interval between the starts of
consecutive steps (all of the loop's own work included); the table gives each side's median after `--warmup` steps,
per round, their median over the rounds, and the fastest round of each side (on a shared machine the least
disturbed figure), with the 1-minute load average after each round. `--clock cpu` times this process's CPU time
(time.process_time) instead of wall time: on a shared machine other processes disturb it less (one thread: the step's
own work; more threads: their sum). `--paired` runs both loops in one run, a plain step after each paratrain step, so
that a burst of load from elsewhere falls on both alike (each side's median is over its own steps).

    python bench/overhead.py                      # 3 rounds of 200 steps each side (~3 minutes on 2 CPU cores)
    python bench/overhead.py --rounds 5 --steps 300 --device cuda
    OMP_NUM_THREADS=1 python bench/overhead.py --clock cpu     # a busy machine
    python bench/overhead.py --paired                          # a busy machine: the two loops step by step
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from paratrain.api import train_rank
from paratrain.config import load_config


def config(out: str, steps: int, device: str):
    return load_config(None, [f"training.steps={steps}", f"training.device={device}", "sample.max_new_tokens=0",
                              "checkpoint.save_final=false", "metrics.progress=none", f"run.out_dir={out}",
                              "run.name=overhead", "run.overwrite=true"])


def train_with_step_hook(cfg, hook) -> None:
    """`paratrain train` in this process, calling `hook(recorder)` at the start of every step (before the trainer's
    own `StepRecorder.start`)."""
    from paratrain.training.record import StepRecorder

    original = StepRecorder.start

    def start(self, step):
        hook(self)
        return original(self, step)

    StepRecorder.start = start
    try:
        train_rank(cfg)
    finally:
        StepRecorder.start = original


def paratrain_steps(cfg, clock=time.perf_counter) -> list[float]:
    """`paratrain train` in this process; the intervals between the starts of consecutive steps on `clock` (wall
    time; time.process_time: this process's CPU time, which other processes on a shared machine disturb less)."""
    starts: list[float] = []

    def stamp(recorder):
        if recorder.clock.cuda:
            torch.cuda.synchronize()  # only to timestamp the interval; never in the trainer itself
        starts.append(clock())

    train_with_step_hook(cfg, stamp)
    return [b - a for a, b in zip(starts, starts[1:])]


def plain_loop(cfg):
    """The same training written as a plain PyTorch loop (the same kernels: `impl_kwargs`, the trainer's choice): a
    generator that runs one step per next()."""
    from paratrain.data import open_split
    from paratrain.data import dataset_meta
    from paratrain.models import Transformer
    from paratrain.spec import model_args_from
    from paratrain.training.optim import impl_kwargs, lr_at, param_groups

    t, o = cfg.training, cfg.optimizer
    device = torch.device(t.device)
    torch.manual_seed(t.seed)
    args = model_args_from(cfg, dataset_meta(cfg.data)["vocab_size"])
    model = Transformer(args).to(device)
    data = open_split(cfg.data, "train", t.seq_len)
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            **impl_kwargs(o, device))
    for group in opt.param_groups:
        group["initial_lr"] = 1.0  # LambdaLR's factor is then the learning rate itself
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, o, t.steps))
    losses = []
    model.train()
    for step in range(t.steps):
        (x, y), = data.micro_batches(step, t.micro_batch, t.seed, 0, 1, 1)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        yield
    torch.stack(losses).tolist()


def plain_steps(cfg, clock=time.perf_counter) -> list[float]:
    """`plain_loop`'s step intervals on `clock`."""
    cuda = cfg.training.device == "cuda"
    starts = []
    for _ in plain_loop(cfg):
        if cuda:
            torch.cuda.synchronize()
        starts.append(clock())
    return [b - a for a, b in zip(starts, starts[1:])]


def paired_steps(cfg, clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Both in one run, step by step: each paratrain step is followed by a plain one (timed apart at the top of the
    next paratrain step), so a burst of load from elsewhere falls on both sides alike. Returns (paratrain, plain)."""
    plain = plain_loop(cfg)
    ours, theirs, last = [], [], [None]

    def step_pair(recorder):
        if recorder.clock.cuda:
            torch.cuda.synchronize()
        before = clock()
        if last[0] is not None:
            ours.append(before - last[0])
            next(plain, None)
            if recorder.clock.cuda:
                torch.cuda.synchronize()
            after = clock()
            theirs.append(after - before)
        last[0] = clock()

    train_with_step_hook(cfg, step_pair)
    return ours, theirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of each round's median")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: this process's CPU time (less disturbed on a shared machine)")
    parser.add_argument("--smoke", action="store_true", help="one round of 3 steps each side (the test suite)")
    parser.add_argument("--paired", action="store_true",
                        help="each round one run, a plain step after each paratrain step (a shared machine)")
    a = parser.parse_args(argv)
    if a.smoke:
        a.steps, a.rounds, a.warmup = 3, 1, 0
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    rows = []
    with tempfile.TemporaryDirectory() as out:
        cfg = config(out, a.steps, a.device)
        for r in range(a.rounds):
            if a.paired:
                ours, plain = (statistics.median(x[a.warmup:]) for x in paired_steps(cfg, clock))
            else:
                ours = statistics.median(paratrain_steps(cfg, clock)[a.warmup:])
                plain = statistics.median(plain_steps(cfg, clock)[a.warmup:])
            rows.append((r + 1, ours, plain, os.getloadavg()[0]))
            print(f"round {r + 1}: paratrain {ours * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms, load "
                  f"{rows[-1][3]:.1f}", flush=True)
    ours = statistics.median(row[1] for row in rows)
    plain = statistics.median(row[2] for row in rows)
    print(f"\n| round | paratrain train (median ms/step) | plain PyTorch loop (median ms/step) | overhead | load |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r, o, p, load in rows:
        print(f"| {r} | {o * 1e3:.2f} | {p * 1e3:.2f} | {o / p - 1:+.1%} | {load:.1f} |")
    print(f"| median | {ours * 1e3:.2f} | {plain * 1e3:.2f} | {ours / plain - 1:+.1%} | |")
    best_ours, best_plain = min(row[1] for row in rows), min(row[2] for row in rows)
    print(f"| fastest round | {best_ours * 1e3:.2f} | {best_plain * 1e3:.2f} | {best_ours / best_plain - 1:+.1%} | |")
    print(f"\n{a.steps} steps per round ({a.warmup} warm-up left out), default model, micro-batch "
          f"{cfg.training.micro_batch} x {cfg.training.seq_len} tokens, {a.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {a.clock} clock{', paired steps' if a.paired else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
