"""Low-memory optimizer states against AdamW: the tinyshakespeare recipe (`make run`'s config, 2000 steps, one
process) with each optimizer, its final validation loss, its state bytes and its step time.

    python bench/low_memory_optimizers.py                      # adamw, adamw-bf16, adamw8bit (needs torchao)
    python bench/low_memory_optimizers.py --optimizers adamw,adamw-bf16 --steps 500
    python bench/low_memory_optimizers.py --smoke       # adamw and adamw-bf16, 3 steps each (the test suite)

The goal (docs/memory-tiers.md): final val loss within 1% of AdamW's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="adamw,adamw-bf16,adamw8bit")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help="adamw and adamw-bf16 for 3 steps, a 12-sequence evaluation "
                    "(seconds; the test suite)")
    args = ap.parse_args()
    smoke = ["training.eval_sequences=12"] if args.smoke else []
    if args.smoke:
        args.optimizers, args.steps = "adamw,adamw-bf16", 3
    from paratrain.api import train
    from paratrain.config import load_config

    rows = []
    with tempfile.TemporaryDirectory(prefix="lowmem-") as out:
        for name in args.optimizers.split(","):
            cfg = load_config(None, [f"optimizer.name={name}", f"training.steps={args.steps}", f"run.out_dir={out}",
                                     f"run.name={name}", "sample.max_new_tokens=0", "metrics.progress=none",
                                     "checkpoint.save_final=false", *smoke])
            start = time.perf_counter()
            result = train(cfg)
            state = result.memory[0]["optimizer"] if result.memory else None  # (per rank, where reported)
            rows.append((name, result.val_loss, state, time.perf_counter() - start))
            print(f"{name}: val loss {result.val_loss:.4f}", file=sys.stderr, flush=True)
    base = rows[0][1]
    print("| optimizer | final val loss | vs adamw | optimizer state bytes | wall s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, val, state, seconds in rows:
        shown = "-" if state is None else f"{state:,}"
        print(f"| {name} | {val:.4f} | {100 * (val - base) / base:+.2f}% | {shown} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
