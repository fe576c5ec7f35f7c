"""Validation loss: one fixed set of `training.eval_sequences` sequences for every layout, split over the
data-parallel ranks.

Sequence i of the set is a pure function of (seed, i) (`TokenData.eval_sequences`), never of the global batch, so
one checkpoint scores the same on 1 process and on any layout. Each data-parallel rank evaluates a contiguous share;
when the count does not divide by dp the last shares are padded to the same length (every rank runs the same
forwards, which FSDP, expert and pipeline parallelism need) and the padding rows are left out of the sum. The loss is
the sum of every target's loss over dp x cp (float64), divided by the number of targets (every token, or those a loss
mask keeps): the mean over the set.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def eval_share(sequences: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """(first, length, real) of a data-parallel rank's share of the set: `length` rows from `first`, the same on every
    rank, of which the first `real` are in the set (the rest is padding)."""
    length = -(-sequences // dp)
    first = dp_rank * length
    return first, length, max(0, min(length, sequences - first))


class Evaluator:
    def __init__(self, val_data, train_step, spec, dp_rank: int, group):
        """`group`: the ranks whose loss sums add up to the whole set's (data-parallel x context-parallel)."""
        self.val_data, self.train_step, self.spec = val_data, train_step, spec
        self.dp_rank, self.group = dp_rank, group
        self._targets = None

    @torch.no_grad()
    def __call__(self, micro_batch: int) -> float:
        spec, cfg = self.spec, self.spec.cfg.training
        first, length, real = eval_share(cfg.eval_sequences, spec.layout.dp, self.dp_rank)
        size = min(length, self.train_step.eval_chunk(micro_batch, spec.global_batch // spec.layout.dp))
        model = self.train_step.model
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.train_step.device)
        for start in range(0, length, size):  # read chunk by chunk: the set may be large
            batch = self.val_data.eval_sequences(first + start, min(size, length - start), seed=cfg.seed)
            rows = min(size, max(0, real - start))  # the chunk's rows in the set; forwards of padding count nothing
            total += self.train_step.eval_loss_sum(batch, rows)
        model.train()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return total.item() / self.targets  # evaluation steps are log steps

    @property
    def targets(self) -> int:
        """The target positions of the whole set (every position, or those a loss mask keeps)."""
        if self._targets is None:
            self._targets = self.val_data.eval_targets(self.spec.cfg.training.eval_sequences,
                                                       self.spec.cfg.training.seed)
        return self._targets
