"""Mixtures of prepared datasets: `[data] sources = [{dir = "a", weight = 0.7}, {dir = "b", weight = 0.3}]`.

Sample k of the run goes to a dataset by stick-breaking with exact integer quotas: dataset 0 takes
round(q0 * k) of the first k samples (q0 = its weight), the rest are numbered again and dataset 1
takes its share of those, and so on. So each dataset's count after any number of samples is within
one sample (per level) of weight x samples, each sample's dataset and that dataset's own counter are
closed-form functions of k (no state: resume, any data-parallel layout and any rank's rows agree),
and datasets interleave evenly inside every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.data.tokenizers import load_tokenizer, tokenizer_identity
from paratrain.errors import ConfigError, UserError

_ONE = 1 << 32  # weights become integer quotas out of 2^32


@dataclass
class Mixture:
    dirs: list
    weights: list
    names: list

    def __post_init__(self):
        total = sum(self.weights)
        quotas = [int(round(w / total * _ONE)) for w in self.weights]
        quotas[max(range(len(quotas)), key=lambda i: quotas[i])] += _ONE - sum(quotas)
        self.quotas = quotas
        # remaining[i]: the quota still to share among datasets i, i+1, ...
        self.remaining = [sum(quotas[i:]) for i in range(len(quotas))]

    def _taken(self, level: int, n):
        """How many of the first n samples reaching `level` dataset `level` takes (round half up)."""
        q, m = self.quotas[level], self.remaining[level]
        if m == 0:
            return n * 0
        return (np.asarray(n, dtype=object) * q + m // 2) // m

    def assign(self, samples: np.ndarray):
        """(dataset, that dataset's counter) for each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        which = np.full(len(samples), len(self.dirs) - 1, dtype=np.int64)
        counter = samples.copy()
        if len(self.dirs) == 1:
            return which, counter
        r = samples.astype(object)  # Python ints: exact for any run length
        undecided = np.ones(len(samples), dtype=bool)
        for level in range(len(self.dirs) - 1):
            before, after = self._taken(level, r), self._taken(level, r + 1)
            mine = undecided & (after > before)
            which[mine] = level
            counter[mine] = before[mine].astype(np.int64)
            undecided &= ~mine
            r = r - before  # index among the samples left for the later datasets
        counter[undecided] = r[undecided].astype(np.int64)
        return which, counter

    def counts(self, n: int) -> list:
        """Samples each dataset got among the first n."""
        out, r = [], int(n)
        for level in range(len(self.dirs) - 1):
            taken = int(self._taken(level, r))
            out.append(taken)
            r -= taken
        return out + [r]

    def check_tokenizers(self, metas: list):
        """Every dataset of a mixture must use the same tokenizer (same ids for the same text), compared by content:
        one tokenizer.json is the same tokenizer whether a dataset was prepared with it as a file or as "bpe"."""
        recorded = {m.get("tokenizer_sha256") for m in metas}
        if len(metas) == 1 or (len(recorded) == 1 and None not in recorded):
            return  # one recorded hash (an older dataset's is of its files' bytes: the same bytes, the same content)
        ids = [tokenizer_identity(load_tokenizer(d)) for d in self.dirs]
        ref = metas[0]
        for d, m, identity in zip(self.dirs[1:], metas[1:], ids[1:]):
            if identity != ids[0]:
                raise UserError(f"data.sources: {d} uses a different tokenizer ({m['tokenizer']}, vocab "
                                f"{m['vocab_size']}) than {self.dirs[0]} ({ref['tokenizer']}, vocab "
                                f"{ref['vocab_size']}); prepare every dataset of a mixture with the same tokenizer "
                                "(e.g. --tokenizer path/to/tokenizer.json)")


def parse_sources(entries) -> Mixture:
    """Check `data.sources` (a list of {dir, weight[, name]} tables) and return the Mixture."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ConfigError("data.sources must be a non-empty list like [{dir = \"data/a\", weight = 0.7}, ...]")
    dirs, weights, names = [], [], []
    for i, e in enumerate(entries):
        if isinstance(e, (list, tuple)) and len(e) == 2:
            e = {"dir": e[0], "weight": e[1]}
        if not isinstance(e, dict) or "dir" not in e:
            raise ConfigError(f"data.sources[{i}] must be a table with a 'dir' (and a 'weight'), got {e!r}")
        unknown = set(e) - {"dir", "weight", "name"}
        if unknown:
            raise ConfigError(f"data.sources[{i}]: unknown key {sorted(unknown)[0]!r} (expected dir, weight, name)")
        w = e.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
            raise ConfigError(f"data.sources[{i}].weight must be a number >= 0, got {w!r}")
        dirs.append(Path(str(e["dir"])))
        weights.append(float(w))
        names.append(str(e.get("name") or Path(str(e["dir"])).name))
    total = sum(weights)
    if total <= 0:
        raise ConfigError("data.sources: the weights are all zero; give at least one dataset a positive weight")
    if not np.isfinite(total):
        raise ConfigError(f"data.sources: the weights add up to more than a number holds ({' + '.join(map(repr, weights))}); "
                          "scale them down (only their ratios matter)")
    for i, w in enumerate(weights):
        if 0 < w and round(w / total * _ONE) == 0:
            raise ConfigError(f"data.sources[{i}].weight {w!r} is too small beside the others (below 1/2^32 of their "
                              "sum): that dataset would never be read; give it 0 or a larger weight")
    if len(set(names)) != len(names):
        raise ConfigError(f"data.sources: two datasets are named {next(n for n in names if names.count(n) > 1)!r}; "
                          "give them distinct 'name's")
    return Mixture(dirs, weights, names)
