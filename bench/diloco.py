"""DiLoCo against data parallelism on the tinyshakespeare recipe: bytes across the replicas per token and the val loss
at equal tokens (issue 54).

bench/compression.py's recipe (nanoGPT's CPU settings: 4 layers, 4 heads, width 128, context 64, global batch 12,
AdamW lr 1e-3 -> 1e-4, 2000 steps) on R ranks of dp_mode=ddp (each rank 12 / R sequences of every step's batch), once
with data parallelism (the gradients all-reduced every step) and once per DiLoCo setting (`parallel.dp_sync=diloco`:
AdamW inside each replica, Nesterov SGD outside, by default outer_lr 0.7 and momentum 0.9; H = inner_steps,
F = fragments). Every run sees the same batches, so the tokens are equal at every step. Bytes are what rank 0 sends
(`comm_bytes`: data parallelism's gradient all-reduce, DiLoCo's pseudo-gradient all-reduce, equal to its
`diloco_bytes`), summed over the run and divided by the tokens trained. Goal: >= 99% fewer bytes than data
parallelism at a final val loss within 2% of it, for some H.

Each DiLoCo row's label names H, F and every other `[diloco]` setting that is not the default (`--outer-lr`,
`--outer-momentum`, `--no-nesterov`, `--outer-dtype`, `--outer-compression`, or `--set diloco.KEY=VALUE`).
`--baseline VAL_LOSS` takes data parallelism's val loss from an earlier run of the same length (deterministic) and
trains it for BASELINE_STEPS steps only, to measure its bytes per token (the same every step).

    python bench/diloco.py [--steps 2000] [--replicas 2 4] [--inner-steps 10 50 100] [--fragments 1 4]
    python bench/diloco.py --replicas 2 --inner-steps 10 --fragments 2 --outer-compression sign_ef --outer-lr 1.4 \
        --outer-momentum 0 --baseline 1.6574
    python bench/diloco.py --smoke      # 2 replicas, data parallelism and H=2 F=2, 4 steps (the test suite)

The second command (2,000 steps by default) is the best setting measured: 99.69% fewer bytes at +1.46% val loss
(bench/RESULTS.md, seventh session).
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
from paratrain.capabilities.diloco import DiLoCo, DiLoCoConfig  # noqa: E402
from paratrain.config import load_config  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402

GLOBAL_BATCH, SEQ_LEN = 12, 64  # the recipe's
BASELINE_STEPS = 5  # data parallelism's steps with --baseline: its bytes per token, the same at every step


def run(out: str, name: str, steps: int, replicas: int, eval_sequences: int, extra: list[str]) -> dict:
    """One training run on `replicas` ranks; its final val loss, bytes rank 0 sent per token, wall time and label."""
    cfg = load_config(None, recipe(steps, 0, out, name, [f"training.micro_batch={GLOBAL_BATCH // replicas}", *extra],
                                   eval_sequences))
    start = time.perf_counter()
    result = train(cfg, nproc=replicas, oversubscribe=True)  # 4 ranks on a 2-core machine
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (Path(out) / name / "metrics.jsonl").open()]
    steps_done = [r for r in records if "comm_bytes" in r]
    sent = sum(r["comm_bytes"] for r in steps_done)
    return {"val": result.val_loss, "bytes_per_token": sent / steps_done[-1]["tokens"],  # tokens: the run's so far
            "syncs": sum(1 for r in steps_done if r.get("diloco_bytes", 1) > 0), "wall": wall,
            "label": diloco_label(cfg.diloco)}


def diloco_label(d) -> str:
    """A DiLoCo row's name: H, F and every other [diloco] setting that differs from its default."""
    default = DiLoCoConfig()
    others = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in vars(d).items()
              if k not in ("inner_steps", "fragments") and v != getattr(default, k)]
    return " ".join([f"DiLoCo H={d.inner_steps} F={d.fragments}", *others])


def seconds(wall: float) -> str:
    return "—" if wall != wall else f"{wall:.0f}"  # (nan: the --baseline row, not timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="data-parallel ranks (divide 12)")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50, 100], help="H values")
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 4], help="streaming fragments (divide H)")
    parser.add_argument("--eval-sequences", type=int, default=204, help="validation sequences (17 x 12 ~ nanoGPT's 200)")
    parser.add_argument("--outer-lr", type=float, help="diloco.outer_lr (default: the config's)")
    parser.add_argument("--outer-momentum", type=float, help="diloco.outer_momentum (default: the config's)")
    parser.add_argument("--no-nesterov", action="store_true", help="diloco.nesterov=false")
    # (their choices are the config's: a wrong one gets its one-line error from load_config)
    parser.add_argument("--outer-dtype", help="diloco.outer_dtype (default: the config's)")
    parser.add_argument("--outer-compression", help="diloco.outer_compression (default: the config's)")
    parser.add_argument("--baseline", type=float, metavar="VAL_LOSS", help="data parallelism's final val loss from an "
                        f"earlier run of --steps steps (deterministic): it trains {BASELINE_STEPS} steps only, for its "
                        "bytes per token")
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
    outer = [f"diloco.{key}={value}" for key, value in (
        ("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum), ("outer_dtype", args.outer_dtype),
        ("outer_compression", args.outer_compression), ("nesterov", False if args.no_nesterov else None))
        if value is not None]
    try:  # the [diloco] settings checked before any run (a wrong one: its one-line error, not a traceback)
        DiLoCo.check(load_config(None, ["parallel.dp_sync=diloco", *outer, *args.set]))
    except ConfigError as error:
        parser.error(str(error))
    rows = []
    with tempfile.TemporaryDirectory(prefix="paratrain-diloco-") as out:
        for replicas in args.replicas:
            if args.baseline is None:
                base = run(out, f"dp{replicas}", args.steps, replicas, args.eval_sequences, args.set)
                label = "data parallelism"
            else:  # its bytes measured on a few steps, its val loss the earlier run's
                base = {**run(out, f"dp{replicas}", BASELINE_STEPS, replicas, 12, args.set), "val": args.baseline,
                        "syncs": args.steps, "wall": float("nan")}
                label = f"data parallelism (val loss: --baseline {args.baseline})"
            rows.append((replicas, label, base, base))
            print(f"{replicas} replicas, {label}: val {base['val']:.4f}, {seconds(base['wall'])} s", flush=True)
            for h in args.inner_steps:
                for f in args.fragments:
                    if h % f:
                        continue
                    name = f"diloco{replicas}-h{h}-f{f}"
                    extra = ["parallel.dp_sync=diloco", f"diloco.inner_steps={h}", f"diloco.fragments={f}", *outer,
                             *args.set]
                    r = run(out, name, args.steps, replicas, args.eval_sequences, extra)
                    rows.append((replicas, r["label"], r, base))
                    print(f"{replicas} replicas, {r['label']}: val {r['val']:.4f}, {r['wall']:.0f} s", flush=True)
    print(f"\n{args.steps} steps of global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens (equal tokens in every row), "
          f"ddp ranks = replicas; bytes: rank 0's across the replicas\n")
    print("| replicas | sync | syncs | bytes/token | fewer bytes than dp | val loss | gap vs dp | wall s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for replicas, label, r, base in rows:
        fewer = 1 - r["bytes_per_token"] / base["bytes_per_token"]
        gap = (r["val"] - base["val"]) / base["val"]
        print(f"| {replicas} | {label} | {r['syncs']} | {r['bytes_per_token']:,.1f} | {fewer:.2%} | {r['val']:.4f} "
              f"| {gap:+.2%} | {seconds(r['wall'])} |")
    goal = [(replicas, label) for replicas, label, r, base in rows if r is not base
            and r["bytes_per_token"] <= (0.01 + 1e-9) * base["bytes_per_token"] and r["val"] <= 1.02 * base["val"]]
    print("\n>= 99% fewer bytes within 2% of dp's val loss: " + (", ".join(f"{lab} ({n} replicas)" for n, lab in goal)
                                                               or "none"))


if __name__ == "__main__":
    main()
