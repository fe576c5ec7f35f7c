"""Global gradient-norm clipping for any mix of plain and DTensor (sharded or replicated) parameters.

torch's clip_grad_norm_ needs all gradients to be one kind; tensor parallelism without sequence
parallelism leaves the norm gains as plain (replicated) tensors beside sharded DTensors, and expert
parallelism puts the expert weights on a different mesh from the rest (DTensor ops never mix meshes),
so the norm is taken per mesh and the squares summed. Under pipeline parallelism each rank holds
only its stages' parameters: the squares are also summed over the pipeline group (`pp_group`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, pp_group=None, replica_group=None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (inf: measure only). Returns the norm, a device
    tensor (never read on the host here). `replica_group`: ranks whose gradients differ (each kept its own, as 1-bit
    Adam does after its warm-up): the norm is the root mean square of theirs, the same on every rank (a non-finite
    gradient anywhere makes it non-finite everywhere, so every rank skips that update), and clips each alike."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    by_mesh: dict = {}
    for g in sharded:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    squares = []
    for group in by_mesh.values():
        # One foreach norm per mesh, then full_tensor() reduces the partial norms across that mesh.
        squares.append(torch.nn.utils.get_total_norm(group, foreach=True).full_tensor().float() ** 2)
    if plain:
        squares.append(torch.nn.utils.get_total_norm(plain, foreach=True).float() ** 2)
    if not squares and pp_group is None:
        return torch.zeros(())
    total = torch.stack([s.reshape(()).to(squares[0].device) for s in squares]).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)  # every stage's squares: the norm of the whole model
    if replica_group is not None:
        dist.all_reduce(total, group=replica_group)
        total = total / dist.get_world_size(replica_group)
    total = total.sqrt()
    if math.isfinite(max_norm):
        # The scale stays on the device (no host read): max_norm / (norm + 1e-6) in float64, as the Python float it
        # used to be, and 1 where it would not shrink (also for a NaN norm: x * 1.0 is x, bit for bit).
        coef = max_norm / (total.double() + 1e-6)
        coef = torch.where(coef < 1.0, coef, torch.ones_like(coef)).float()
        for group in (*by_mesh.values(), plain):
            if group:
                torch._foreach_mul_(group, coef.to(group[0].device))
    return total
