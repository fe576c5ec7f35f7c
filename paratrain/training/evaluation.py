"""Validation loss: the same held-out batches for every layout, each data-parallel rank evaluating its slice."""

from __future__ import annotations

import torch
import torch.distributed as dist


def dp_mean(value: torch.Tensor, group) -> float:
    """The mean of a scalar over the data-parallel ranks (gloo has no AVG: sum, then divide)."""
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


class Evaluator:
    def __init__(self, val_data, step, spec, dp_rank: int, group):
        """`group`: the ranks the loss is averaged over (data-parallel x context-parallel)."""
        self.val_data, self.step, self.spec = val_data, step, spec
        self.dp_rank, self.group = dp_rank, group

    @torch.no_grad()
    def __call__(self, micro_batch: int) -> float:
        spec, cfg = self.spec, self.spec.cfg.training
        model = self.step.model
        model.eval()
        total = torch.zeros((), device=self.step.device)
        batches = self.val_data.eval_batches(cfg.eval_batches, spec.global_batch, seed=cfg.seed)
        per_rank = spec.global_batch // spec.layout.dp
        rows = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)  # this rank's sequences
        size = self.step.eval_chunk(micro_batch, per_rank)
        for x, y in batches:
            for xs, ys in zip(x[rows].split(size), y[rows].split(size)):
                total += self.step.eval_loss(xs, ys) * xs.shape[0] / per_rank
        model.train()
        return dp_mean(total / len(batches), self.group)
