"""Deterministic random-window batches from a prepared dataset.

A batch is a pure function of (seed, step, split): window offsets come from a fresh
torch.Generator seeded from those three numbers only. So a resumed run, or the same run laid
out over a different number of data-parallel ranks / accumulation steps, sees exactly the
same global batches, and each rank reads only its own rows of them.
"""

import os
from pathlib import Path

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.data.prepare import read_meta

_SPLIT_SALT = {"train": 0, "val": 0x5EED_5EED_5EED}  # keeps val windows unrelated to train's
_MASK63 = (1 << 63) - 1


class TokenData:
    def __init__(self, data_dir, split: str, seq_len: int):
        if split not in _SPLIT_SALT:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.data_dir, self.split, self.seq_len = Path(data_dir), split, int(seq_len)
        self.meta = read_meta(self.data_dir)
        self.dtype = np.dtype(self.meta["dtype"])
        self.path = self.data_dir / f"{split}.bin"
        self.n_tokens = os.path.getsize(self.path) // self.dtype.itemsize
        if self.n_tokens <= self.seq_len + 1:
            raise UserError(f"the {split} split of {self.data_dir} has {self.n_tokens} tokens but seq_len {self.seq_len} "
                            f"needs more than {self.seq_len + 1}; use a shorter seq_len or more text")
        self._data = None  # opened on first use: cheap to construct, safe to pickle / fork

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._data

    def __getstate__(self):
        return {**self.__dict__, "_data": None}

    def offsets(self, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
        """Start of every window of the global batch; depends on (seed, step, split) only."""
        g = torch.Generator()
        g.manual_seed(((seed * 1_000_003 + step) ^ _SPLIT_SALT[self.split]) & _MASK63)
        return torch.randint(0, self.n_tokens - self.seq_len, (global_batch_size,), generator=g)

    def _read(self, offsets):
        # Each window is seq_len+1 tokens: x is the first seq_len, y the same shifted by one.
        w = np.stack([self.data[o:o + self.seq_len + 1] for o in offsets.tolist()]).astype(np.int64)
        w = torch.from_numpy(w)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def global_batch(self, step: int, global_batch_size: int, seed: int):
        return self._read(self.offsets(step, global_batch_size, seed))

    def micro_batches(self, step, global_batch_size, seed, dp_rank, dp_size, accum_steps):
        """Rank dp_rank's contiguous slice of the global batch, cut into accum_steps equal parts."""
        if dp_size < 1 or accum_steps < 1 or global_batch_size % (dp_size * accum_steps):
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"dp_size * accum_steps = {dp_size} * {accum_steps}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        per_rank = global_batch_size // dp_size
        mb = per_rank // accum_steps
        mine = self.offsets(step, global_batch_size, seed)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [self._read(mine[i * mb:(i + 1) * mb]) for i in range(accum_steps)]

    def eval_batches(self, num_batches: int, batch_size: int, seed: int = 0):
        """A fixed list of batches (meant for the val split): identical on every call, so eval
        losses of different steps and runs are comparable."""
        return [self.global_batch(i, batch_size, seed) for i in range(num_batches)]
