"""The data-parallel gradient reduction: compression hooks, their state, and the bytes they put on the wire.

`parallel.grad_compression` (the capability: paratrain/capabilities/grad_compression.py, with the rules of where each
method acts, `grad_compression_site`; the trainer hands a run's decisions to `GradComm` as a `GradReduction`):

  none      DDP's own bucketed all-reduce / FSDP's reduce-scatter, untouched (no hook is registered)
  bf16      ddp/zero1: torch's `bf16_compress_hook` (all-reduce in bf16); FSDP (zero2, fsdp, hsdp, also under
            tp/pp/ep): `MixedPrecisionPolicy(reduce_dtype=bf16)`, so reduce-scatter and hsdp's all-reduce run in bf16
  powersgd  ddp/zero1: torch's `powerSGD_hook` (rank `parallel.powersgd_rank`, plain all-reduce for the first
            `parallel.powersgd_warmup_steps`, error feedback, warm start), its state kept per parameter (below)
  sign_ef   ddp/zero1 (DDP hook) and hsdp's dp_replicate dimension (FSDP all-reduce hook): 1 bit per element (the
            sign, packed 8 to a byte) plus one fp32 scale per tensor piece, with error feedback on both sides

sign_ef is the compressed all-reduce of 1-bit Adam (Tang et al. 2021) applied to gradients, in two phases over p
ranks, each parameter split into p pieces:
  1. every rank adds its residual (worker error) to its gradient, compresses each piece to signs x scale (scale =
     mean |x| of the piece, the scale minimising the squared error), keeps the new residual, and sends piece j to rank
     j (one all-to-all);
  2. rank j decompresses the p copies of its piece, averages them, adds its own residual (server error), compresses
     again, keeps that residual, and all-gathers the result; every rank decompresses the same bytes, so the replicas
     stay identical.
Per rank and step that sends 2 (p-1)/p x N/8 bytes plus the scales, against 2 (p-1)/p x 4N for an fp32 ring
all-reduce: about 1/32 (97% fewer bytes). Everything is per parameter, never per DDP bucket, so the result does not
depend on how DDP groups parameters (it regroups them after the first step, and a resumed run starts with the
initial grouping again): resuming from a checkpoint continues bit for bit.

1-bit Adam and 0/1 Adam (the optimizers that communicate themselves: `OptimizerEntry.compression`; their kernels in
paratrain/training/) use the same SignEF on their momenta: their schedule (`OptimizerEntry.schedule`, made by their
capability, handed here in the run's `GradReduction`) tells the hooks, step by step, to take the fp32 mean, the 1-bit mean, or
to leave each rank its own gradient, and the optimizer averages its momenta with `GradComm.momentum_mean_`.

PowerSGD is torch's hook; its state (error feedback, the warm-started Q matrices) is per bucket in torch, so the
wrapper here moves it to and from per-parameter dictionaries around each call, for the same reason.

Bytes: `comm_bytes` in the metrics is what this rank sends for the gradient reduction in one optimizer step, by
algorithm (ring all-reduce 2 (p-1)/p n, reduce-scatter and all-to-all (p-1)/p n, all-gather (p-1) n of n bytes
per rank); the hooks count their own collectives, the uncompressed reductions (none, FSDP's reduce-scatter) are
computed from the gradient sizes. `compression_ratio` = comm_bytes / the bytes of the same reduction in fp32
without compression (1.0 for none).
"""

from __future__ import annotations

import math
import threading
import zlib

from torch import nn
import torch
import torch.distributed as dist

from paratrain.capabilities.grad_compression import GradReduction, powersgd_matrix
from paratrain.config import ParallelConfig
from paratrain.distributed.initialize import canonical_name
from paratrain.distributed.tensors import local_tensor
from paratrain.modes import CompressionSite
from paratrain.optimizers import GradientReduction

STATE_PREFIX = "grad_comm"  # checkpoint keys: grad_comm/<method>/w<world>/rank<r>/<parameter>|<kind>


def all_reduce_wire(nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring all-reduce of nbytes."""
    return 2 * (p - 1) / p * nbytes if p > 1 else 0.0


def scatter_wire(nbytes: float, p: int) -> float:
    """Bytes one rank sends in a reduce-scatter or all-to-all of an nbytes input."""
    return (p - 1) / p * nbytes if p > 1 else 0.0


def gather_wire(nbytes_per_rank: float, p: int) -> float:
    """Bytes one rank sends in a ring all-gather of nbytes from every rank."""
    return (p - 1) * nbytes_per_rank if p > 1 else 0.0


def exact_mean_(flat: torch.Tensor, group, meter: "CommMeter") -> torch.Tensor:
    """Replace `flat` with its exact mean over the group: a plain fp32 all-reduce (gloo has no AVG: sum, divide)."""
    p = dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    meter.add(all_reduce_wire(4 * flat.numel(), p), all_reduce_wire(4 * flat.numel(), p))
    return flat.div_(p)


class CommMeter:
    """Bytes sent by the gradient reduction since the last `take` (hooks run on communication threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = self.uncompressed = 0.0

    def add(self, sent: float, uncompressed: float) -> None:
        with self.lock:
            self.sent += sent
            self.uncompressed += uncompressed

    def take(self) -> tuple[float, float]:
        with self.lock:
            out = (self.sent, self.uncompressed)
            self.sent = self.uncompressed = 0.0
        return out


# -- sign_ef ----------------------------------------------------------------------------------------------------------

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(rows, C) -> (rows, C/8) uint8, the bit set where x >= 0, most significant bit first (C a multiple of 8)."""
    if x.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.packbits((x >= 0).numpy(), axis=-1))
    bits = (x >= 0).to(torch.uint8).unflatten(-1, (-1, 8)) << _SHIFTS.to(x.device)
    return bits.sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(rows, C/8) uint8 -> (rows, C) bool: True where the value was >= 0."""
    if packed.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.unpackbits(packed.numpy(), axis=-1).view(np.bool_))
    return ((packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1).flatten(-2).bool()


class _Plan:
    """How a flat buffer of named segments (parameters) is laid out for sign_ef (cached per segment list).

    Segment k of n_k elements is zero-padded to p x c_k and cut into p pieces of c_k; the matrix X (p, C = sum c_k)
    holds in row j the j-th piece of every segment (columns [start_k, start_k + c_k) for segment k): row j is what
    rank j averages. Each piece has scale groups: one (block = 0: c_k a multiple of 8) or c_k / block of `block`
    elements each (c_k a multiple of block)."""

    def __init__(self, segments: tuple[tuple[str, int], ...], p: int, block: int, device):
        self.names = [name for name, _ in segments]
        self.sizes = [n for _, n in segments]
        self.p, self.block = p, block
        unit = block if block else 8
        self.pieces = [-(-n // (unit * p)) * unit for n in self.sizes]  # c_k
        self.starts = [0]
        for c in self.pieces:
            self.starts.append(self.starts[-1] + c)
        self.C = self.starts[-1]
        self.groups = self.C // block if block else len(self.sizes)
        valid = self.to_matrix([torch.ones(n, device=device) for n in self.sizes])
        self.valid = valid > 0  # (p, C): real elements, not padding
        if block:
            self.counts = valid.view(p, self.groups, block).sum(-1)
        else:
            self.widths = torch.tensor(self.pieces, device=device)
            self.counts = torch.stack([valid[:, a:b].sum(-1) for a, b in zip(self.starts, self.starts[1:])], dim=1)

    def to_matrix(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-segment flat tensors -> X (p, C)."""
        p = self.p
        return torch.cat([torch.nn.functional.pad(t, (0, p * c - t.numel())).view(p, c)
                          for t, c in zip(tensors, self.pieces)], dim=1)

    def from_matrix(self, X: torch.Tensor) -> list[torch.Tensor]:
        """X (p, C) -> the per-segment flat tensors (padding dropped)."""
        return [X[:, a:b].reshape(-1)[:n] for a, b, n in zip(self.starts, self.starts[1:], self.sizes)]

    def scales(self, X: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Mean |x| of each scale group of rows X (padding must be 0): (rows, C) -> (rows, groups), the scale that
        minimises the squared error of scale x sign(x)."""
        a = X.abs()
        if self.block:
            total = a.view(X.shape[0], self.groups, self.block).sum(-1)
        else:
            total = torch.stack([a[:, s:e].sum(-1) for s, e in zip(self.starts, self.starts[1:])], dim=1)
        return total / counts.clamp(min=1)

    def expand(self, positive: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Decompress: +scale where positive, -scale elsewhere: (rows, C) bool, (rows, groups) -> (rows, C)."""
        rows = positive.shape[0]
        if self.block:
            s = scales.unsqueeze(-1).expand(rows, self.groups, self.block).reshape(rows, self.C)
        else:
            s = scales.repeat_interleave(self.widths, dim=1)
        return torch.where(positive, s, -s)


class SignEF:
    """1-bit sign compression with error feedback (the 1-bit Adam compressed all-reduce), per named parameter."""

    def __init__(self, group, meter: CommMeter, block: int = 0, warmup_steps: int = 0):
        self.group, self.meter, self.block, self.warmup_steps = group, meter, block, warmup_steps
        self.step = 0  # the optimizer step being reduced (GradComm.start_step)
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.worker: dict[str, torch.Tensor] = {}  # this rank's residual of each parameter's gradient (numel)
        self.server: dict[str, torch.Tensor] = {}  # this rank's residual of its piece of each parameter (c_k)
        self.plans: dict[tuple, _Plan] = {}

    def mean_(self, flat: torch.Tensor, segments: list[tuple[str, int]]) -> torch.Tensor:
        """Replace `flat` (the concatenated gradients named by `segments`) with the compressed mean over the group;
        during the warm-up steps, with the exact mean (a plain all-reduce; the residuals stay zero)."""
        if self.step < self.warmup_steps:
            return exact_mean_(flat, self.group, self.meter)
        return self.finish(*self.start(flat, segments))

    def start(self, flat: torch.Tensor, segments: list[tuple[str, int]]):
        """Phase 1: error feedback, compression, the all-to-all. Returns what `finish` needs."""
        key = tuple(segments)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _Plan(key, self.p, self.block, flat.device)
        p = self.p
        grads = flat.detach().float().split(plan.sizes)
        X = plan.to_matrix([g + self.worker[name] if name in self.worker else g
                            for (name, _), g in zip(segments, grads)])  # (p, C), padding 0
        scales = plan.scales(X, plan.counts)  # (p, groups)
        packed = pack_signs(X)  # (p, C/8)
        residual = X - plan.expand(unpack_signs(packed), scales)
        for name, r in zip(plan.names, plan.from_matrix(residual)):
            self.worker[name] = r
        send = torch.cat([packed.to(flat.device), scales.view(torch.uint8)], dim=1)  # (p, C/8 + 4 groups) bytes
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self.meter.add(scatter_wire(send.numel(), p) + gather_wire(send.shape[1], p),
                       all_reduce_wire(4 * flat.numel(), p))
        return work, flat, plan, recv

    def finish(self, work, flat, plan: _Plan, recv) -> torch.Tensor:
        """Phase 2: average this rank's piece, server error feedback, compress, all-gather, decompress."""
        work.wait()
        p, C, G, j, dev = self.p, plan.C, plan.groups, self.rank, flat.device
        mine = plan.valid[j:j + 1]  # (1, C)
        received = plan.expand(unpack_signs(recv[:, : C // 8]), recv[:, C // 8:].contiguous().view(torch.float32))
        avg = received.mean(0, keepdim=True)  # (1, C): the mean of everyone's piece j
        if plan.names[0] in self.server:
            avg = avg + torch.cat([self.server[name] for name in plan.names]).unsqueeze(0)
        avg = avg * mine
        scale2 = plan.scales(avg, plan.counts[j:j + 1])  # (1, groups)
        packed2 = pack_signs(avg)  # (1, C/8)
        err = (avg - plan.expand(unpack_signs(packed2), scale2)) * mine
        for name, e in zip(plan.names, err[0].split(plan.pieces)):
            self.server[name] = e
        send = torch.cat([packed2.to(dev), scale2.view(torch.uint8)], dim=1)[0]
        out = torch.empty(p * send.numel(), dtype=torch.uint8, device=dev)
        dist.all_gather_single(out, send, group=self.group)
        out = out.view(p, -1)
        Y = plan.expand(unpack_signs(out[:, : C // 8]), out[:, C // 8:].contiguous().view(torch.float32).view(p, G))
        flat.copy_(torch.cat(plan.from_matrix(Y)).to(flat.dtype))
        return flat

    def state(self) -> dict[str, torch.Tensor]:
        return {**{f"{n}|worker": t for n, t in self.worker.items()}, **{f"{n}|server": t for n, t in self.server.items()}}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for key, t in state.items():
            name, kind = key.rsplit("|", 1)
            (self.worker if kind == "worker" else self.server)[name] = t


# -- PowerSGD ---------------------------------------------------------------------------------------------------------

class PowerSGD:
    """torch's powerSGD_hook, with its error feedback and warm-start Q matrices kept per parameter."""

    def __init__(self, group, rank: int, warmup_steps: int, seed: int, meter: CommMeter):
        # lazy: torch's DDP comm hooks (~0.3 s per launch), for compressed runs only
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        self.ps, self.group, self.meter, self.seed = ps, group, meter, seed
        self.p = dist.get_world_size(group)
        # torch asks for >= 2 warm-up iterations (DDP rebuilds its buckets after the first); a caller without
        # buckets (local SGD's pseudo-gradient, `mean_`) compresses from the first call
        self.state = ps.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                      start_powerSGD_iter=max(warmup_steps, 2), min_compression_rate=2,
                                      use_error_feedback=True, warm_start=True, random_seed=seed)
        self.state.start_powerSGD_iter = warmup_steps
        self.error: dict[str, torch.Tensor] = {}  # per parameter, this rank's (numel)
        self.q: dict[str, torch.Tensor] = {}  # per compressed parameter, (m x r), the same on every rank

    def _layout(self, tensors, names):
        """PowerSGD's own split of a bucket: (compressed [(name, n, m, r)] in the order of its Q buffer, which groups
        tensors by shape, uncompressed numel)."""
        by_shape: dict = {}
        uncompressed = 0
        for t, name in zip(tensors, names):
            matrix = powersgd_matrix(tuple(t.shape), self.state.matrix_approximation_rank)
            if matrix is None:
                uncompressed += t.numel()
            else:
                by_shape.setdefault(matrix[:2], []).append((name, *matrix))
        return [c for group in by_shape.values() for c in group], uncompressed

    def hook(self, names_of: dict[int, str], bucket):
        st, p = self.state, self.p
        flat = bucket.buffer()
        full = all_reduce_wire(4 * flat.numel(), p)
        if st.iter < st.start_powerSGD_iter:
            self.meter.add(all_reduce_wire(flat.numel() * flat.element_size(), p), full)
            return self.ps.powerSGD_hook(st, bucket)
        params, tensors = bucket.parameters(), bucket.gradients()
        names = [names_of[id(q)] for q in params]
        compressed, uncompressed = self._layout(tensors, names)
        idx, dev = bucket.index(), flat.device
        st.error_dict[idx] = torch.cat([self.error.get(n, torch.zeros(t.numel(), device=dev))
                                        for n, t in zip(names, tensors)])
        qs = []
        for name, n, m, r in compressed:
            if name not in self.q:  # first compressed step: a random start seeded by the parameter's name
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
                self.q[name] = torch.randn(m, r, generator=g).to(dev)
            qs.append(self.q[name].reshape(-1))
        st.q_memory_dict[idx] = torch.cat(qs) if qs else torch.zeros(0, device=dev)
        st.p_memory_dict[idx] = torch.empty(sum(n * r for _, n, _, r in compressed), device=dev)  # scratch
        pq = sum((n + m) * r for _, n, m, r in compressed)
        self.meter.add(all_reduce_wire(4 * (pq + uncompressed), p), full)

        def keep(fut):
            for name, err in zip(names, st.error_dict[idx].split([t.numel() for t in tensors])):
                self.error[name] = err.clone()
            q_all, off = st.q_memory_dict[idx], 0
            for name, n, m, r in compressed:
                self.q[name] = q_all[off:off + m * r].view(m, r).clone()
                off += m * r
            for d in (st.error_dict, st.q_memory_dict, st.p_memory_dict):
                d.pop(idx, None)
            return fut.value()

        return self.ps.powerSGD_hook(st, bucket).then(keep)

    def mean_(self, flat: torch.Tensor, named_shapes: list[tuple[str, tuple[int, ...]]], index: int = 0):
        """Start replacing `flat` (the concatenated tensors named, of these shapes) by its compressed mean over the
        group, as a bucket `index` of DDP's would be: the future of `flat` (local SGD's pseudo-gradient)."""
        bucket = _FlatBucket(flat, [shape for _, shape in named_shapes], index)
        names = {id(v): name for v, (name, _) in zip(bucket.parameters(), named_shapes)}
        return self.hook(names, bucket)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**{f"{n}|error": t for n, t in self.error.items()}, **{f"{n}|q": t for n, t in self.q.items()},
                "|iter": torch.tensor(self.state.iter)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for key, t in state.items():
            name, kind = key.rsplit("|", 1)
            if kind == "iter":
                self.state.iter = int(t)
            else:
                (self.error if kind == "error" else self.q)[name] = t


class _FlatBucket:
    """A flat fp32 buffer of named tensors, presented as DDP's GradBucket is to torch's powerSGD_hook (one bucket,
    the last of its iteration)."""

    def __init__(self, flat: torch.Tensor, shapes: list[tuple[int, ...]], index: int):
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        self.flat, self.number = flat, index
        self.views = [v.view(s) for v, s in zip(flat.split(sizes), shapes)]

    def buffer(self) -> torch.Tensor:
        return self.flat

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def parameters(self) -> list[torch.Tensor]:
        return self.views

    def index(self) -> int:
        return self.number

    def is_last(self) -> bool:
        return True


class ReplicaReducer:
    """The mean over the replicas (a `group`) of a capability's flat tensors (local SGD's pseudo-gradient), with the
    per-step methods: none (an all-reduce in the tensor's dtype), sign_ef and powersgd (their error feedback and Q per
    named tensor: this rank's state, saved by the capability). Made by `GradComm.replica_reducer`; the bytes count in
    the step's comm_bytes."""

    def __init__(self, comm: "GradComm", compression, group):
        self.comm, self.group = comm, group
        self.meter = CommMeter()  # the compressor's bytes of one `start`, handed on to the run's meter
        self.compressor: SignEF | PowerSGD | None = None
        if compression.one_bit:
            self.compressor = SignEF(group, self.meter, compression.sign_ef_block, compression.sign_ef_warmup_steps)
        elif compression.low_rank:
            self.compressor = PowerSGD(group, compression.powersgd_rank, compression.powersgd_warmup_steps, comm.seed,
                                       self.meter)

    def start(self, flat: torch.Tensor, named_shapes: list[tuple[str, tuple[int, ...]]], index: int = 0):
        """Launch the mean of `flat` (the named tensors of these shapes, concatenated; `index` tells calls with other
        tensors apart): (finish, bytes this rank sends); `finish()` waits and returns the mean (in `flat`'s dtype)."""
        c = self.compressor
        if c is None:
            return self.comm.replica_mean_start(flat, self.group)
        if isinstance(c, SignEF):  # its all-to-all in flight; the all-gather at the finish
            started = c.start(flat, [(name, math.prod(shape)) for name, shape in named_shapes])

            def finish() -> torch.Tensor:
                return c.finish(*started)
        else:
            # torch's hook issues its second and third all-reduces from completion callbacks, which must not
            # interleave with the caller's next collectives: all three finish here
            c.mean_(flat, named_shapes, index).wait()

            def finish() -> torch.Tensor:
                return flat
        sent, full = self.meter.take()
        self.comm.meter.add(sent, full)
        return finish, sent

    def state(self) -> dict[str, torch.Tensor]:
        c = self.compressor
        return {} if c is None else c.state() if isinstance(c, SignEF) else c.state_tensors()

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.compressor is not None:
            self.compressor.load(state)


# -- the run's gradient communication --------------------------------------------------------------------------------

class GradComm:
    """One run's data-parallel gradient communication settings (`[parallel]`), hooks, state and byte counts.

    `parallelize` asks it for FSDP's mesh and reduce dtype, calls `attach_fsdp` after `fully_shard` (prefetching,
    hsdp's replicate hook) and `attach_ddp` after wrapping DDP; the trainer logs `step_metrics` and checkpoints
    `state_dict`.

    An optimizer that communicates itself (1-bit Adam, 0/1 Adam: `OptimizerEntry.compression`) brings its schedule
    (`OptimizerEntry.schedule`): the hooks then do what it says for each step's gradients (fp32 mean, 1-bit mean, or nothing,
    leaving each rank its own), the optimizer averages its momenta through `momentum_mean_` (the same SignEF and
    error feedback), and its per-rank state (`attach_optimizer`) is checkpointed with the residuals."""

    def __init__(self, run, dims, device: torch.device, seed: int = 0, reduction: GradReduction | None = None):
        """`run`: the run's DDP bucket size and FSDP prefetching (`ddp_bucket_mb`, `fsdp_forward_prefetch`,
        `fsdp_backward_prefetch`: a Recipe's, or a `[parallel]` section's); `reduction`: what the reduction runs on
        this layout (the compressors' ranks, blocks and warm-ups in its `compression`), decided by the capability
        (`GradReduction.of_run(recipe.compression, layout, ...)`, with an optimizer's schedule; None: none)."""
        reduction = reduction or GradReduction()
        self.dims, self.layout, self.device, self.seed = dims, dims.layout, device, seed
        self.method = reduction.name  # the method, or the optimizer's name: names the state in checkpoints, notices
        self.compression = reduction.compression  # the collective it holds state for (1-bit Adam's: its own)
        self.schedule = reduction.schedule  # an optimizer's (1-bit Adam's MomentumSchedule), None for the others
        self.site = reduction.site
        self.step = 0  # the optimizer step being reduced (start_step)
        self.optimizer = None  # an optimizer with per-rank state (attach_optimizer)
        self.bucket_mb = run.ddp_bucket_mb
        self.forward_prefetch, self.backward_prefetch = run.fsdp_forward_prefetch, run.fsdp_backward_prefetch
        c = self.compression
        self.powersgd_rank, self.powersgd_warmup = c.powersgd_rank, c.powersgd_warmup_steps
        self.sign_block, self.sign_warmup = c.sign_ef_block, c.sign_ef_warmup_steps
        self.meter = CommMeter()
        self.compressor: SignEF | PowerSGD | None = None
        self.models: list[nn.Module] = []  # what was laid out (a pipeline rank: its stages)
        self.plain_per_micro = self.plain_per_step = 0.0  # (sent, uncompressed) computed from gradient sizes
        self.full_per_micro = self.full_per_step = 0.0
        # a capability that keeps the replicas' gradients apart (Capability.local_replicas: local SGD) synchronises them
        # itself: no reduction over dp_replicate here (FSDP shards within a replica, DDP's hook leaves each gradient)
        self.replicas_apart = any(c.local_replicas for c in getattr(run, "capabilities", ()))
        self.riders: dict[str, object] = {}  # name -> per-rank state saved beside ours (`add_rider`)
        self.noted: dict = {}  # the riders' metrics of the step (`note_metrics`)

    @classmethod
    def default(cls, dims, device: torch.device, ddp_bucket_mb: float = 25.0) -> "GradComm":
        """The `[parallel]` defaults: no compression, FSDP2's own prefetching (the memory harness and benches)."""
        return cls(ParallelConfig(ddp_bucket_mb=ddp_bucket_mb), dims, device)

    # -- FSDP -----------------------------------------------------------------------------------------------------
    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.site is CompressionSite.REDUCE_DTYPE else torch.float32

    def fsdp_mesh(self):
        """hsdp with a replicate hook: FSDP shards over dp_shard only; the hook all-reduces over dp_replicate."""
        if self.site is CompressionSite.REPLICATE_HOOK:
            return self.dims.mesh["dp_shard"]
        if self.replicas_apart and self.layout.hybrid:  # each replica shards over its own ranks (x cp)
            return self.dims.shard_mesh or self.dims.mesh["dp_shard"]
        return self.dims.fsdp_mesh

    def expert_fsdp_mesh(self, mesh):
        """The mesh FSDP shards expert-parallel experts over (`mesh`: expert_parallel's, dp_replicate x
        dp_shard_mod_ep under hsdp): with local replicas (`replicas_apart`) each replica's own ranks, as `fsdp_mesh`."""
        return mesh["dp_shard_mod_ep"] if self.replicas_apart and self.layout.hybrid else mesh

    def attach_fsdp(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """After fully_shard: explicit prefetching, and hsdp's compressed replicate all-reduce."""
        for i, block in enumerate(blocks):
            if self.forward_prefetch > 0:
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + self.forward_prefetch])
            if self.backward_prefetch > 1 and i > 0:
                block.set_modules_to_backward_prefetch(blocks[max(0, i - self.backward_prefetch):i][::-1])
        if self.site is CompressionSite.REPLICATE_HOOK:
            if self.compressor is None:
                self.compressor = self._sign_ef(self.dims.mesh["dp_replicate"].get_group())
            for module in [model, *blocks]:
                module.set_all_reduce_hook(self._fsdp_hook(module))
        self.models.append(model)

    def _fsdp_hook(self, module: nn.Module):
        segments: list[tuple[str, int]] = []

        def hook(reduce_output: torch.Tensor) -> None:
            if not segments:
                group = module._get_fsdp_state()._fsdp_param_group
                segments.extend((canonical_name(fp._param_fqn), fp.padded_sharded_param_size.numel())
                                for fp in group.fsdp_params)
                if sum(n for _, n in segments) != reduce_output.numel():  # not laid out as expected: one piece
                    segments[:] = [(f"{segments[0][0]}+{len(segments)}", reduce_output.numel())]
            self._reduce(reduce_output, segments)

        return hook

    def _sign_ef(self, group) -> SignEF:
        """sign_ef's compressor; an optimizer's schedule decides its own warm-up."""
        return SignEF(group, self.meter, self.sign_block, 0 if self.schedule else self.sign_warmup)

    def _reduce(self, flat: torch.Tensor, segments: list[tuple[str, int]]) -> torch.Tensor:
        """A flat gradient buffer averaged over the group by sign_ef, or as the optimizer's schedule says."""
        how = self.schedule.gradient(self.step) if self.schedule is not None else GradientReduction.ONE_BIT
        if how is GradientReduction.LOCAL:  # each rank keeps its gradient: the optimizer averages the momenta instead
            return flat
        if how is GradientReduction.MEAN:
            return exact_mean_(flat, self.compressor.group, self.meter)
        return self.compressor.mean_(flat, segments)

    # -- DDP ------------------------------------------------------------------------------------------------------
    def attach_ddp(self, ddp: nn.Module) -> None:
        """After wrapping DDP (ddp, zero1): the compression hook, if any."""
        self.models.append(ddp)
        if self.replicas_apart:  # every rank a replica: its own gradient, unreduced
            def local(state, bucket):
                fut = torch.futures.Future(devices=[bucket.buffer().device] if bucket.buffer().is_cuda else None)
                fut.set_result(bucket.buffer())
                return fut

            ddp.register_comm_hook(None, local)
            return
        if self.site is not CompressionSite.DDP_HOOK:
            return
        group = self.dims.dp_group
        p = dist.get_world_size(group)
        names = {id(q): canonical_name(n) for n, q in ddp.module.named_parameters()}
        meter, sync = self.meter, self.device.type == "cpu"
        if self.compression.casts_to_bf16:
            # lazy: torch's DDP comm hooks (~0.3 s per launch), for compressed runs only
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            def hook(state, bucket):
                n = bucket.buffer().numel()
                meter.add(all_reduce_wire(2 * n, p), all_reduce_wire(4 * n, p))
                return bf16_compress_hook(state, bucket)
        elif self.compression.low_rank:
            self.compressor = PowerSGD(group, self.powersgd_rank, self.powersgd_warmup, self.seed, meter)

            def hook(state, bucket):
                fut = self.compressor.hook(names, bucket)
                if sync:  # gloo: finish this bucket's chained collectives before the next bucket issues its own
                    fut.wait()
                return fut
        else:  # sign_ef, or an optimizer's schedule
            self.compressor = self._sign_ef(group)

            def hook(state, bucket):
                # Both phases here, in order: on gloo a collective issued from a completion callback could overtake
                # the next bucket's; on NCCL the collectives are ordered on the streams and the CPU does not wait.
                flat = bucket.buffer()
                segments = [(names[id(q)], q.numel()) for q in bucket.parameters()]
                fut = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
                fut.set_result(self._reduce(flat, segments))
                return fut
        ddp.register_comm_hook(group, hook)

    # -- per step -------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The bytes of the reductions no hook counts, from the gradient sizes (after the model is laid out)."""
        lay = self.layout
        if lay.dp == 1:
            return
        if lay.uses_ddp:
            if self.site is CompressionSite.NONE and not self.replicas_apart:
                numel = sum(q.numel() for m in self.models for q in m.parameters())
                self.plain_per_step = self.full_per_step = all_reduce_wire(4 * numel, lay.dp)
            return
        # FSDP: each rank reduce-scatters its (tp-local) gradients over dp_shard, every micro-step (once per step in
        # a pipeline); hsdp then all-reduces the shard over dp_replicate (counted by the hook when it compresses).
        shard = sum(local_tensor(q).numel() for m in self.models for q in m.parameters())  # padded shards
        rbytes = 2 if self.reduce_dtype == torch.bfloat16 else 4
        sent = scatter_wire(rbytes * shard * lay.dp_shard, lay.dp_shard)
        full = scatter_wire(4 * shard * lay.dp_shard, lay.dp_shard)
        if lay.hybrid and self.site is not CompressionSite.REPLICATE_HOOK and not self.replicas_apart:
            sent += all_reduce_wire(rbytes * shard, lay.dp_replicate)
            full += all_reduce_wire(4 * shard, lay.dp_replicate)
        if lay.pp > 1:
            self.plain_per_step, self.full_per_step = sent, full
        else:
            self.plain_per_micro, self.full_per_micro = sent, full

    def start_step(self, step: int) -> None:
        """Before optimizer step `step` (0-based, the run's own count: a resumed run continues it)."""
        self.step = step
        self.meter.take()
        if isinstance(self.compressor, SignEF):
            self.compressor.step = step
            if self.schedule is not None and self.schedule.resets_residuals(step):
                self.compressor.worker.clear()
                self.compressor.server.clear()

    # -- an optimizer that communicates itself ----------------------------------------------------------------------
    @property
    def local_gradients(self) -> bool:
        """This step's gradients stayed on their ranks (each differs): the gradient norm is agreed over the
        `replica_group`."""
        return self.schedule is not None and self.schedule.gradient(self.step) is GradientReduction.LOCAL

    @property
    def replica_group(self):
        return self.compressor.group

    def parameter_names(self) -> dict[int, str]:
        """id(parameter) -> its canonical name, for what was laid out."""
        return {id(q): canonical_name(n) for m in self.models for n, q in m.named_parameters()}

    def attach_optimizer(self, optimizer) -> None:
        """`optimizer.rank_state()` / `load_rank_state()` (tensors that differ between ranks, keys `name|kind` with
        kinds `optimizer.RANK_KINDS`) go into checkpoints beside the residuals."""
        self.optimizer = optimizer

    def momentum_mean_(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Replace every rank's tensors (momenta, accumulated updates) by their mean over the group, through the 1-bit
        all-reduce with error feedback, one `ddp_bucket_mb` bucket at a time (the result does not depend on the
        buckets: the compression is per tensor)."""
        limit = max(1, int(self.bucket_mb * 2**20) // 4)
        buckets, size = [[]], 0
        for name, t in named:
            if buckets[-1] and size + t.numel() > limit:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += t.numel()
        for bucket in buckets:
            sizes = [t.numel() for _, t in bucket]
            flat = torch.cat([t.reshape(-1) for _, t in bucket])
            self.compressor.mean_(flat, [(name, n) for (name, _), n in zip(bucket, sizes)])
            for (_, t), piece in zip(bucket, flat.split(sizes)):
                t.copy_(piece.view_as(t))

    def silent_round(self, numel: int) -> None:
        """A step that sends nothing (0/1 Adam's local steps), counted against the fp32 all-reduce it replaces."""
        self.meter.add(0.0, all_reduce_wire(4 * numel, dist.get_world_size(self.replica_group)))

    def step_metrics(self, micro_steps: int) -> dict:
        """comm_bytes and compression_ratio of the step just finished (data-parallel layouts only), and the riders'
        metrics (`note_metrics`)."""
        noted, self.noted = self.noted, {}
        if self.layout.dp == 1:
            return noted
        sent, full = self.meter.take()
        sent += self.plain_per_step + micro_steps * self.plain_per_micro
        full += self.full_per_step + micro_steps * self.full_per_micro
        return {"comm_bytes": sent, "compression_ratio": sent / full if full else 1.0, **noted}

    # -- riders: a capability's collectives over the replicas, per-rank state and metrics (local SGD's outer step)
    def add_rider(self, name: str, rider) -> None:
        """`rider.state()` ({key: tensor}, this rank's) is saved in checkpoints beside ours, `rider.load(state)`
        called on resume (after the model and optimizer are loaded)."""
        self.riders[name] = rider

    def note_metrics(self, metrics: dict) -> None:
        """Host numbers for the step's record (`step_metrics`)."""
        self.noted.update(metrics)

    def replica_reducer(self, compression, group) -> ReplicaReducer:
        """A capability's mean over `group` with `compression` (a capabilities.grad_compression.Compression)."""
        return ReplicaReducer(self, compression, group)

    def replica_mean_start(self, flat: torch.Tensor, group):
        """The mean of `flat` over `group` (an all-reduce in its dtype), launched asynchronously: (finish, bytes this
        rank sends); `finish()` waits for the all-reduce and divides, returning `flat` (the mean). The bytes are counted
        now in comm_bytes (against the fp32 all-reduce of the same values)."""
        p = dist.get_world_size(group)
        work = dist.all_reduce(flat, group=group, async_op=True)
        sent = all_reduce_wire(flat.numel() * flat.element_size(), p)
        self.meter.add(sent, all_reduce_wire(4 * flat.numel(), p))

        def finish() -> torch.Tensor:
            work.wait()
            return flat.div_(p)

        return finish, sent

    @staticmethod
    def canonical(name: str) -> str:
        return canonical_name(name)

    def missing_state(self, path) -> str:
        """A checkpoint without this layout's per-rank state: ours starts from zero, the riders from the loaded
        weights (`rider.restart()`); the notice saying so."""
        for rider in self.riders.values():
            rider.restart()
        if self.compressor is None:
            return (f"{path}: no {', '.join(self.riders)} state for this layout (saved by another layout or world "
                    "size): a new round starts from the loaded weights")
        return (f"{path}: no {self.method} state for this layout (saved with another compression or world size): "
                "error feedback starts from zero")

    @property
    def has_state(self) -> bool:
        """Whether checkpoints hold per-rank state of ours (a compressor's, an optimizer's) or a rider's."""
        return self.compressor is not None or bool(self.riders)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _prefix(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return f"{STATE_PREFIX}/{self.method}/w{self.layout.world_size}/rank{rank}/"

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's compression state (error feedback, PowerSGD's Q and step) and its riders', under rank-specific
        keys."""
        state = {f"{name}:{key}": t for name, rider in self.riders.items() for key, t in rider.state().items()}
        if self.compressor is None:
            prefix = self._prefix()
            return {prefix + key: t.detach() for key, t in state.items()}
        state.update(self.compressor.state() if isinstance(self.compressor, SignEF)
                     else self.compressor.state_tensors())
        if self.optimizer is not None:
            state.update(self.optimizer.rank_state())
        prefix = self._prefix()
        return {prefix + key: t.detach() for key, t in state.items()}

    def saved_keys(self, metadata) -> dict:
        """This rank's entries in a checkpoint's DCP metadata: {key: TensorStorageMetadata} (empty if none)."""
        if not self.has_state:
            return {}
        prefix = self._prefix()
        return {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        prefix = self._prefix()
        tensors = {k[len(prefix):]: v.to(self.device) for k, v in state.items()}
        for name, rider in self.riders.items():
            mine = f"{name}:"
            rider.load({k[len(mine):]: v for k, v in tensors.items() if k.startswith(mine)})
            tensors = {k: v for k, v in tensors.items() if not k.startswith(mine)}
        if self.compressor is None:
            return
        if self.optimizer is not None:
            kinds = self.optimizer.RANK_KINDS
            self.optimizer.load_rank_state({k: v for k, v in tensors.items() if k.rsplit("|", 1)[1] in kinds})
            tensors = {k: v for k, v in tensors.items() if k.rsplit("|", 1)[1] not in kinds}
        self.compressor.load(tensors)
