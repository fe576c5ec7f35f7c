"""Deterministic batches from prepared datasets: many memory-mapped shards, one or several datasets.

Sample k of the run (k = step * global_batch + row) is a pure function of (seed, split, k):

    mixture     which dataset sample k comes from, and that dataset's own sample counter c
                (`mixture.assign`: exact proportions, no state)
    "random"    a window at a uniform random offset: row r of step s reads value r of a torch.randint draw
                seeded by (seed, split, step, dataset) (for one dataset exactly the offsets of the loader
                before shards existed, so the default run's batches did not change)
    "sequential" window number perm_epoch(c mod W), epoch = c // W, of the W = (tokens - 1) // seq_len
                non-overlapping windows: every token once per epoch, in a seeded shuffled order that
                changes every epoch (a Feistel permutation: no table, O(1) memory for any corpus size)

So a resumed run, or the same run laid out over any number of data-parallel ranks and accumulation
steps, sees exactly the same global batches, and each rank computes and reads only its own rows.
Windows may cross shard boundaries; the shards of a split are one token stream.

A dataset with loss masks (chat data) marks the targets outside them NOT_A_TARGET; with packing (data/packing.py,
the default for such data) a window is a numbered window of whole documents instead of an offset, and its batch
carries each token's position in its document. Either way each micro-batch carries the global batch's target count
(read from the masks of all its rows by every rank), the loss's divisor (training/step.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.data.batch import NOT_A_TARGET, Batch
from paratrain.data.mixture import Mixture, parse_sources
from paratrain.data.packing import Packing, check_packable
from paratrain.data.prepare import read_meta

_SPLIT_SALT = {"train": 0, "val": 0x5EED_5EED_5EED}  # keeps val windows unrelated to train's
MODES = ("random", "sequential")
_M64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
EVAL_BLOCK = 64  # the evaluation set is read as batches of this many sequences (a constant: never the run's batch)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a well-mixed hash."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _key(*parts: int) -> int:
    """Fold integers into one 64-bit key."""
    k = 0x9E3779B97F4A7C15
    for p in parts:
        k = int(_mix64(np.array([(k ^ (int(p) & _M64)) & _M64], dtype=np.uint64))[0])
    return k


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A seeded bijection of [0, n): a 4-round Feistel network on the smallest even power of two >= n,
    cycle-walking until the value falls inside [0, n)."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(index)
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    round_keys = [np.uint64(_key(key, r)) for r in range(4)]

    def feistel(v):
        left, right = v >> half, v & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix64(right ^ rk) & mask)
        return (left << half) | right

    out = feistel(index)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out


class Shards:
    """One split of one prepared dataset: its shard files as a single memory-mapped token stream (and, for a dataset
    with loss masks, the `.mask` files beside them: one byte per token, 1 where the token is a target)."""

    def __init__(self, data_dir: Path, split: str, meta: dict):
        self.data_dir, self.dtype = Path(data_dir), np.dtype(meta["dtype"])
        entries = [s for s in meta["splits"][split]["shards"] if s["tokens"] > 0]
        self.files = [self.data_dir / s["file"] for s in entries]
        self.masked = bool(meta.get("loss_mask"))
        self.sizes = np.array([s["tokens"] for s in entries], dtype=np.int64)
        self.ends = np.cumsum(self.sizes)
        self.n_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self._maps = {}  # opened on first use: cheap to construct, safe to pickle / fork

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def _map(self, i: int, mask: bool) -> np.memmap:
        if (i, mask) not in self._maps:
            path, dtype = (self.files[i].with_suffix(".mask"), np.uint8) if mask else (self.files[i], self.dtype)
            self._maps[i, mask] = np.memmap(path, dtype=dtype, mode="r", shape=(int(self.sizes[i]),))
        return self._maps[i, mask]

    def read(self, start: int, length: int, mask: bool = False) -> np.ndarray:
        """Tokens [start, start + length) of the stream (or their loss mask), across shard boundaries if need be."""
        parts, i = [], int(np.searchsorted(self.ends, start, side="right"))
        while length > 0:
            local = start - (int(self.ends[i - 1]) if i else 0)
            take = min(length, int(self.sizes[i]) - local)
            parts.append(self._map(i, mask)[local:local + take])
            start, length, i = start + take, length - take, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_ends(self) -> np.ndarray:
        """Offsets (in the stream) just after every document's EOS, from the .docs files of the index."""
        out, base = [], 0
        for f, size in zip(self.files, self.sizes.tolist()):
            out.append(np.fromfile(f.with_suffix(".docs"), dtype="<u8").astype(np.int64) + base)
            base += size
        return np.concatenate(out) if out else np.zeros(0, np.int64)


class TokenData:
    """Batches of one split: `TokenData(dir, "train", seq_len)`, or a mixture of prepared datasets
    `TokenData([{"dir": a, "weight": 0.7}, {"dir": b, "weight": 0.3}], "train", seq_len)`."""

    def __init__(self, data_dir, split: str, seq_len: int, mode: str = "random", packing: str = "auto",
                 overlong: str = "truncate"):
        """`packing`: "none" (windows anywhere in the token stream), "documents" (windows of whole documents, see
        data/packing.py) or "auto" (documents when a dataset has loss masks); `overlong`: what packing does with a
        document longer than a window ("truncate" or "drop")."""
        if split not in _SPLIT_SALT:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if mode not in MODES:
            raise UserError(f"data mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.split, self.seq_len, self.mode = split, int(seq_len), mode
        if isinstance(data_dir, (list, tuple)):
            self.mixture = parse_sources(data_dir)
        else:
            self.mixture = Mixture([Path(data_dir)], [1.0], [Path(data_dir).name])
        self.data_dir = self.mixture.dirs[0]
        metas = [read_meta(d) for d in self.mixture.dirs]
        self.meta = metas[0]
        self.mixture.check_tokenizers(metas)
        self.streams = [Shards(d, split, m) for d, m in zip(self.mixture.dirs, metas)]
        self.masked = any(s.masked for s in self.streams)
        self.packed = packing == "documents" or (packing == "auto" and self.masked)
        self.packings = [None] * len(self.streams)
        for i, (d, s, w) in enumerate(zip(self.mixture.dirs, self.streams, self.mixture.weights)):
            if self.packed:
                self.packings[i] = Packing(s.document_ends(), self.seq_len + 1, overlong)
                if w > 0:
                    check_packable(self.packings[i], f"the {split} split of {d}")
            elif w > 0 and s.n_tokens <= self.seq_len + 1:
                raise UserError(f"the {split} split of {d} has {s.n_tokens} tokens but seq_len {self.seq_len} "
                                f"needs more than {self.seq_len + 1}; use a shorter seq_len or more text")
        self.n_tokens = sum(s.n_tokens for s in self.streams)
        # windows per dataset: sequential mode's epoch (the packed windows, or the stream cut into seq_len pieces)
        self.windows = [len(p) if p is not None else max(1, (s.n_tokens - 1) // self.seq_len)
                        for s, p in zip(self.streams, self.packings)]

    # -- which windows -------------------------------------------------------------------------
    def _random_offsets(self, step: int, dataset: int, global_batch_size: int, seed: int) -> np.ndarray:
        """A start for every row of the step's global batch, drawn for one dataset."""
        salt = _SPLIT_SALT[self.split]
        g = torch.Generator()
        g.manual_seed(((seed * 1_000_003 + step) ^ salt) & _MASK63 if dataset == 0 else
                      _key(seed, salt, step, dataset) & _MASK63)
        packed = self.packings[dataset] is not None  # a packed stream draws window numbers
        high = self.windows[dataset] if packed else self.streams[dataset].n_tokens - self.seq_len
        return torch.randint(0, high, (global_batch_size,), generator=g).numpy()

    def windows_for(self, samples: np.ndarray, seed: int, global_batch_size: int):
        """(dataset index, window start) of each global sample index (sample = step * global batch + row); for a
        packed dataset, the window's number among its packed windows."""
        samples = np.asarray(samples, dtype=np.int64)
        which, counter = self.mixture.assign(samples)
        starts = np.zeros(len(samples), dtype=np.int64)
        salt = _SPLIT_SALT[self.split]
        for i, stream in enumerate(self.streams):
            rows = which == i
            if not rows.any():
                continue
            c = counter[rows].astype(np.uint64)
            if self.mode == "random":
                steps, cols = np.divmod(samples[rows], global_batch_size)
                out = np.zeros(len(steps), dtype=np.int64)
                for step in np.unique(steps).tolist():
                    sel = steps == step
                    out[sel] = self._random_offsets(step, i, global_batch_size, seed)[cols[sel]]
                starts[rows] = out
            else:
                w = self.windows[i]
                epoch, pos = c // np.uint64(w), c % np.uint64(w)
                out = np.zeros(len(c), dtype=np.int64)
                for e in np.unique(epoch).tolist():
                    sel = epoch == e
                    out[sel] = permute(pos[sel], w, _key(seed, salt, i, e)).astype(np.int64)
                starts[rows] = out if self.packings[i] is not None else out * self.seq_len
        return which, starts

    def offsets(self, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
        """Start of every window of the global batch (in its dataset's stream); depends on (seed, step, split) only."""
        samples = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
        return torch.from_numpy(self.windows_for(samples, seed, global_batch_size)[1])

    def _window(self, dataset: int, key: int, tokens: bool = True):
        """One window of seq_len + 1 tokens (None unless `tokens`), which of its positions 1.. are targets (None:
        all) and each token's position in its document (None: an unpacked window)."""
        stream, packing, length = self.streams[dataset], self.packings[dataset], self.seq_len + 1
        if packing is None:
            ids = stream.read(key, length) if tokens else None
            return ids, (stream.read(key + 1, length - 1, mask=True) > 0) if stream.masked else None, None
        start, used = int(packing.starts[key]), int(packing.lengths[key])
        ids = None
        if tokens:
            ids = np.zeros(length, dtype=np.int64)  # padding: never a target, a document of its own
            ids[:used] = stream.read(start, used)
        positions = packing.positions(key)
        keep = np.zeros(length, dtype=bool)
        keep[:used] = stream.read(start, used, mask=True) > 0 if stream.masked else True
        keep &= positions > 0  # a document's first token is predicted by nothing of its own
        return ids, keep[1:], positions

    def _read(self, which, starts, target_count: int | None = None) -> Batch:
        # Each window is seq_len+1 tokens: x is the first seq_len, y the same shifted by one.
        windows = [self._window(i, o) for i, o in zip(which.tolist(), starts.tolist())]
        w = torch.from_numpy(np.stack([ids for ids, _, _ in windows]).astype(np.int64))
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.masked or self.packed:
            keep = torch.from_numpy(np.stack([k if k is not None else np.ones(self.seq_len, bool)
                                              for _, k, _ in windows]))
            y = y.masked_fill(~keep, NOT_A_TARGET)
        positions = None
        if self.packed:
            positions = torch.from_numpy(np.stack([p[:-1] for _, _, p in windows]).astype(np.int64))
        return Batch(x, y, positions, target_count)

    def _samples(self, first: int, count: int, seed: int, global_batch_size: int):
        return self.windows_for(np.arange(first, first + count, dtype=np.int64), seed, global_batch_size)

    def _rows(self, first: int, count: int, seed: int, global_batch_size: int, target_count: int | None = None):
        return self._read(*self._samples(first, count, seed, global_batch_size), target_count)

    def _targets(self, first: int, count: int, seed: int, global_batch_size: int) -> int:
        """Target positions of samples first .. first + count - 1 (their masks read, not their tokens)."""
        which, starts = self._samples(first, count, seed, global_batch_size)
        total = 0
        for i, o in zip(which.tolist(), starts.tolist()):
            _, keep, _ = self._window(i, o, tokens=False)
            total += self.seq_len if keep is None else int(keep.sum())
        return total

    def target_count(self, step: int, global_batch_size: int, seed: int) -> int | None:
        """The target positions of global batch `step` (None: every position of every window is one)."""
        if not (self.masked or self.packed):
            return None
        return self._targets(step * global_batch_size, global_batch_size, seed, global_batch_size)

    def eval_targets(self, count: int, seed: int = 0) -> int:
        """The target positions of the first `count` sequences of the evaluation set."""
        if not (self.masked or self.packed):
            return count * self.seq_len
        return sum(self._targets(first, min(EVAL_BLOCK, count - first), seed, EVAL_BLOCK)
                   for first in range(0, count, EVAL_BLOCK))

    def describe(self) -> str | None:
        """A line on how the windows are made, for packed data (None otherwise)."""
        lines = [p.describe(f"{self.split} {name}") for p, name in zip(self.packings, self.mixture.names) if p]
        return "; ".join(lines) or None

    def global_batch(self, step: int, global_batch_size: int, seed: int):
        return self._rows(step * global_batch_size, global_batch_size, seed, global_batch_size)

    def micro_batches(self, step, global_batch_size, seed, dp_rank, dp_size, accum_steps):
        """Rank dp_rank's contiguous slice of the global batch, cut into accum_steps equal parts."""
        if dp_size < 1 or accum_steps < 1 or global_batch_size % (dp_size * accum_steps):
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"dp_size * accum_steps = {dp_size} * {accum_steps}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        per_rank = global_batch_size // dp_size
        mb = per_rank // accum_steps
        first = step * global_batch_size + dp_rank * per_rank
        count = self.target_count(step, global_batch_size, seed)  # every rank divides by the same count
        return [self._rows(first + i * mb, mb, seed, global_batch_size, count) for i in range(accum_steps)]

    def eval_sequences(self, first: int, count: int, seed: int = 0):
        """Sequences first .. first + count - 1 of the fixed evaluation set (meant for the val split): sequence i is
        a pure function of (seed, i), whatever the layout, the batch or how many are asked for, so evaluations of
        different steps, runs and layouts score the same sequences (sequence i is row i % EVAL_BLOCK of the split's
        batch i // EVAL_BLOCK)."""
        return self._rows(first, count, seed, EVAL_BLOCK)

    # -- how far the run has got ---------------------------------------------------------------
    def progress(self, steps_done: int, global_batch_size: int) -> dict:
        """Tokens and epochs seen per dataset after `steps_done` global batches (for the metrics)."""
        counts = self.mixture.counts(steps_done * global_batch_size)
        tokens = {name: int(c) * self.seq_len for name, c in zip(self.mixture.names, counts)}
        if self.mode == "sequential" or self.packed:
            epochs = [c / w for c, w in zip(counts, self.windows)]
        else:
            epochs = [c * self.seq_len / s.n_tokens for c, s in zip(counts, self.streams)]
        out = {"data_epoch": max(epochs), "data_tokens": tokens}
        if len(self.streams) > 1:
            out["data_epochs"] = {name: e for name, e in zip(self.mixture.names, epochs)}
        return out
