"""Compressed communication on the tinyshakespeare recipe: bytes on the wire against the validation loss.

Trains bench/shakespeare_cpu.py's recipe (nanoGPT's CPU settings: 4 layers, 4 heads, width 128, context 64, batch 12,
lr 1e-3 -> 1e-4, 2000 iterations) on 2 ranks with dp_mode=ddp (each rank 6 sequences of the global batch of 12), once
per method: a `parallel.grad_compression` with AdamW, or an optimizer that compresses its own communication
(`optimizer.name` onebit_adam, zero_one_adam: 1-bit Adam and 0/1 Adam, docs/optimizers.md). It prints per method:
the bytes this rank sends per step for the data-parallel reduction (mean over the whole run, warm-up included, and
after any warm-up), the reduction against none, the final validation loss, its gap to none, wall time and tokens/s.
Goals: >= 90% fewer bytes than none over the whole run; final val loss within 2% of none (issues 15 and 29).

    python bench/compression.py [--steps 2000] [--methods none,bf16,powersgd,sign_ef,onebit_adam,zero_one_adam]
                                [--powersgd-rank 4] [--set optimizer.freeze_step=300] [--label NAME]
    python bench/compression.py --smoke     # none and bf16, 4 steps each, a 12-sequence evaluation (the test suite)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from paratrain.api import train
from paratrain.config import load_config
from paratrain.capabilities.grad_compression import GRAD_COMPRESSIONS, Compression
from paratrain.capabilities import OPTIMIZERS

OPTIMIZER_METHODS = tuple(name for name, entry in OPTIMIZERS.items() if entry.communicates)  # 1-bit Adam, 0/1 Adam
METHODS = (*GRAD_COMPRESSIONS, *OPTIMIZER_METHODS)


def recipe(steps: int, eval_every: int, out: str, name: str, extra: list[str], eval_sequences: int = 204) -> list[str]:
    return ["model.preset=shakespeare-char", "training.seq_len=64", "training.global_batch=12",
            "training.micro_batch=6", f"training.steps={steps}", f"training.eval_every={eval_every}",
            f"training.eval_sequences={eval_sequences}", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_steps=100",
            "optimizer.beta2=0.99", "optimizer.weight_decay=0.1", "parallel.dp_mode=ddp",
            "checkpoint.save_final=false", "sample.max_new_tokens=0", "metrics.progress=none", "training.device=cpu",
            f"run.out_dir={out}", f"run.name={name}", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--powersgd-warmup", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--label", default="", help="appended to each method's name in the table (a variant)")
    parser.add_argument("--baseline", metavar="VAL_LOSS,BYTES", help="none's final val loss and mean bytes per step "
                        "from an earlier run (deterministic), to compare variants without training none again")
    parser.add_argument("--eval-sequences", type=int, default=204, help="validation sequences (17 x 12 ~ nanoGPT's 200)")
    parser.add_argument("--smoke", action="store_true", help="none and bf16 for 4 steps, 12 validation sequences "
                        "(seconds; the test suite)")
    args = parser.parse_args()
    if args.smoke:
        args.methods, args.steps, args.eval_every, args.eval_sequences = "none,bf16", 4, 2, 12
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: '{unknown[0]}' is not one of {', '.join(METHODS)}")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for method in methods:
            # an optimizer that communicates itself runs with the plain reduction settings
            own = [f"optimizer.name={method}"] if method in OPTIMIZER_METHODS else [f"parallel.grad_compression={method}"]
            extra = [*own, f"parallel.powersgd_rank={args.powersgd_rank}",
                     f"parallel.powersgd_warmup_steps={args.powersgd_warmup}", *args.set]
            cfg = load_config(None, recipe(args.steps, args.eval_every, out, method, extra, args.eval_sequences))
            start = time.perf_counter()
            result = train(cfg, nproc=args.nproc)
            wall = time.perf_counter() - start
            records = [json.loads(line) for line in (Path(out) / method / "metrics.jsonl").open()]
            steps = [r for r in records if "comm_bytes" in r]
            late = [r for r in steps if r["compression_ratio"] < 1.0] or steps  # after any uncompressed warm-up
            evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
            tok_s = sorted(r["tokens_per_s"] for r in steps)
            rows.append({"method": method, "label": method + args.label, "bytes": sum(r["comm_bytes"] for r in steps) / len(steps),
                         "bytes_late": sum(r["comm_bytes"] for r in late) / len(late), "val": result.val_loss,
                         "wall": wall, "tok_s": tok_s[len(tok_s) // 2], "evals": evals})
            print(f"{method}: val {result.val_loss:.4f}, {rows[-1]['bytes']:,.0f} B/step, {wall:.0f} s", flush=True)
    # none: AdamW's uncompressed reduction (or, for variants, its numbers from an earlier run)
    base = next((r for r in rows if r["method"] in GRAD_COMPRESSIONS and not Compression(r["method"]).enabled), None)
    if base is None and args.baseline:
        val, sent = (float(x) for x in args.baseline.split(","))
        base = {"val": val, "bytes": sent}
    print()
    print(f"{args.nproc} ranks (ddp), {args.steps} steps, global batch 12 x 64 tokens")
    print(f"| method | bytes/step (mean) | bytes/step (after warm-up) | reduction vs none | val loss | gap vs none "
          f"| wall s | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        red = f"{1 - r['bytes'] / base['bytes']:.1%}" if base else "-"
        gap = f"{(r['val'] - base['val']) / base['val']:+.2%}" if base else "-"
        print(f"| {r['label']} | {r['bytes']:,.0f} | {r['bytes_late']:,.0f} | {red} | {r['val']:.4f} | {gap} "
              f"| {r['wall']:.0f} | {r['tok_s']:,.0f} |")
    for r in rows:
        print(f"{r['label']} val loss by step: " + ", ".join(f"{s}:{v:.3f}" for s, v in r["evals"]))


if __name__ == "__main__":
    main()
