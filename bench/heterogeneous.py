"""Heterogeneous cluster on CPU ranks: the planner's uneven pipeline split against the even one, measured.

Two CPU ranks stand in for two GPU types: rank 1 is made SLOWDOWN times slower than rank 0 with the benchmark knob
PARATRAIN_SIM_SLOWDOWN (paratrain/distributed/pipeline.py: after each of its pipeline chunks the rank waits
SLOWDOWN - 1 times the chunk's compute time). The planner sees the same two types as profiles:

1. `paratrain plan --calibrate --model M` on this machine gives "cpu-fast" (matmul and attention at the model's
   shapes, one block timed, collectives); "cpu-slow" is the same profile with every compute rate divided by
   SLOWDOWN (the knob's factor: a calibrated slowdown, not a guess).
2. `paratrain plan --gpus 1xcpu-fast,1xcpu-slow` places the two pipeline stages and splits the blocks for them.
3. Both splits are trained with `paratrain train --nproc 2 --config plan/config.toml` and the knob set: the plan's
   uneven split as written, then the same config with the even split (`parallel.pp_split` balanced by parameter
   count, what paratrain does without a split). Median step time after warm-up.

    python bench/heterogeneous.py [--slowdown 3] [--steps 14] [--layers 8]
    python bench/heterogeneous.py --smoke    # 5 steps of a 4-block model, a short calibration (the test suite)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def slower(hw, factor: float, name: str):
    """The profile of a device `factor` times slower at compute (links unchanged)."""
    return dataclasses.replace(
        hw, name=name, gemm=[(f, r / factor) for f, r in hw.gemm], attention=[(f, r / factor) for f, r in hw.attention],
        fp8_gemm=[], mem_bandwidth=hw.mem_bandwidth / factor, op_overhead_s=hw.op_overhead_s * factor,
        peak_flops=hw.peak_flops / factor, notes=hw.notes + [f"{name}: {factor}x slower than {hw.name} (simulated)"])


def train(config: Path, overrides: list[str], slowdown: float) -> tuple[float, list[float]]:
    """Median step time (s) of a 2-rank run and its per-stage idle fractions."""
    from paratrain.api import launch_ranks, run_rank
    from paratrain.config import load_config
    from paratrain.spec import resolve_run

    cfg = load_config(config, overrides)
    os.environ["PARATRAIN_SIM_SLOWDOWN"] = f"1,{slowdown}"
    try:
        resolve_run(cfg, 2)
        launch_ranks(run_rank, (cfg,), 2)
    finally:
        del os.environ["PARATRAIN_SIM_SLOWDOWN"]
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time_s" in r][3:]  # after warm-up
    return statistics.median(r["step_time_s"] for r in steps), steps[-1].get("pp_bubble_per_stage", [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--calibrate-seconds", type=float, default=0.25, help="per calibration measurement")
    ap.add_argument("--smoke", action="store_true", help="5 steps of a 4-block model, seq 32, 4 sequences, a short "
                    "calibration (seconds; the test suite)")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.layers, a.seq, a.batch, a.calibrate_seconds = 5, 4, 32, 4, 0.02
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.stage_split import balanced_split
    from paratrain.models import preset_args
    from paratrain.commands.plan import main as main_plan
    from paratrain.calibration import calibrate

    from paratrain.api import RANK_MODULES
    from paratrain.distributed.launch import start_rank_server

    start_rank_server(RANK_MODULES)  # the ranks of every launch below (calibration included) fork with the trainer loaded
    tmp = Path(tempfile.mkdtemp(prefix="hetero-bench-"))
    profiles = tmp / "profiles"
    margs = preset_args("shakespeare-char", vocab_size=128, n_layers=a.layers)
    t0 = time.time()
    fast, _ = calibrate("cpu-fast", 2, profiles, seconds=a.calibrate_seconds, model=margs, seq=a.seq,
                        micro_batches=(1, 2))
    (profiles / "cpu-slow.json").write_text(json.dumps(slower(fast, a.slowdown, "cpu-slow").to_json()))
    print(f"calibrated cpu-fast in {time.time() - t0:.0f} s (non-matmul factor eager {fast.modes['eager']:.2f}); "
          f"cpu-slow = cpu-fast / {a.slowdown:g}")
    model_toml = tmp / "model.toml"
    model_toml.write_text(f'[model]\npreset = "shakespeare-char"\nn_layers = {a.layers}\nvocab_size = 128\n')
    argv = ["--model", str(model_toml), "--gpus", "1xcpu-fast,1xcpu-slow", "--gpus-per-node", "1",
            "--profile-dir", str(profiles), "--seq", str(a.seq), "--global-batch-tokens", str(a.seq * a.batch),
            "--checkpointing", "none", "--schedules", "1f1b", "--micro-batches", "1,2", "--out", str(tmp / "plan")]
    print("paratrain plan " + " ".join(argv))
    main_plan(argv)
    plan_cfg = tmp / "plan" / "config.toml"
    from paratrain.config import load_config

    planned = load_config(plan_cfg)
    even = ",".join(map(str, balanced_split(margs, 2)))
    common = [f"training.steps={a.steps}", "training.eval_every=0", "training.eval_sequences=8", "training.device=cpu",
              "sample.max_new_tokens=0", "metrics.progress=none", "metrics.peak_tflops=1",
              "checkpoint.save_final=false", "data.source=tinyshakespeare",
              f"data.dir={tmp / 'data'}", f"run.out_dir={tmp / 'runs'}"]
    results = {}
    for label, split in (("planner's uneven split", planned.parallel.pp_split), ("even split", even)):
        t1 = time.time()
        step, idle = train(plan_cfg, common + [f"run.name={label.split()[0]}", f"parallel.pp_split={split}"],
                           a.slowdown)
        results[label] = (split, step, idle)
        print(f"  trained {label} {split}: median step {step * 1e3:.1f} ms ({time.time() - t1:.0f} s)", flush=True)
    (_, uneven_step, _), (_, even_step, _) = results.values()
    print()
    print(f"| split | blocks per stage (rank 0 fast, rank 1 {a.slowdown:g}x slower) | median step ms | "
          "idle per stage |")
    print("| --- | --- | ---: | --- |")
    for label, (split, step, idle) in results.items():
        print(f"| {label} | {split} | {step * 1e3:.1f} | {', '.join(f'{x:.0%}' for x in idle)} |")
    gain = even_step / uneven_step - 1
    print(f"\nthe uneven split is {gain:+.0%} faster in measured step time (even {even_step * 1e3:.1f} ms, "
          f"uneven {uneven_step * 1e3:.1f} ms); total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
