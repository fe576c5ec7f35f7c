"""Numerics watch: where activations, gradients and weights grow, and where a non-finite value was born.

Every `metrics.numerics_every` steps (0: off) the step runs with hooks that measure, per row (the embedding, each
block, the head), max |x| and RMS of
- the row's output (for a block: the residual stream after it; for the head: the logits),
- the attention logits' max before softmax (q.k / sqrt(d), computed beside the fused attention, which never holds
  them; under context parallelism over this rank's own keys),
- the dense MLP's hidden activation (the input of w2; mixture-of-experts blocks have none to show),
- after backward, the row's gradients (before clipping: fp16's are the loss-scaled ones, the ones that overflow)
  and its weights,
and the headroom of the row's largest activation to the bf16 and fp16 maxima, log2(format max / max |x|) in bits
(0: it overflows that format). Beside each max the non-finite values are counted: a max (and the ranks' MAX
all-reduce: NCCL's drops a NaN) may skip a NaN, a count cannot. A row and kind that held one reports max and RMS NaN
(unless they say inf), its count in `<kind>_nonfinite` and headroom NaN (not a number of bits); `first_nonfinite`
names the first row, in forward order, whose activations are non-finite: where the NaN started, the row
`numerics.png` boxes and the replay's table marks. The numbers stay on the device (two all-reduces over every rank:
each rank holds some rows' values, for its part of the batch) and are read with the step's other numbers at the next
settle point (`training/loop.py`), as the record's `numerics`.

A step whose loss or gradient norm turns out non-finite at the settle point is replayed forward (no gradients) on
the same batch and the weights of that moment, every module's output checked: the first module in the order outputs
are produced whose output is non-finite, and the rank that saw it, go into the step's one-line message and record
(`nonfinite`), with the batch id for `paratrain replay`; the replay's rows (activations and weights) are the step's
numerics, unless it was a watch step (its own, gradients included).

Off, the model has no hooks at all. On, the hooks are installed once and return at once outside watch steps
(a compiled block then keeps one graph with and one without them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn
import torch
import torch.distributed as dist

from paratrain.distributed.initialize import canonical_name
from paratrain.distributed.parallelize import unwrap
from paratrain.distributed.tensors import local_tensor, torch_dtype
from paratrain.modes import LOW_PRECISIONS, Precision
from paratrain.observe.replay import first_nonfinite_row

FORMATS = {p: torch.finfo(torch_dtype(p)).max for p in LOW_PRECISIONS}  # the largest finite value of each
ACTIVATIONS, LOGITS, MLP, GRADS, WEIGHTS = range(5)  # the kinds measured per row
KIND_NAMES = ("act", "attn_logit", "mlp", "grad", "weight")
LOGIT_CHUNK = 2**24  # attention scores computed at most this many at a time (T = 8192 would be 2^26 per head)


def row_names(n_layers: int) -> list[str]:
    return ["embed", *map(str, range(n_layers)), "head"]


def row_of(name: str, n_layers: int) -> int | None:
    """The row of a canonical module or parameter name: 0 the embedding, 1 + k block k, the last the final norm and
    the output; None for the root."""
    if name.startswith("tok_embeddings"):
        return 0
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1])
    if name.startswith(("norm", "output")):
        return n_layers + 1
    return None


def forward_modules(train_step) -> list[nn.Module]:
    """The modules this rank runs forward: the model (unwrapped from DDP), or its pipeline stages."""
    if train_step.pipeline is not None:
        return list(train_step.pipeline.modules.values())
    return [unwrap(train_step.model)]


def _first_tensor(out):
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    return local_tensor(out).detach() if isinstance(out, torch.Tensor) else None


def _named(modules: list[nn.Module]):
    """(canonical name, module) of every module, each once (wrappers add names for the same module)."""
    seen, names = set(), set()
    for root in modules:
        for raw, m in root.named_modules():
            name = canonical_name(raw)
            if id(m) not in seen and name not in names:  # an activation-checkpoint wrapper and its block: once
                seen.add(id(m))
                names.add(name)
                yield name, m


class _LogitWatch:
    """Stands in for an attention's `sequence` (models/llama.py's seam): on watch steps it also measures the
    largest attention logit, then attends as the object it wraps."""

    def __init__(self, inner, watch: "NumericsWatch", row: int):
        self._inner, self._watch, self._row = inner, watch, row

    def __getattr__(self, name):  # rope, cp, ... of the object it wraps
        return getattr(self._inner, name)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._watch.active:
            top = max_logit(q, k)
            self._watch.add_max(self._row, LOGITS, top)
            self._watch.sums[self._row, LOGITS, 1] += 1
            self._watch.sums[self._row, LOGITS, 2] += ~torch.isfinite(top)  # the ranks' MAX may drop its NaN
        return self._inner.attend(q, k, v)


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """max over causal positions of q.k / sqrt(d): q (B, Hq, T, D), k (B, Hkv, S, D), the last T of S keys being
    q's own positions; scores computed a chunk of queries at a time."""
    q, k = local_tensor(q).float(), local_tensor(k).float()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    B, H, T, D = q.shape
    S = k.shape[2]
    chunk = max(1, LOGIT_CHUNK // max(1, B * H * S))
    best = torch.full((), -math.inf, device=q.device)
    keys = torch.arange(S, device=q.device)
    for start in range(0, T, chunk):
        scores = q[:, :, start:start + chunk] @ k.transpose(-2, -1) / math.sqrt(D)
        queries = torch.arange(start, min(T, start + chunk), device=q.device) + (S - T)
        scores = scores.masked_fill(keys[None, :] > queries[:, None], -math.inf)
        best = torch.maximum(best, scores.amax())
    return best


class NumericsWatch:
    """The per-row statistics of watch steps, and the first non-finite module of a bad step (see the module's
    docstring). `every` = metrics.numerics_every (0: no hooks; bad steps are still diagnosed)."""

    def __init__(self, train_step, n_layers: int, every: int, precision: str):
        self.train_step, self.n_layers, self.every = train_step, n_layers, every
        self.low_format = Precision(precision).headroom_format
        self.rows = row_names(n_layers)
        self.active = False
        self.max = self.sums = None
        self.device = train_step.device
        self.first_step: int | None = None  # this process's first step
        if every > 0:
            self._install()  # for the whole run

    # -- hooks ------------------------------------------------------------------------------------
    def _install(self):
        """Hooks on the rows' modules and a logit watch in each attention; returns what removes them."""
        handles, watched = [], []
        for name, m in _named(forward_modules(self.train_step)):
            row = row_of(name, self.n_layers)
            if row is None:
                continue
            parts = name.split(".")
            if name in ("tok_embeddings", "output") or (len(parts) == 2 and parts[0] == "layers"):
                handles.append(m.register_forward_hook(self._output_hook(row, ACTIVATIONS)))
            elif parts[2:] == ["feed_forward", "w2"]:  # the dense SwiGLU's hidden activation is w2's input
                handles.append(m.register_forward_pre_hook(self._input_hook(row, MLP)))
            elif parts[2:] == ["attention"] and hasattr(m, "sequence"):
                m.sequence = _LogitWatch(m.sequence, self, row)
                watched.append(m)

        def remove():
            for h in handles:
                h.remove()
            for m in watched:
                m.sequence = m.sequence._inner
        return remove

    def _output_hook(self, row: int, kind: int):
        def hook(module, args, out):
            if self.active:
                self.add(row, kind, _first_tensor(out))
        return hook

    def _input_hook(self, row: int, kind: int):
        def hook(module, args):
            if self.active:
                self.add(row, kind, _first_tensor(args))
        return hook

    def add(self, row: int, kind: int, x: torch.Tensor | None) -> None:
        if x is None or x.numel() == 0:
            return
        # norms computed in fp32 by the reduction itself: no fp32 copy of a bf16 activation
        self.add_max(row, kind, torch.linalg.vector_norm(x, math.inf, dtype=torch.float32))
        self.sums[row, kind, 0] += torch.linalg.vector_norm(x, 2, dtype=torch.float32).square()
        self.sums[row, kind, 1] += x.numel()
        self.sums[row, kind, 2] += x.numel() - torch.isfinite(x).sum()  # on the device, read with the rest

    def add_max(self, row: int, kind: int, value: torch.Tensor) -> None:
        self.max[row, kind] = torch.maximum(self.max[row, kind], value.to(self.max.device))

    # -- a watch step -----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """A watch step. Not the first step of a pipelined process: torch's pipeline infers its stages' shapes then,
        by a forward of each later stage over uninitialised tensors, which the hooks would measure."""
        if self.first_step is None:
            self.first_step = step
        if self.train_step.pipeline is not None and step == self.first_step:
            return False
        return self.every > 0 and (step + 1) % self.every == 0

    def begin(self, step: int) -> None:
        """Before the step's forward: on a watch step, start measuring."""
        if self.due(step):
            self._start()

    def _start(self) -> None:
        self.active = True
        self.max = torch.zeros(len(self.rows), len(KIND_NAMES), device=self.device)
        self.max[:, LOGITS] = -math.inf  # a logit can be negative; the other kinds are absolute values
        # per row and kind: the sum of squares, the count, the count of non-finite values
        self.sums = torch.zeros(len(self.rows), len(KIND_NAMES), 3, device=self.device)

    @torch.no_grad()
    def after_backward(self) -> None:
        """After the step's backward (before clipping): the rows' gradients and weights."""
        if not self.active:
            return
        self.active = False  # the rest of the step (clipping, the update) is not measured
        for name, p in _parameters(self.train_step):
            row = row_of(name, self.n_layers)
            if row is None:
                continue
            self.add(row, WEIGHTS, local_tensor(p).detach())
            if p.grad is not None:
                self.add(row, GRADS, local_tensor(p.grad).detach())

    def end(self):
        """After the step: None, or on a watch step a callable that reads the numbers (at the settle point). The
        all-reduces are issued now, on every rank."""
        if self.max is None:
            return None
        stats, self.max, self.sums = torch.cat([self.max.flatten(), self.sums.flatten()]), None, None
        self.active = False
        if dist.is_initialized() and dist.get_world_size() > 1:
            n = len(self.rows) * len(KIND_NAMES)
            maxes, sums = stats[:n], stats[n:]
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            dist.all_reduce(sums)
            stats = torch.cat([maxes, sums])
        return lambda: self.record(stats.tolist())

    def record(self, values: list[float]) -> dict:
        """The record's numerics from the reduced statistics (the max of each row and kind, then the sums of squares,
        the counts and the non-finite counts)."""
        R, K = len(self.rows), len(KIND_NAMES)
        maxes = [values[r * K:(r + 1) * K] for r in range(R)]
        sums = values[R * K:]

        def at(r, k, i):  # i: 0 the sum of squares, 1 the count, 2 the non-finite count
            return sums[(r * K + k) * 3 + i]

        def nonfinite(r, k, v):  # a finite max or RMS beside a non-finite count skipped a NaN
            return math.nan if at(r, k, 2) > 0 and math.isfinite(v) else v

        def amax(r, k):
            return nonfinite(r, k, maxes[r][k]) if at(r, k, 1) > 0 else None

        def rms(r, k):
            n = at(r, k, 1)
            return nonfinite(r, k, math.sqrt(at(r, k, 0) / n)) if n > 0 else None

        out = {"rows": self.rows}
        for k, kind in enumerate(KIND_NAMES):
            out[f"{kind}_max"] = [amax(r, k) for r in range(R)]
            if k != LOGITS:  # the logits' count is of attention calls, not of values
                out[f"{kind}_rms"] = [rms(r, k) for r in range(R)]
                out[f"{kind}_nonfinite"] = [int(at(r, k, 2)) if at(r, k, 1) > 0 else None for r in range(R)]
        largest = [_largest(out["act_max"][r], out["mlp_max"][r]) for r in range(R)]
        out["headroom_bits"] = {fmt: [headroom_bits(v, top) for v in largest] for fmt, top in FORMATS.items()}
        first = first_nonfinite_row(out)
        out["first_nonfinite"] = None if first is None else self.rows[first]
        summary = {"numerics": out}
        for key in ("act_max", "grad_max"):
            present = [v for v in out[key] if v is not None]
            summary[f"numerics_{key}"] = max(present, key=_nan_last) if present else None
        head = [v for v in out["headroom_bits"][self.low_format] if v is not None]
        summary["numerics_headroom_bits"] = min(head, key=_nan_first) if head else None  # NaN: a row has none
        return summary

    # -- a non-finite step ------------------------------------------------------------------------
    @torch.no_grad()
    def first_nonfinite(self, batches) -> dict:
        """Replay `batches` (this rank's micro-batches of the bad step) forward with every module's output checked
        and the rows measured (activations and weights: no backward runs); every rank calls this together. Returns
        {"module", "rank"} of the first non-finite output (in the order outputs are produced, blocks in model order
        across pipeline stages), or {"module": None, "loss_finite"}, and the rows' numbers ("numerics": the record's
        keys)."""
        names, flags, handles = [], [], []

        def hook(name):
            def check(module, args, out):
                x = _first_tensor(out)
                if x is not None and x.is_floating_point():
                    names.append(name)
                    flags.append(torch.isfinite(x).all())
            return check

        for name, m in _named(forward_modules(self.train_step)):
            handles.append(m.register_forward_hook(hook(name)))
        remove = self._install() if self.every == 0 else None  # the rows' hooks, for this replay only
        self._start()
        try:
            losses = [self.train_step.eval_loss_sum(batch, len(batch[0])) for batch in batches]
            self.after_backward()  # the weights (no gradients: the replay runs no backward)
        finally:
            self.active = False
            for h in handles:
                h.remove()
            if remove is not None:
                remove()
        numbers = self.end()()
        ok = torch.stack([*flags, torch.isfinite(torch.stack(losses).sum())]).tolist()  # one read
        first = next((i for i, good in enumerate(ok[:-1]) if not good), None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = (self._order(names[first]) if first is not None else (math.inf,), first or 0, rank,
                names[first] if first is not None else None, bool(ok[-1]))
        found = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, mine)
        _, _, rank, module, _ = min(found, key=lambda f: (f[0], f[1], f[2]))
        if module is None:
            return {"module": None, "loss_finite": all(f[4] for f in found), "numerics": numbers}
        return {"module": module or "the model's output", "rank": rank, "numerics": numbers}

    def _order(self, name: str) -> tuple:
        """Where a module's row comes in the forward (pipeline stages hold different rows)."""
        row = row_of(name, self.n_layers)
        return (row if row is not None else len(self.rows),)


def _nan_last(v: float) -> float:
    return math.inf if math.isnan(v) else v


def _nan_first(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _largest(*values: float | None) -> float | None:
    """The largest of a row's maxima, a non-finite one first (Python's max keeps or drops a NaN by its place)."""
    present = [v for v in values if v is not None]
    return next((v for v in present if not math.isfinite(v)), max(present, default=None))


def headroom_bits(largest: float | None, format_max: float) -> float | None:
    """log2(format max / max |x|): how many doublings the largest value can take before the format overflows (0: a
    finite value past the format's max); NaN for an infinite or NaN max, which has no headroom to measure."""
    if largest is None:
        return None
    if not math.isfinite(largest):
        return math.nan
    if largest >= format_max:
        return 0.0
    return math.log2(format_max / largest) if largest > 0 else None


def _parameters(train_step):
    for name, p in unwrap(train_step.model).named_parameters():
        yield canonical_name(name), p


@dataclass
class Finding:
    """What the replay of a non-finite step found, for its one-line message and its record."""

    step: int  # the optimizer step index (the record's step is step + 1)
    batch: int
    module: str | None
    rank: int | None
    run_dir: str
    loss_finite: bool = True
    numerics: dict | None = None  # the rows' numbers on the replay (the record's numerics keys)

    def text(self) -> str:
        replay = f"replay: paratrain replay {self.run_dir} step-{self.step + 1}"
        if self.module is not None:
            return (f"first non-finite output: {self.module} (rank {self.rank}, step {self.step + 1}, "
                    f"batch {self.batch}); {replay}")
        where = "in backward (gradients)" if self.loss_finite else "in the loss"
        return (f"replaying batch {self.batch} forward, every module's output was finite: the non-finite value "
                f"arose {where} (step {self.step + 1}); {replay}")

    def record(self) -> dict:
        return {"nonfinite": {"module": self.module, "rank": self.rank, "batch": self.batch}, **(self.numerics or {})}
