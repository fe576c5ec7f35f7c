"""Deterministic, layout-independent weight initialisation of a parallelised model.

Each parameter's full value is drawn from a generator seeded by (seed, parameter name), so a model
sharded over any mesh starts from exactly the weights a single process would have. A sharded
parameter (DTensor) draws the full tensor and keeps its own shard; that costs one full parameter of
temporary memory per rank, the price of initial weights that do not depend on the layout.
"""

from __future__ import annotations

import zlib

from torch import nn
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# Prefixes that wrappers (activation checkpointing, torch.compile, DDP) add to parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def initial_value(name: str, shape, std: float | None, seed: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The whole initial value of parameter `name`: normal with `std` from a generator seeded by (seed, name), in
    fp32 (ones in `dtype` for std None)."""
    if std is None:
        return torch.ones(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std_for=None, device: torch.device | None = None) -> None:
    """Fill every parameter of `model` (plain or DTensor, on any device) deterministically.

    `std_for(name)` gives the normal std for a canonical parameter name, or None for ones;
    by default the model's own `param_init_std`. `device`: where the values are drawn (random streams differ by
    device type: parameters offloaded to host memory are drawn on the training device like everyone else's); None:
    each parameter's own.
    """
    std_for = std_for or model.param_init_std  # the model says what each parameter's distribution is
    seen: set[int] = set()
    for raw_name, param in model.named_parameters():
        if id(param) in seen:  # tied weights: initialised once, under their first name
            continue
        seen.add(id(param))
        name = canonical_name(raw_name)
        is_dtensor = isinstance(param, DTensor)
        where = device or (param.device if not is_dtensor else param.to_local().device)
        full_shape = param.shape  # a DTensor reports its global shape
        full = initial_value(name, full_shape, std_for(name), seed, where, param.dtype)
        if is_dtensor:
            # src_data_rank=None: every rank computed the same full tensor, so each just keeps its shard.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(shard)
        else:
            param.copy_(full)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()
