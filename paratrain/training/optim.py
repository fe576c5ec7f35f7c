"""Building the optimizer of `optimizer.name` (paratrain.capabilities.OPTIMIZERS: the table; paratrain/optimizers.py:
its entries) on any layout, the builders of the entries shipped here (AdamW, SGD), and a warmup + cosine
learning-rate schedule (`lr_at`, run by the `WarmupCosine` scheduler object)."""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace

from torch import nn
import torch

from paratrain.capabilities import adamw8bit as eight_bit, optimizer_entry
from paratrain.config import OptimizerConfig
from paratrain.distributed.initialize import canonical_name
from paratrain.errors import ConfigError
from paratrain.modes import resolve_impl
from paratrain.optimizers import HIDDEN_STATE
from paratrain.training import muon, onebit


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); never norm gains. Order follows named_parameters on every layout."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def hidden_param_groups(model: nn.Module, cfg: OptimizerConfig, hidden: frozenset[str]) -> list[dict]:
    """For an entry with a hidden_state: the trainable parameters named in `hidden` (the model family's hidden
    matrices, `Param.hidden_matrix`) first, in a group marked HIDDEN_STATE, then `param_groups`'s two (AdamW's
    decayed matrices, embeddings and output, and the rest undecayed). Order follows named_parameters on every
    layout."""
    mine = [p for name, p in model.named_parameters() if p.requires_grad and canonical_name(name) in hidden]
    if not mine:
        raise ConfigError(f"optimizer.name={cfg.name}: the model has no trainable hidden matrices (attention and MLP "
                          "projections) for it to update: use adamw")
    ids = {id(p) for p in mine}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids], HIDDEN_STATE: False}
            for g in param_groups(model, cfg.weight_decay)]
    return [{"params": mine, "weight_decay": cfg.weight_decay, HIDDEN_STATE: True}, *rest]


def impl_kwargs(cfg: OptimizerConfig, device: torch.device) -> dict:
    impl = resolve_impl(cfg.impl, device.type, "fp32", cfg.name)  # build_optimizer resolved "auto" (the precision)
    return {"fused": dict(fused=True), "foreach": dict(foreach=True), "for": dict(foreach=False)}[impl]


def adamw(cfg: OptimizerConfig, device: torch.device, comm=None, **_):
    return torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl_kwargs(cfg, device))


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose two moments are stored in bf16: each update reads
    them into fp32, updates them there and stores them back, so the state is half AdamW's and the arithmetic AdamW's.
    The step counter is a host tensor (as torch's non-fused AdamW keeps it): no device read."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:  # made now: a checkpoint loads into state that exists
            for p in group["params"]:
                self.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                                 "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                t = state["step"].item()
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - b1)
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                p.mul_(1 - lr * wd)
                p.addcdiv_(m, v.div_(1 - b2 ** t).sqrt_().add_(eps), value=-lr / (1 - b1 ** t))


def adamw_bf16(cfg: OptimizerConfig, device: torch.device, comm=None, **_):
    return BF16AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def eight_bit_adamw(cfg: OptimizerConfig, device: torch.device, comm=None, **_):
    """torchao's 8-bit AdamW (an optional dependency: a one-line error without it; paratrain/capabilities/)."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise ConfigError(eight_bit.MISSING) from None
    return AdamW8bit, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


class SGD(torch.optim.SGD):
    """torch's SGD with its momentum buffers made (zeros) when it is built: fused SGD skipping its first update
    (`found_inf`) would otherwise keep uninitialised buffers, and a checkpoint loads into state that exists (so
    DCP needs no dummy step). The first update is the same: 0.9 x 0 + g is g."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def sgd(cfg: OptimizerConfig, device: torch.device, comm=None, **_):
    return SGD, dict(lr=cfg.lr, momentum=cfg.beta1, **impl_kwargs(cfg, device))


# Each registered optimizer's builder (paratrain/optimizers.py's names; the torch-free registry does not import them).
BUILDERS = {"adamw": adamw, "sgd": sgd, "onebit_adam": onebit.build, "zero_one_adam": onebit.build,
            "adamw-bf16": adamw_bf16, eight_bit.ENTRY.name: eight_bit_adamw, **muon.BUILDERS}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device, zero1_group=None, comm=None,
                    precision: str = "fp32", hidden: frozenset[str] = frozenset(), replica_mesh=None):
    """`optimizer.name`'s optimizer over the model's parameter groups; with `zero1_group` wrapped in ZeRO-1.
    `comm`: the run's GradComm (for optimizers that communicate themselves). For an entry with a hidden_state:
    `hidden`, the canonical names of the hidden matrices (its first group), and `replica_mesh`, the mesh over which
    plain parameters are whole replicas (DDP's data-parallel mesh; None elsewhere)."""
    cfg = replace(cfg, impl=resolve_impl(cfg.impl, device.type, precision, cfg.name))
    entry = optimizer_entry(cfg.name)
    groups = hidden_param_groups(model, cfg, hidden) if entry.hidden_state else param_groups(model, cfg.weight_decay)
    cls, kwargs = BUILDERS[entry.name](cfg, device, comm, precision=precision, adamw=adamw(cfg, device)[1],
                                       replica_mesh=None if zero1_group is not None else replica_mesh)
    if zero1_group is None:
        return cls(groups, **kwargs)
    if entry.hidden_state:  # ZeRO-1 keeps the first group's options as its defaults: the others say theirs
        kwargs[HIDDEN_STATE] = True

    # ZeRO-1: each rank keeps the optimizer state only for its partition of the parameters. After the step each
    # rank broadcasts its partition as one flat bucket (parameters_as_bucket_view), not one broadcast per parameter.
    # (overlap_with_ddp is not used: see docs/layouts.md, "Overlap".)
    # lazy: torch.distributed.optim imports every functional optimizer (~0.5 s per launch), for zero1 runs only
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, process_group=zero1_group,
                                  parameters_as_bucket_view=True, weight_decay=groups[0]["weight_decay"], **kwargs)
    for group in groups[1:]:
        opt.add_param_group(group)
    return opt


def is_zero1(optimizer) -> bool:
    """ZeRO-1's ZeroRedundancyOptimizer (only a zero1 run has imported it)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def inner_optimizer(optimizer):
    """The optimizer that steps and holds this rank's state: ZeRO-1's local one, else the optimizer itself."""
    return optimizer.optim if is_zero1(optimizer) else optimizer


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - 1 - cfg.warmup_steps)  # the last step index is total_steps - 1
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.final_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.final_lr)


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """`lr_at` as a torch scheduler: after construction every param group's lr is `lr_at(0)`; `step()` after each
    optimizer step (skipped or not) moves to the next. `last_epoch` is the optimizer step the next update applies;
    `state_dict()` holds just that (checkpoints save it in trainer.pt, so a resumed run continues bit for bit).
    The schedule's own numbers are the config's, not state."""

    def __init__(self, optimizer, cfg: OptimizerConfig, total_steps: int):
        self.cfg, self.total_steps = cfg, total_steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [lr_at(self.last_epoch, self.cfg, self.total_steps) for _ in self.optimizer.param_groups]

    def step(self, epoch=None) -> None:
        with warnings.catch_warnings():
            # torch warns when the first update was skipped (a non-finite step, an fp16 overflow): expected here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            super().step(epoch)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.jump_to(int(state["last_epoch"]))

    def jump_to(self, step: int) -> None:
        """Continue at optimizer step `step` (resume, rollback): set every param group's lr to `lr_at(step)`."""
        self.last_epoch = step
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The learning rate of the next update (a host float: never a device read; torchao's optimizers keep their
        learning rates as host tensors, which torch's scheduler reports as they are)."""
        return float(self._last_lr[0])
