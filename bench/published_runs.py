"""The planner's datasheet profiles against published runs: same model, GPUs, layout, sequence and batch.

Predictions come from the cost model (paratrain/estimate/step_time.py) with the datasheet profile of the GPU
(estimate/hardware.py's efficiency model); nothing is run. "fitted" marks the rows the efficiency constants were
fitted to (their sources are in estimate/hardware.py); the others check them. torchtitan's H100 runs used 500 W H100s
whose peak its footnote puts between the SXM's and the NVL's: those rows are compared after x 989/912 (the
midpoint), i.e. as what a 700 W H100 SXM would do.

    python bench/published_runs.py
    python bench/published_runs.py --smoke    # the first two rows (the test suite)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100_500W = 989 / 912
TT_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_A100 = "torchtitan docs/performance.md"

# (model, gpu, GPUs, seq, global batch (sequences), layout kwargs, checkpointing, micro-batch, mode, float8,
#  published tokens/s/GPU, factor applied to it, source, fitted)
ROWS = [
    ("llama3.1-8b", "H100", 8, 8192, 16, dict(dp_mode="fsdp"), "selective", 2, "eager", False, 5762, H100_500W,
     TT_H100 + " table 1", True),
    ("llama3.1-8b", "H100", 8, 8192, 16, dict(dp_mode="fsdp"), "selective", 2, "compile", False, 6667, H100_500W,
     TT_H100 + " table 1", True),
    ("llama3.1-8b", "H100", 8, 8192, 16, dict(dp_mode="fsdp"), "selective", 2, "compile", True, 8532, H100_500W,
     TT_H100 + " table 1", True),
    ("llama3.1-8b", "H100", 128, 8192, 256, dict(dp_mode="fsdp"), "selective", 2, "eager", False, 5605, H100_500W,
     TT_H100 + " table 3", False),
    ("llama3.1-8b", "H100", 128, 8192, 256, dict(dp_mode="fsdp"), "selective", 2, "compile", False, 6514, H100_500W,
     TT_H100 + " table 3", False),
    ("llama3.1-8b", "H100", 128, 8192, 256, dict(dp_mode="fsdp"), "selective", 2, "compile", True, 8380, H100_500W,
     TT_H100 + " table 3", False),
    ("llama3.1-70b", "H100", 256, 8192, 512, dict(dp_mode="fsdp", tp=8), "full", 16, "compile", True, 829, H100_500W,
     TT_H100 + " table 4 (2D, no async TP)", False),
    ("llama3.1-405b", "H100", 512, 8192, 256,
     dict(dp_mode="fsdp", tp=8, pp=8, pp_schedule="1f1b", pp_microbatches=32), "full", 1, "compile", True, 100,
     H100_500W, TT_H100 + " table 5 (1F1B; async TP)", False),
    ("llama3.1-405b", "H100", 512, 8192, 256,
     dict(dp_mode="fsdp", tp=8, pp=8, pp_schedule="interleaved_1f1b", pp_microbatches=32), "full", 1, "compile", True,
     128, H100_500W, TT_H100 + " table 5 (interleaved 1F1B; async TP)", False),
    ("llama3-8b", "A100-80GB", 64, 8192, 64, dict(dp_mode="fsdp"), "selective", 1, "eager", False, 2973, 1.0,
     TT_A100 + " (Llama 3, selective op)", True),
    ("llama3-70b", "A100-80GB", 64, 8192, 64, dict(dp_mode="fsdp"), "full", 1, "eager", False, 331, 1.0,
     TT_A100 + " (Llama 3, full)", True),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the first two rows only (seconds; the test suite)")
    a = ap.parse_args(argv)
    from paratrain.layout import Layout
    from paratrain.models import preset_args
    from paratrain.estimate.step_time import Context, planned_run, predict
    from paratrain.estimate.hardware import gpu_profile

    print("| model | GPUs | layout | checkpointing, micro-batch | mode | published tokens/s/GPU (x factor) | "
          "predicted | ratio | source |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |")
    for (model, gpu, world, seq, seqs, lay_kw, ac, mb, mode, f8, published, factor, source, fitted) in (
            ROWS[:2] if a.smoke else ROWS):
        hw = gpu_profile(gpu)
        args = preset_args(model, vocab_size=128256)
        lay = Layout.resolve(world, **lay_kw)
        run = planned_run(hw, precision="fp8" if f8 else "bf16", seq_len=seq, compile=mode == "compile")
        ctx = Context(args, run, seqs, hw, 8, model)
        pred = predict(ctx.candidate(lay, checkpointing=ac, micro_batch=mb), ctx)
        tps = pred.tokens_per_s / world
        target = published * factor
        print(f"| {model} | {world} x {hw.name} | {lay.short_name()} | {ac}, {mb} | {mode}{' + float8' if f8 else ''} "
              f"| {published:,} ({target:,.0f}) | {tps:,.0f} | {tps / target:.2f} | {source}"
              f"{' (fitted)' if fitted else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
