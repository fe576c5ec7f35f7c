"""Global gradient-norm clipping for any mix of plain and DTensor (sharded or replicated) parameters.

torch's clip_grad_norm_ needs all gradients to be one kind; tensor parallelism without sequence
parallelism leaves the norm gains as plain (replicated) tensors beside sharded DTensors.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (inf: measure only). Returns the norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    if sharded:
        # One foreach norm, then full_tensor() reduces the partial norms across the mesh.
        squares.append(torch.nn.utils.get_total_norm(sharded, foreach=True).full_tensor().float() ** 2)
    if plain:
        squares.append(torch.nn.utils.get_total_norm(plain, foreach=True).float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack([s.reshape(()).to(squares[0].device) for s in squares]).sum().sqrt()
    if math.isfinite(max_norm):
        coef = max_norm / (total.item() + 1e-6)
        if coef < 1.0:
            for group in (sharded, plain):
                if group:
                    torch._foreach_mul_(group, coef)
    return total
