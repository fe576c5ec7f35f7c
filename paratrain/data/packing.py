"""Windows of whole documents (`data.packing = "documents"`), from the `.docs` offsets of the index.

A window of a packed stream holds consecutive whole documents, as many as fit in seq_len + 1 tokens (first fit in
corpus order), then padding. Every token gets its position in its document (restarting at 0 where one starts; the
padding is a document of its own), which the model turns into rotary angles and a block-diagonal causal mask
(models/llama.py `Documents`); a document's first token is never a target (nothing before it in its document
predicts it), nor is padding. A document longer than a window is cut to the window (`overlong = "truncate"`) or
left out (`"drop"`); both are counted. The windows are a pure function of the dataset, so a window index is as good
as an offset: the loader draws indices (random mode) or permutes them (sequential), as it does stream windows.
"""

from __future__ import annotations

import numpy as np

from paratrain.errors import UserError

OVERLONG = ("truncate", "drop")


class Packing:
    """The windows of one stream: `starts` and `lengths` (tokens of documents, at most `length`) of each."""

    def __init__(self, document_ends: np.ndarray, length: int, overlong: str = "truncate"):
        if overlong not in OVERLONG:
            raise UserError(f"data.overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
        self.length, self.ends = int(length), np.asarray(document_ends, dtype=np.int64)
        doc_starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)
        sizes = self.ends - doc_starts
        self.documents, self.truncated, self.dropped = len(self.ends), 0, 0
        starts, lengths, i = [], [], 0
        while i < len(self.ends):
            start = int(doc_starts[i])
            if sizes[i] > self.length:  # alone in its window, cut; or not at all
                if overlong == "truncate":
                    starts.append(start)
                    lengths.append(self.length)
                    self.truncated += 1
                else:
                    self.dropped += 1
                i += 1
                continue
            j = int(np.searchsorted(self.ends, start + self.length, side="right"))  # documents i..j-1 fit
            starts.append(start)
            lengths.append(int(self.ends[j - 1]) - start)
            i = j
        self.starts, self.lengths = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def positions(self, index: int) -> np.ndarray:
        """(length,) each token's position in its document in window `index` (the padding counts from 0 too)."""
        start, used = int(self.starts[index]), int(self.lengths[index])
        lo, hi = np.searchsorted(self.ends, [start, start + used], side="right")
        first = np.zeros(self.length + 1, dtype=bool)
        first[0] = True
        first[self.ends[lo:hi] - start] = True  # each later document's first token, and the padding's
        first = first[:self.length]
        segment = np.cumsum(first) - 1
        return np.arange(self.length) - np.flatnonzero(first)[segment]

    def describe(self, split: str) -> str:
        cut = f", {self.truncated} cut to the window" if self.truncated else ""
        left = f", {self.dropped} left out (longer than a window)" if self.dropped else ""
        fill = self.lengths.sum() / max(1, len(self) * self.length)
        return (f"{split}: {self.documents} documents packed into {len(self)} windows of {self.length} tokens "
                f"({fill:.0%} filled{cut}{left})")


def check_packable(packing: Packing, where: str) -> None:
    if not len(packing):
        raise UserError(f"{where} has no document that fits a window of {packing.length} tokens (data.packing="
                        "documents packs whole documents): use a longer training.seq_len or data.overlong=truncate")
