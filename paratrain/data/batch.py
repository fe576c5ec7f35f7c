"""What a batch of windows is: token ids and targets, plus what packing and loss masks add."""

from __future__ import annotations

import torch

NOT_A_TARGET = -100  # a target that counts nothing (cross-entropy's ignore_index; transformers' label -100)


class Batch(tuple):
    """(inputs, targets), both (B, T) int64, unpacked as a pair. Targets are NOT_A_TARGET where nothing is learnt
    (outside the loss mask, a document's first token under packing, padding).

    `positions` (B, T): each token's position in its document, restarting at 0 where a document starts (windows of
    whole documents: attention stays inside a document); None: positions 0..T-1 and causal attention over the window.
    `target_count`: the target positions of the whole global batch this batch belongs to, by which every rank divides
    its summed loss (so the loss is the mean over the global batch's targets on any layout and with accumulation);
    None: every position is a target and each micro-batch's mean is used, as for plain pretraining windows."""

    positions: torch.Tensor | None
    target_count: int | None

    def __new__(cls, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None,
                target_count: int | None = None):
        batch = super().__new__(cls, (x, y))
        batch.positions, batch.target_count = positions, target_count
        return batch

    def to(self, device: torch.device) -> Batch:
        x, y = self
        positions = None if self.positions is None else self.positions.to(device, non_blocking=True)
        return Batch(x.to(device, non_blocking=True), y.to(device, non_blocking=True), positions, self.target_count)

    def map(self, fn) -> Batch:
        """The same batch with `fn` applied to each tensor (context parallelism's chunks)."""
        x, y = self
        return Batch(fn(x), fn(y), None if self.positions is None else fn(self.positions), self.target_count)


def as_batch(batch) -> Batch:
    """A Batch of any (x, y) pair (the harnesses' plain tuples)."""
    return batch if isinstance(batch, Batch) else Batch(*batch)
