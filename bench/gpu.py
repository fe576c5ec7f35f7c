"""One GPU, one table: measured MFU against the planner's prediction, the memory estimate against the allocator,
and a calibration at the model's own shapes.

On a single CUDA GPU (about 6-8 minutes on an H100/H200):
1. MFU of Llama 3.2 1B and 3B (the presets, vocabulary 128,256) in bf16, eager and with torch.compile: the trainer's
   own step (`build_train_step`, fused AdamW, selective checkpointing where the estimator
   says it is needed to fit) on random tokens, median step after warm-up; MFU = flops_per_token x tokens/s / the
   datasheet peak (paratrain.observe.flops). Beside it the cost model's prediction for the same configuration with
   the GPU's datasheet profile (estimate/hardware.py's efficiency model) and with the profile calibrated in step 3.
2. The memory estimate (tensors at the peak, `paratrain estimate`'s figure without the CUDA/NCCL overhead) against
   torch.cuda.max_memory_allocated and max_memory_reserved of the same step, for 11 configurations (1B model:
   checkpointing none / selective / full, micro-batch and sequence length, fp32, accumulation, compile; the memory
   tiers: chunked loss, activation offloading (its host copies are not device memory), bf16 optimizer states).
3. `paratrain plan --calibrate --model llama3.2-1b` (one rank): GEMMs, float8 GEMMs, attention and a block per
   execution mode at the model's shapes, saved as a profile the planner uses.

    python bench/gpu.py                   # CUDA
    python bench/gpu.py --device cpu      # the same code on tiny models, on a CPU (the test suite runs it)
    python bench/gpu.py --smoke           # a shorter CPU check: one tiny model, 2 memory rows
    python bench/gpu.py --json out.json

On a CPU the models are tiny stand-ins (the same code paths), MFU is against a measured matmul peak, the compile rows
use dynamo's "aot_eager" backend (the compile path without inductor's code generation, which takes minutes per model
on a CPU), and "allocated" is the tracked peak of live tensor bytes (no caching allocator, so no "reserved").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_measure (bench/)

from paratrain.modes import Precision, resolve_impl  # noqa: E402 (after the path)

GPU_VOCAB = 128256
# (label, preset, overrides) -- CPU stand-ins keep the models' proportions at a tiny size
CUDA_MODELS = [("llama3.2-1b", "llama3.2-1b", {}), ("llama3.2-3b", "llama3.2-3b", {})]
CPU_MODELS = [("tiny 1b-shaped", "llama3.2-1b", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                     ffn_hidden=256, max_seq_len=256, vocab_size=256)),
              ("tiny 3b-shaped", "llama3.2-3b", dict(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16,
                                                     ffn_hidden=256, max_seq_len=256, vocab_size=256))]


def model_args(preset: str, overrides: dict, vocab: int):
    from paratrain.models import preset_args

    over = {k: v for k, v in overrides.items() if k != "vocab_size"}
    args = preset_args(preset, vocab_size=vocab, **over)  # (a preset's own vocabulary wins over `vocab`)
    return dataclasses.replace(args, vocab_size=overrides["vocab_size"]) if "vocab_size" in overrides else args


def fitting_config(args, seq: int, device: str, gpu_bytes: int | None, precision: str) -> tuple[int, str]:
    """(micro-batch, checkpointing) for one GPU: the largest micro-batch up to 8 that the estimator says fits with
    the headroom rule estimate and plan share (estimate.gpus), without checkpointing if possible, else selective, else
    full."""
    from paratrain.estimate import Target, estimate, inputs_for
    from paratrain.layout import Layout
    from paratrain.modes import CheckpointMode
    from paratrain.recipe import Recipe

    if gpu_bytes is None:
        return 2, "none"
    for ac in sorted((m for m in CheckpointMode if m.uniform), key=lambda m: m.recompute_rank):
        for mb in (8, 4, 2, 1):
            recipe = Recipe(Layout.resolve(1), precision=precision, checkpointing=ac, micro_batch=mb,
                            seq_len=seq).replace(loss_chunks=0)  # (0: the trainer's automatic choice)
            est = estimate(inputs_for(args, recipe, Target(device=device, gpu_bytes=gpu_bytes)), suggest=False)
            if est.fits:
                return mb, ac
    return 1, "full"


# The MFU rows' execution modes: (compiled, precision on CUDA, [float8] recipe, CUDA graphs). On a CPU the bf16 rows
# run fp32 and the fp8 rows emulate float8 (fp32 around it): the same code paths, not the speed.
MODES = {"eager": (False, "bf16", "tensorwise", False), "compile": (True, "bf16", "tensorwise", False),
         "fp8": (False, "fp8", "tensorwise", False), "fp8-rowwise": (False, "fp8", "rowwise", False),
         "compile+fp8": (True, "fp8", "tensorwise", False), "cuda_graphs": (True, "bf16", "tensorwise", True)}
CUDA_MODES, CPU_MODES, SMOKE_MODES = ",".join(MODES), "eager,compile,fp8,compile+fp8", "eager,fp8"


def mode_precision(mode: str, cuda: bool) -> str:
    precision = MODES[mode][1]
    return precision if cuda or Precision(precision).fp8_matmuls else "fp32"


def train_rate(args, seq: int, mb: int, ac: str, mode: str, device, steps: int, warmup: int) -> dict:
    """The trainer's step on one device in one of MODES; median step time after warm-up."""
    import torch

    from paratrain.capabilities.float8 import Float8
    from paratrain.config import OptimizerConfig
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.layout import Layout
    from paratrain.recipe import Recipe
    from paratrain.training.step import StepOptions, build_train_step

    cuda = device.type == "cuda"
    compiled, _, scales, graphs = MODES[mode]
    precision = mode_precision(mode, cuda)
    float8 = (Float8(recipe=scales, compute="bf16" if cuda else "fp32"),) if Precision(precision).fp8_matmuls else ()
    layout = Layout.resolve(1)
    recipe = Recipe(layout, precision=precision, checkpointing=ac, capabilities=float8, cuda_graphs=graphs,
                    compile=(True if cuda else "aot_eager") if compiled else False)
    step = build_train_step(args, ParallelDims(layout), recipe, device,
                            StepOptions(optimizer=OptimizerConfig(impl="auto")))  # (fused on CUDA: resolve_impl)
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    first = None
    for i in range(warmup + steps):
        micro = [tuple(torch.randint(0, args.vocab_size, (mb, seq), device=device, generator=gen) for _ in range(2))]
        t0 = time.perf_counter()
        step.forward_backward(micro)
        step.clip()
        step.update(finite=True)
        step.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        if i >= warmup:
            times.append(dt)
    del step
    if cuda:
        torch.cuda.empty_cache()
    s = statistics.median(times)
    return {"step_s": s, "tokens_per_s": mb * seq / s, "first_step_s": first}


def predicted_mfu(args, seq: int, mb: int, ac: str, mode: str, hw) -> float | None:
    from paratrain.layout import Layout
    from paratrain.estimate.step_time import Context, planned_run, predict
    if hw is None or (Precision(MODES[mode][1]).fp8_matmuls and not hw.fp8_gemm):
        return None
    precision = MODES[mode][1] if hw.device == "cuda" else hw.precision
    ctx = Context(args, planned_run(hw, precision=precision, seq_len=seq, compile=MODES[mode][0]), mb, hw, 1, "bench")
    return predict(ctx.candidate(Layout.resolve(1), checkpointing=ac, micro_batch=mb), ctx).mfu


def memory_specs(args, cuda: bool) -> list[tuple[str, object, bool | str]]:
    """(label, MeasureSpec, compile) for the estimator-vs-allocator rows."""
    from memory_measure import MeasureSpec  # bench/memory_measure.py

    model = {k: v for k, v in dataclasses.asdict(args).items()}
    seq = 2048 if cuda else 64
    low = "bf16" if cuda else "fp32"
    rows = [("none, mb 1", dict(micro_batch=1, seq_len=seq, precision=low)),
            ("none, mb 2", dict(micro_batch=2, seq_len=seq, precision=low)),
            ("selective, mb 2", dict(micro_batch=2, seq_len=seq, precision=low, checkpointing="selective")),
            ("full, mb 4", dict(micro_batch=4, seq_len=seq, precision=low, checkpointing="full")),
            ("every_k, mb 2", dict(micro_batch=2, seq_len=seq, precision=low, checkpointing="every_k")),
            ("none, mb 1, seq x2", dict(micro_batch=1, seq_len=2 * seq, precision=low)),
            ("fp32, full, mb 1", dict(micro_batch=1, seq_len=seq, precision="fp32", checkpointing="full")),
            ("accumulation 2, selective", dict(micro_batch=1, seq_len=seq, precision=low, checkpointing="selective",
                                               accum_steps=2)),
            # the memory tiers (docs/memory-tiers.md); CPU offload needs FSDP over several ranks, not one GPU
            ("chunked loss, mb 2", dict(micro_batch=2, seq_len=seq, precision=low, loss_chunks=8)),
            ("activation offload, mb 2", dict(micro_batch=2, seq_len=seq, precision=low, activation_offload="all")),
            ("bf16 optimizer states, mb 2", dict(micro_batch=2, seq_len=seq, precision=low, optimizer="adamw-bf16"))]
    device = "cuda" if cuda else "cpu"
    return [(label, MeasureSpec.of(model, name=label, optimizer_impl=resolve_impl("auto", device, kw["precision"]),
                                   **kw), False)
            for label, kw in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=None, help="measured steps per MFU row (default 8 CUDA, 2 CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3 CUDA, 1 CPU)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length of the MFU rows (default 2048 / 64)")
    ap.add_argument("--modes", default=None, help=f"execution modes of the MFU rows, of {', '.join(MODES)} (default: "
                    f"all on CUDA, {CPU_MODES} on a CPU)")
    ap.add_argument("--skip-calibrate", action="store_true")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--smoke", action="store_true", help="on the CPU: the first tiny model eager (1 step), 2 memory "
                    "rows, no calibration (seconds; the test suite)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device, a.modes, a.steps, a.warmup = "cpu", SMOKE_MODES, a.steps or 1, 0 if a.warmup is None else a.warmup
        a.skip_calibrate = True  # (the calibration launches a rank: `--device cpu` and tests/test_planfid.py run it)
    import torch

    from paratrain.estimate import estimate
    from paratrain.estimate.gpus import gpu_from_device_name
    from memory_measure import device_step_peaks, inputs_for_spec
    from paratrain.models.presets import flops_per_token
    from paratrain.observe.flops import peak_flops
    from paratrain.calibration import calibrate
    from paratrain.estimate.hardware import gpu_profile

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for the CPU check)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    steps, warmup = a.steps or (8 if cuda else 2), a.warmup if a.warmup is not None else (3 if cuda else 1)
    seq = a.seq or (2048 if cuda else 64)
    models = (CUDA_MODELS if cuda else CPU_MODELS)[:1 if a.smoke else None]
    vocab = GPU_VOCAB if cuda else 256
    peak, peak_source = peak_flops(device, 0.0, "bf16", False)  # bf16's (a CPU's: measured); fp8 rows: the FP8 peak
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if cuda else None
    table_name = gpu_from_device_name(name, gpu_bytes) if cuda else None
    datasheet = None
    if table_name:
        try:
            datasheet = gpu_profile(table_name)
        except Exception:  # a GPU without planner data: no datasheet prediction column
            datasheet = None
    started = time.time()
    print(f"{name}: peak {peak / 1e12:.1f} TFLOP/s ({peak_source}); planner profile "
          f"{table_name or 'none'}; torch {torch.__version__}", flush=True)
    rows, report = [], {"device": name, "peak_flops": peak, "mfu": [], "memory": [], "calibration": None}

    # 3 first on CUDA would hold the GPU in a child process; measure MFU and memory in this process, then calibrate.
    modes = [m.strip() for m in (a.modes or (CUDA_MODES if cuda else CPU_MODES)).split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES or (MODES[m][3] and not cuda)]
    if unknown:
        print(f"error: --modes {','.join(unknown)}: not one of {', '.join(MODES)} (cuda_graphs: CUDA only)",
              file=sys.stderr)
        return 2
    for label, preset, over in models:
        args = model_args(preset, over, vocab)
        mb, ac = fitting_config(args, seq, "cuda" if cuda else "cpu", gpu_bytes, "bf16" if cuda else "fp32")
        for mode in modes:
            r = train_rate(args, seq, mb, ac, mode, device, steps, warmup)
            precision = mode_precision(mode, cuda)
            mode_peak = peak_flops(device, 0.0, precision, False)[0] if cuda else peak
            mfu = flops_per_token(args, seq) * r["tokens_per_s"] / mode_peak
            pred = predicted_mfu(args, seq, mb, ac, mode, datasheet)
            entry = {"model": label, "mode": mode, "micro_batch": mb, "seq": seq, "checkpointing": ac, **r,
                     "precision": precision, "peak_flops": mode_peak,
                     "mfu": mfu, "predicted_mfu_datasheet": pred, "args": dataclasses.asdict(args)}
            report["mfu"].append(entry)
            print(f"  MFU {label} {mode}: {mfu:.1%} ({r['tokens_per_s']:,.0f} tokens/s, mb {mb}, {ac}; first step "
                  f"{r['first_step_s']:.1f} s)", flush=True)

    mem_args = model_args(models[0][1], models[0][2], vocab)
    for label, spec, comp in memory_specs(mem_args, cuda)[:2 if a.smoke else None]:
        measured = device_step_peaks(spec, device, comp)
        inputs = inputs_for_spec(spec, 1).with_target(
            device=a.device, overhead_bytes=0)
        est = estimate(inputs, suggest=False)
        report["memory"].append({"config": label, "estimate": est.peak_bytes, **measured, "phase": est.phase})
        print(f"  memory {label}: estimate {est.peak_bytes / 2**30:.3f} GiB, allocated "
              f"{measured['allocated'] / 2**30:.3f} GiB", flush=True)

    calibrated = None
    if not a.skip_calibrate:
        t0 = time.time()
        prof_dir = Path(tempfile.mkdtemp(prefix="gpu-bench-profiles-"))
        calibrated, path = calibrate("bench-gpu" if cuda else "bench-cpu", 1, prof_dir, seconds=0.2 if cuda else 0.02,
                                     model=mem_args, seq=seq, micro_batches=(1, 2),
                                     modes=tuple(modes) if cuda else ("eager",))
        report["calibration"] = {"profile": str(path), "seconds": time.time() - t0, **calibrated.to_json()}
        print(f"  calibrated in {time.time() - t0:.0f} s: {path}", flush=True)
        for entry in report["mfu"]:
            args = model_args(*[(p, o) for lab, p, o in models if lab == entry["model"]][0], vocab)
            entry["predicted_mfu_calibrated"] = predicted_mfu(args, seq, entry["micro_batch"], entry["checkpointing"],
                                                              entry["mode"], calibrated)

    # the one table
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    unit, scale = ("GiB", 2**30) if cuda else ("MiB", 2**20)

    def gib(x):
        return "-" if x is None else f"{x / scale:.3f}"

    print()
    print(f"| measurement | configuration | measured | paratrain's figure | error | second figure |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for e in report["mfu"]:
        p, q = e["predicted_mfu_datasheet"], e.get("predicted_mfu_calibrated")
        err = f"{(p - e['mfu']) / e['mfu']:+.0%}" if p is not None else "-"
        print(f"| MFU {e['model']} {e['mode']} | {e['precision']}, mb {e['micro_batch']} x seq {e['seq']}, "
              f"{e['checkpointing']} "
              f"checkpointing; {e['tokens_per_s']:,.0f} tokens/s | {pct(e['mfu'])} | {pct(p)} (datasheet profile) | "
              f"{err} | {pct(q)} (calibrated profile) |")
    for m in report["memory"]:
        err = (m["estimate"] - m["allocated"]) / m["allocated"]
        second = f"{gib(m['reserved'])} {unit} reserved" if m["reserved"] is not None else "-"
        print(f"| memory, {mem_args.n_layers}-block model | {m['config']} | {gib(m['allocated'])} {unit} allocated | "
              f"{gib(m['estimate'])} {unit} estimated | {err:+.1%} | {second} |")
    if report["calibration"]:
        c = report["calibration"]
        modes_txt = ", ".join(f"{k} {v:.2f}" for k, v in c["modes"].items())
        print(f"| plan --calibrate | {mem_args.n_layers} blocks, seq {seq} | {len(c['gemm'])} GEMM points, "
              f"{len(c['attention'])} attention, {len(c['fp8_gemm'])} fp8 | non-matmul factor {modes_txt} | - | "
              f"compute scale {c['compute_scale']:.2f} |")
    total = time.time() - started
    print(f"\n{name}; total {total:.0f} s")
    report["seconds"] = total
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
