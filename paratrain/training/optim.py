"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); never norm gains. Order follows named_parameters on every layout."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _impl_kwargs(cfg: OptimizerConfig, device: torch.device) -> dict:
    impl = cfg.impl
    if impl == "auto":
        # fused kernels exist for CUDA (and recent CPU builds) but not for every DTensor layout; foreach is safe.
        impl = "fused" if device.type == "cuda" else "foreach"
    return {"fused": dict(fused=True), "foreach": dict(foreach=True), "for": dict(foreach=False)}[impl]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device, zero1_group=None):
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **_impl_kwargs(cfg, device))
    if zero1_group is None:
        return torch.optim.AdamW(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # ZeRO-1: each rank keeps Adam moments only for its partition of the parameters. After the step each rank
    # broadcasts its partition as one flat bucket (parameters_as_bucket_view), not one broadcast per parameter.
    # (overlap_with_ddp is not used: see README "Communication".)
    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, process_group=zero1_group,
                                  parameters_as_bucket_view=True, weight_decay=groups[0]["weight_decay"], **kwargs)
    opt.add_param_group(groups[1])
    return opt


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - 1 - cfg.warmup_steps)  # the last step index is total_steps - 1
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.final_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.final_lr)
