"""Memory estimator: per-rank memory of a training step, checked against measurement.

    paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --micro-batch 2 --seq-len 4096

Public API:
    estimate(EstimateInputs) -> Estimate          the estimate for any model/layout/precision/batch
    estimate_for_run(plan, gpu_bytes=None)        the estimate for a run plan (config + validated Layout)
    device_peak_bytes(device)                     the measured peak on the trainer's device
    Estimate.format_table(), .to_dict(), .total_bytes, .peak_bytes, .compare_line(measured)
"""

from __future__ import annotations

from paratrain.estimate.core import Estimate, EstimateInputs, estimate
from paratrain.estimate.gpus import GPUS, gpu_memory, parse_memory

__all__ = ["Estimate", "EstimateInputs", "GPUS", "device_peak_bytes", "estimate", "estimate_for_run", "gpu_memory",
           "main_estimate", "parse_memory"]


def main_estimate(argv: list[str]) -> int:
    from paratrain.estimate.cli import main_estimate as main

    return main(argv)


def estimate_for_run(plan, device: str | None = None, gpu_bytes: int | None = None) -> Estimate:
    """The estimate for the run `paratrain train` is about to start: `plan` carries the config (`cfg`), the layout
    validated against the model and the batch (`layout`, a paratrain.layout.Layout), `model_args`, `global_batch`
    and `accum_steps`.

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
    t, ac = cfg.training, cfg.activation_checkpoint
    from paratrain.layout import Batch

    # A pipeline cuts each data-parallel rank's batch into the layout's microbatches (no accumulation loop).
    micro = lay.forward_batch(Batch(plan.global_batch, t.micro_batch, t.seq_len))
    impl = cfg.optimizer.impl
    if impl == "auto":
        impl = "fused" if device == "cuda" else "foreach"  # as paratrain.training.optim.impl_kwargs
    from paratrain.estimate.compression import Compression

    inputs = EstimateInputs(plan.model_args, lay, model_name=plan.model_name, precision=t.precision,
                            compression=Compression.from_config(cfg.parallel),
                            fsdp_backward_prefetch=cfg.parallel.fsdp_backward_prefetch,
                            optimizer=cfg.optimizer.name, optimizer_impl=impl, checkpointing=ac.mode, every_k=ac.every_k,
                            micro_batch=micro, seq_len=t.seq_len, accum_steps=plan.accum_steps, gpu_name=None,
                            gpu_bytes=gpu_bytes, overhead_bytes=None if device == "cuda" else 0, device=device)
    return estimate(inputs, suggest=gpu_bytes is not None)


def device_peak_bytes(device=None) -> int:
    """Peak bytes allocated on the trainer's device: torch.cuda.max_memory_allocated on CUDA (call
    torch.cuda.reset_peak_memory_stats() first to measure a window); on CPU the process's peak RSS."""
    from paratrain.estimate.measure import device_peak_bytes as peak

    return peak(device)
