"""Memory estimator: per-rank memory of a training step, checked against measurement.

    paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --micro-batch 2 --seq-len 4096

Public API:
    estimate(inputs_for(model_args, recipe, target)) -> Estimate   the estimate for any model, Recipe and Target
    estimate_for_run(plan, gpu_bytes=None)        the estimate for a run plan (config + validated Layout)
    Estimate.format_table(), .to_dict(), .total_bytes, .peak_bytes, .compare_line(measured)
"""

from __future__ import annotations

from paratrain.estimate.core import Estimate, EstimateInputs, estimate
from paratrain.estimate.gpus import GPUS, gpu_memory, parse_memory
from paratrain.estimate.inputs import Target, inputs_for
from paratrain.recipe import Recipe

__all__ = ["Estimate", "EstimateInputs", "GPUS", "Target", "inputs_for", "target_device", "estimate", "estimate_for_run", "gpu_memory",
           "parse_memory"]


def estimate_for_run(plan, device: str | None = None, gpu_bytes: int | None = None) -> Estimate:
    """The estimate for the run `paratrain train` is about to start: `plan` carries the config (`cfg`), the layout
    validated against the model and the batch (`layout`, a paratrain.layout.Layout), `model_args`, `global_batch`
    and `accum_steps`.

    device: "cuda" counts the runtime overhead (CUDA context, NCCL) in total_bytes; "cpu" does not. The
    trainer compares `Estimate.peak_bytes` (tensors only) with `observe.sysmetrics.device_peak_bytes()` after the
    first steps. On CUDA, gpu_bytes defaults to the device's total memory, so the table says FITS / DOES NOT FIT.
    """
    cfg, lay = plan.cfg, plan.layout
    if device is None or (gpu_bytes is None and device == "cuda"):
        import torch  # lazy: the cost model is torch-free (estimate, plan, --help); only a run's own device asks it

        if device is None:
            device = "cuda" if torch.cuda.is_available() and cfg.training.device != "cpu" else "cpu"
        if gpu_bytes is None and device == "cuda" and torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    recipe = Recipe.of_run(cfg, lay, plan.global_batch, plan.accum_steps, device)
    target = Target(gpu_bytes=gpu_bytes, overhead_bytes=None if device == "cuda" else 0, device=device)
    inputs = inputs_for(plan.model_args, recipe, target, model_name=plan.model_name)
    return estimate(inputs, suggest=gpu_bytes is not None)


def target_device(training) -> str:
    """The device a run's config (its `[training]` section) is estimated for: the CPU where `training.device` says so,
    else a GPU (estimate, plan and the dry run answer "will it fit on the GPUs")."""
    return "cpu" if training.device == "cpu" else "cuda"
