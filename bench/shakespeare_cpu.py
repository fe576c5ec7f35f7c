"""nanoGPT's documented CPU recipe for tinyshakespeare (char-level), run through paratrain.

Recipe (nanoGPT config/train_shakespeare_char.py with its README's CPU settings): 4 layers, 4 heads,
width 128, context 64, batch 12, 2000 iterations, lr 1e-3 decayed to 1e-4, no dropout. nanoGPT
reports val loss 1.88 for it. Prints a table: steps, wall seconds, tokens/s, train/val loss, and
the first step at which the val loss reached the target.

    python bench/shakespeare_cpu.py [--steps 2000] [--eval-every 100] [--target 1.88]
    python bench/shakespeare_cpu.py --smoke     # 4 steps, 2 evaluations of 12 sequences (the test suite)
    python bench/shakespeare_cpu.py --set memory.loss_chunks=8 --set optimizer.impl=foreach   # other settings
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from paratrain.config import load_config
from paratrain.api import train_rank as train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-sequences", type=int, default=204, help="validation sequences (17 x 12 ~ nanoGPT's 200)")
    parser.add_argument("--target", type=float, default=1.88)
    parser.add_argument("--smoke", action="store_true", help="a few steps of the same run (seconds; the test suite)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config setting over the recipe's (repeatable)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.eval_every, args.eval_sequences = 4, 2, 12
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            "model.preset=shakespeare-char", "training.seq_len=64", "training.micro_batch=12",
            f"training.steps={args.steps}", f"training.eval_every={args.eval_every}",
            f"training.eval_sequences={args.eval_sequences}", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
            "optimizer.warmup_steps=100", "optimizer.beta2=0.99", "optimizer.weight_decay=0.1",
            "checkpoint.save_final=false", "sample.max_new_tokens=0", "metrics.progress=none",
            f"run.out_dir={out}", "run.name=shakespeare-cpu", *args.set])
        start = time.perf_counter()
        result = train(cfg)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (Path(out) / "shakespeare-cpu" / "metrics.jsonl").open()]
    evals = [(r["step"], r["val_loss"], r["time"]) for r in records if "val_loss" in r]
    first = next(r for r in records if "step_time_s" in r)  # the first step's record (a segment record comes first)
    t0 = first["time"] - first["step_time_s"]
    reached = next(((s, t - t0) for s, v, t in evals if v <= args.target), None)
    tok_s = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    train_loss = sum(result.losses[-20:]) / min(20, len(result.losses))
    print(f"| steps | wall s | tokens/s | train loss | val loss | reached {args.target} |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    when = f"step {reached[0]} ({reached[1]:.0f}s)" if reached else "not reached"
    print(f"| {args.steps} | {wall:.1f} | {sorted(tok_s)[len(tok_s) // 2]:,.0f} | {train_loss:.4f} | "
          f"{result.val_loss:.4f} | {when} |")
    print("val loss by step: " + ", ".join(f"{s}:{v:.3f}" for s, v, _ in evals))


if __name__ == "__main__":
    main()
