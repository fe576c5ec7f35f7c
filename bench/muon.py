"""Muon against AdamW on the tinyshakespeare recipe (bench/shakespeare_cpu.py's: nanoGPT's CPU settings, 2000 steps),
on one process and on 2 FSDP ranks: the val loss every `--report-every` steps side by side, the first step at which
Muon reaches AdamW's final val loss (the goal: at most 70% of the steps), and the step time of each (Muon's
orthogonalisation as a ratio to AdamW's step).

    python bench/muon.py                         # 1 process and fsdp2, 2000 steps each, both optimizers
    python bench/muon.py --nproc 1 --steps 500
    python bench/muon.py --nproc 1 --muon-set optimizer.muon_lr=0.004   # Muon's own peak learning rate
    python bench/muon.py --smoke                 # 4 steps on 1 process (seconds; the test suite)

Muon's learning rate is AdamW's (optimizer.muon_adjust_lr=match_rms_adamw gives its update AdamW's RMS), the rest of
the recipe unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPE = ["model.preset=shakespeare-char", "training.seq_len=64", "training.global_batch=12", "optimizer.lr=1e-3",
          "optimizer.min_lr=1e-4", "optimizer.warmup_steps=100", "optimizer.beta2=0.99", "optimizer.weight_decay=0.1",
          "checkpoint.save_final=false", "checkpoint.every=0", "sample.max_new_tokens=0", "metrics.progress=none"]


def run(optimizer: str, nproc: int, steps: int, eval_every: int, eval_sequences: int, out: str,
        extra: list[str] = ()) -> dict:
    from paratrain.api import train
    from paratrain.config import load_config

    name = f"{optimizer}-{nproc}"
    layout = ["parallel.dp_mode=fsdp", f"training.micro_batch={12 // nproc}"] if nproc > 1 else []
    cfg = load_config(None, [*RECIPE, *layout, f"optimizer.name={optimizer}", f"training.steps={steps}",
                             f"training.eval_every={eval_every}", f"training.eval_sequences={eval_sequences}",
                             f"run.out_dir={out}", f"run.name={name}", *extra])
    train(cfg, nproc=nproc)
    records = [json.loads(line) for line in (Path(out) / name / "metrics.jsonl").open()]
    evals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r][1:]  # the first step compiles, warms up
    return {"evals": evals, "step_s": statistics.median(step_times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--nproc", default="1,2", help="comma-separated world sizes (more than 1: fsdp)")
    ap.add_argument("--eval-every", type=int, default=50, help="how often the val loss is measured")
    ap.add_argument("--report-every", type=int, default=500, help="the val losses shown side by side")
    ap.add_argument("--eval-sequences", type=int, default=204)
    ap.add_argument("--muon-set", action="append", default=[], metavar="optimizer.KEY=VALUE",
                    help="a setting of Muon's run only (repeatable), e.g. optimizer.muon_lr=0.004")
    ap.add_argument("--smoke", action="store_true", help="4 steps on one process (the test suite)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.nproc, args.eval_every, args.report_every, args.eval_sequences = 4, "1", 2, 2, 12
    with tempfile.TemporaryDirectory(prefix="muon-bench-") as out:
        for nproc in map(int, args.nproc.split(",")):
            got = {o: run(o, nproc, args.steps, args.eval_every, args.eval_sequences, out,
                          args.muon_set if o == "muon" else []) for o in ("adamw", "muon")}
            adamw, muon = got["adamw"], got["muon"]
            final = adamw["evals"][args.steps]
            reached = next((s for s, v in sorted(muon["evals"].items()) if v <= final), None)
            layout = "1 process" if nproc == 1 else f"fsdp, {nproc} ranks"
            print(f"\n{layout}, {args.steps} steps (val loss every {args.eval_every} steps)")
            print("| step | adamw val loss | muon val loss |")
            print("| ---: | ---: | ---: |")
            for step in range(args.report_every, args.steps + 1, args.report_every):
                print(f"| {step} | {adamw['evals'][step]:.4f} | {muon['evals'][step]:.4f} |")
            share = f"{reached} ({100 * reached / args.steps:.0f}% of the steps)" if reached else "not reached"
            print(f"muon reaches adamw's final val loss {final:.4f} at step {share}")
            print(f"median step: adamw {adamw['step_s'] * 1e3:.1f} ms, muon {muon['step_s'] * 1e3:.1f} ms "
                  f"({muon['step_s'] / adamw['step_s']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
