"""Memory estimator: per-rank memory of a training step, checked against measurement.

    paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --micro-batch 2 --seq-len 4096

Public API:
    estimate(EstimateInputs) -> Estimate          the estimate for any model/layout/precision/batch
    estimate_for_run(plan, gpu_bytes=None)        the estimate for a `paratrain.train.RunPlan`
    device_peak_bytes(device)                     the measured peak on the trainer's device
    Estimate.format_table(), .to_dict(), .total_bytes, .peak_bytes, .compare_line(measured)
"""

from __future__ import annotations

from paratrain.estimate.core import Estimate, EstimateInputs, estimate
from paratrain.estimate.gpus import GPUS, gpu_memory, parse_memory
from paratrain.estimate.layout import Layout, resolve_layout

__all__ = ["Estimate", "EstimateInputs", "GPUS", "Layout", "device_peak_bytes", "estimate", "estimate_for_run",
           "gpu_memory", "main_estimate", "parse_memory", "resolve_layout"]


def main_estimate(argv: list[str]) -> int:
    from paratrain.estimate.cli import main_estimate as main

    return main(argv)


def estimate_for_run(plan, device: str | None = None, gpu_bytes: int | None = None) -> Estimate:
    """The estimate for the layout `paratrain train` is about to run (`plan` is a paratrain.train.RunPlan).

    device: "cuda" counts the runtime overhead (CUDA context, NCCL) in total_bytes; "cpu" does not. The
    trainer compares `Estimate.peak_bytes` (tensors only) with `device_peak_bytes()` after the first steps.
    On CUDA, gpu_bytes defaults to the device's total memory, so the table says FITS / DOES NOT FIT.
    """
    import torch

    cfg, lay = plan.cfg, plan.layout
    if device is None:
        device = "cuda" if torch.cuda.is_available() and cfg.training.device != "cpu" else "cpu"
    if gpu_bytes is None and device == "cuda" and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    t = cfg.training
    micro, pipe = t.micro_batch, {}
    if lay.pp > 1:
        pipe = dict(pp_schedule=lay.pp_schedule, microbatches=lay.pp_microbatches, pp_virtual=lay.pp_virtual,
                    pp_split=tuple(lay.pp_split))
        micro = max(1, plan.global_batch // lay.dp // lay.pp_microbatches)
    layout = resolve_layout(world_size=lay.world_size, dp_mode=lay.dp_mode, dp_replicate=lay.dp_replicate,
                            dp_shard=lay.dp_shard, tp=lay.tp, pp=lay.pp, ep=lay.ep,
                            sequence_parallel=lay.sequence_parallel, loss_parallel=lay.loss_parallel, **pipe)
    impl = cfg.optimizer.impl
    if impl == "auto":
        impl = "fused" if device == "cuda" else "foreach"  # as paratrain.training.optim._impl_kwargs
    inputs = EstimateInputs(plan.model_args, layout, model_name=cfg.model.preset, precision=t.precision,
                            optimizer="adamw", optimizer_impl=impl, checkpointing=cfg.activation_checkpoint.mode,
                            every_k=cfg.activation_checkpoint.every_k, micro_batch=micro, seq_len=t.seq_len,
                            accum_steps=plan.accum_steps, gpu_name=None, gpu_bytes=gpu_bytes,
                            overhead_bytes=None if device == "cuda" else 0, device=device)
    return estimate(inputs, suggest=gpu_bytes is not None)


def device_peak_bytes(device=None) -> int:
    """Peak bytes allocated on the trainer's device: torch.cuda.max_memory_allocated on CUDA (call
    torch.cuda.reset_peak_memory_stats() first to measure a window); on CPU the process's peak RSS."""
    from paratrain.estimate.measure import device_peak_bytes as peak

    return peak(device)
