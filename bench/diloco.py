"""DiLoCo against data parallelism on the tinyshakespeare recipe: bytes across the replicas per token and the val loss
at equal tokens (issue 54).

bench/compression.py's recipe (nanoGPT's CPU settings: 4 layers, 4 heads, width 128, context 64, global batch 12,
AdamW lr 1e-3 -> 1e-4, 2000 steps) on R ranks of dp_mode=ddp (each rank 12 / R sequences of every step's batch), once
with data parallelism (the gradients all-reduced every step) and once per DiLoCo setting (`parallel.dp_sync=diloco`:
AdamW inside each replica, Nesterov SGD outside at the defaults outer_lr 0.7 and momentum 0.9; H = inner_steps,
F = fragments). Every run sees the same batches, so the tokens are equal at every step. Bytes are what rank 0 sends
(`comm_bytes`: data parallelism's gradient all-reduce, DiLoCo's pseudo-gradient all-reduce, equal to its
`diloco_bytes`), summed over the run and divided by the tokens trained. Goal: >= 99% fewer bytes than data
parallelism at a final val loss within 2% of it, for some H.

    python bench/diloco.py [--steps 2000] [--replicas 2 4] [--inner-steps 10 50 100] [--fragments 1 4]
    python bench/diloco.py --smoke      # 2 replicas, data parallelism and H=2 F=2, 4 steps (the test suite)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/compression.py's recipe
from compression import recipe  # noqa: E402

from paratrain.api import train  # noqa: E402
from paratrain.config import load_config  # noqa: E402

GLOBAL_BATCH, SEQ_LEN = 12, 64  # the recipe's


def run(out: str, name: str, steps: int, replicas: int, eval_sequences: int, extra: list[str]) -> dict:
    """One training run on `replicas` ranks; its final val loss, bytes rank 0 sent per token, and wall time."""
    cfg = load_config(None, recipe(steps, 0, out, name, [f"training.micro_batch={GLOBAL_BATCH // replicas}", *extra],
                                   eval_sequences))
    start = time.perf_counter()
    result = train(cfg, nproc=replicas, oversubscribe=True)  # 4 ranks on a 2-core machine
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (Path(out) / name / "metrics.jsonl").open()]
    steps_done = [r for r in records if "comm_bytes" in r]
    sent = sum(r["comm_bytes"] for r in steps_done)
    return {"val": result.val_loss, "bytes_per_token": sent / steps_done[-1]["tokens"],  # tokens: the run's so far
            "syncs": sum(1 for r in steps_done if r.get("diloco_bytes", 1) > 0), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="data-parallel ranks (divide 12)")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50, 100], help="H values")
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 4], help="streaming fragments (divide H)")
    parser.add_argument("--eval-sequences", type=int, default=204, help="validation sequences (17 x 12 ~ nanoGPT's 200)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config setting over the recipe's, for every run (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="2 replicas, data parallelism and H=2 F=2, 4 steps, 12 "
                        "validation sequences (the test suite)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.replicas, args.inner_steps, args.fragments, args.eval_sequences = 4, [2], [2], [2], 12
    bad = [r for r in args.replicas if r < 2 or GLOBAL_BATCH % r]
    if bad:
        parser.error(f"--replicas {bad[0]}: DiLoCo needs >= 2 replicas that divide the global batch of {GLOBAL_BATCH}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="paratrain-diloco-") as out:
        for replicas in args.replicas:
            base = run(out, f"dp{replicas}", args.steps, replicas, args.eval_sequences, args.set)
            rows.append((replicas, "data parallelism", base, base))
            print(f"{replicas} replicas, data parallelism: val {base['val']:.4f}, {base['wall']:.0f} s", flush=True)
            for h in args.inner_steps:
                for f in args.fragments:
                    if h % f:
                        continue
                    name = f"diloco{replicas}-h{h}-f{f}"
                    extra = ["parallel.dp_sync=diloco", f"diloco.inner_steps={h}", f"diloco.fragments={f}", *args.set]
                    r = run(out, name, args.steps, replicas, args.eval_sequences, extra)
                    rows.append((replicas, f"DiLoCo H={h} F={f}", r, base))
                    print(f"{replicas} replicas, H={h} F={f}: val {r['val']:.4f}, {r['wall']:.0f} s", flush=True)
    print(f"\n{args.steps} steps of global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens (equal tokens in every row), "
          f"ddp ranks = replicas; bytes: rank 0's across the replicas\n")
    print("| replicas | sync | syncs | bytes/token | fewer bytes than dp | val loss | gap vs dp | wall s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for replicas, label, r, base in rows:
        fewer = 1 - r["bytes_per_token"] / base["bytes_per_token"]
        gap = (r["val"] - base["val"]) / base["val"]
        print(f"| {replicas} | {label} | {r['syncs']} | {r['bytes_per_token']:,.1f} | {fewer:.2%} | {r['val']:.4f} "
              f"| {gap:+.2%} | {r['wall']:.0f} |")
    goal = [(replicas, label) for replicas, label, r, base in rows if r is not base
            and r["bytes_per_token"] <= (0.01 + 1e-9) * base["bytes_per_token"] and r["val"] <= 1.02 * base["val"]]
    print("\n>= 99% fewer bytes within 2% of dp's val loss: " + (", ".join(f"{lab} ({n} replicas)" for n, lab in goal)
                                                               or "none"))


if __name__ == "__main__":
    main()
