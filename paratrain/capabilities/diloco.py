"""DiLoCo (Douillard et al. 2023) and its streaming form (2025): data parallelism across slow links
(`[parallel] dp_sync = "diloco"`, the `[diloco]` section; docs/layouts.md).

The replicas are the `dp_replicate` groups (ddp: one rank each; hsdp: FSDP inside each replica, and tp, pp, cp
and ep within it as usual: ep borrows its ranks from dp_shard). Their gradients are never reduced across replicas
(GradComm keeps them apart: FSDP shards the blocks and the experts over the replica's own ranks, DDP's hook leaves
each rank its gradient). Each replica takes H = `inner_steps` steps of the
run's optimizer on its share of the global batch, then the replicas average the pseudo-gradient (the round's starting
weights minus the current ones) and an outer SGD step (Nesterov, `outer_lr`, `outer_momentum`) moves the shared
weights from the round's start:

    delta = mean over replicas (theta_start - theta)        one all-reduce per fragment and round
    m     = momentum m + delta
    theta = theta_start - outer_lr (nesterov ? delta + momentum m : m);  theta_start = theta

With H = 1, outer_lr = 1 and momentum 0 this is data parallelism for an inner optimizer linear in the gradient (SGD,
with momentum and weight decay): each replica's step is theta - lr g_r, their mean theta - lr mean(g). AdamW is not
(each replica normalises its own gradient by its own moments), so the verify rows train with SGD.

Streaming (`fragments` F): the model's blocks in F contiguous groups (the embedding with the first, the head with the
last), fragment f synchronised after the steps n (1-based) with n mod H = (f + 1) H / F mod H, each with its own
start and momentum: the same bytes per round, spread over it.

Overlap (streaming DiLoCo, Douillard et al. 2025; F > 1): fragment f's pseudo-gradient is sent after step n without
waiting (an async all-reduce), the replica goes on with step n + 1, and the all-reduce is waited for after step n + 1
(tau = 1 step later), where the outer step is applied. The replica's own progress on the fragment during that step is
kept on top of the outer result (the merge rule):

    theta_start = theta_start - outer step(mean delta)          as above, with the delta sent after step n
    theta       = theta_start + (theta_now - theta_sent)        theta_sent: this replica's weights when it sent

(the paper mixes alpha theta_now + (1 - alpha) theta_outer instead; this rule keeps the overlapped step's whole
update, and with it applied at once it is the blocking synchronisation). F = 1 waits at once (today's blocking
synchronisation, bitwise), and so does the run's last step (no step follows to overlap with: the final weights are
synchronised). A checkpoint saved while an all-reduce is in flight waits for it and saves the mean beside this
replica's weights at the send, still to be applied at step n + 1: the resumed run applies it where the straight one
does, bit for bit.

`outer_compression` (the per-step gradient compressors of distributed/compression.py, applied to the
pseudo-gradient; their per-rank state saved with the rest): bf16 casts it (as `outer_dtype = bf16`); sign_ef sends its
signs and scales with error feedback (`parallel.sign_ef_block`; no warm-up), its all-to-all overlapped and its
all-gather at the wait; powersgd sends rank-`parallel.powersgd_rank` factors with error feedback and warm-started Q
(no warm-up), its chained all-reduces run at the send (torch's hook issues them from completion callbacks, which must
not interleave with the next step's collectives), the outer step still applied one step later.

State: the round's starting weights and the outer momentum, and (mid-round the replicas differ) each replica's own
weights and inner optimizer state, saved per rank beside the gradient-compression state (GradComm's riders); a
checkpoint of the same layout resumes mid-round exactly. Metrics (metrics.jsonl): `diloco_bytes` (bytes this rank
sent across replicas at the step, 0 on inner steps) and `diloco_drift` (this replica's pseudo-gradient norm before
averaging) on the steps that send, `diloco_outer_norm` (the outer step's norm) and `diloco_wait_s` (the host's wait
for the mean) on the steps that apply (the same step when not overlapped).

Torch-free at the top: torch inside the hooks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from paratrain.capabilities.base import Capability, PlanRow
from paratrain.capabilities.grad_compression import Compression, GradCompression, powersgd_matrix
from paratrain.errors import ConfigError, UserError
from paratrain.modes import WeightDtype

DPSync = Literal["every_step", "diloco"]
RIDER = "diloco"  # its name among GradComm's per-rank states (checkpoint keys)
IN_FLIGHT = "in_flight|"  # its state's keys of a fragment sent and not yet applied (an overlapped synchronisation)
OUTER = "outer."  # its state's keys of the outer compressor's error feedback (and PowerSGD's Q)
# H = 1, outer lr 1, no momentum, SGD without clipping (per replica it would clip another norm): data parallelism,
# the settings of every verify row
DATA_PARALLEL = ("parallel.dp_sync=diloco", "diloco.inner_steps=1", "diloco.outer_lr=1", "diloco.outer_momentum=0",
                 "optimizer.name=sgd", "training.grad_clip=0")


@dataclass
class DPSyncKeys:
    # how data-parallel replicas (dp_replicate: ddp's ranks, hsdp's replicas) agree: every_step (all-reduce the
    # gradients) | diloco (local steps, then the pseudo-gradient: the [diloco] section)
    dp_sync: DPSync = "every_step"


@dataclass
class DiLoCoConfig:
    """DiLoCo across the data-parallel replicas (with `parallel.dp_sync = "diloco"`; docs/layouts.md)."""

    inner_steps: int = 100  # H: the replicas' local optimizer steps between synchronisations
    outer_lr: float = 0.7  # the outer SGD's learning rate on the averaged pseudo-gradient
    outer_momentum: float = 0.9  # the outer SGD's momentum (0: none)
    nesterov: bool = True  # Nesterov momentum for the outer step
    fragments: int = 1  # streaming DiLoCo: the blocks in this many groups, one synchronised every H / fragments steps
    outer_dtype: WeightDtype = "fp32"  # the pseudo-gradient's dtype on the wire: fp32 or bf16 (half the bytes)
    # the gradient compressor applied to the pseudo-gradient's all-reduce: none | bf16 (a cast) | sign_ef (1 bit per
    # element, error feedback; parallel.sign_ef_block) | powersgd (rank parallel.powersgd_rank, error feedback)
    outer_compression: GradCompression = "none"


def syncs_with_diloco(parallel) -> bool:
    """A `[parallel]` section's replicas agree by DiLoCo."""
    return parallel.dp_sync == "diloco"


@dataclass(frozen=True)
class DiLoCo(Capability):
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    wire_bf16: bool = False  # outer_dtype or outer_compression bf16
    compression: Compression = field(default_factory=Compression)  # outer_compression (rank, block: [parallel]'s)
    # the run's training.steps: its synchronisation is not overlapped (a length, not a setting of the method)
    last_step: int = field(default=0, compare=False)
    # the run's outer loop (torch objects, made by `after_build`): not a setting
    runtime: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    name = "diloco"
    section = DiLoCoConfig
    section_after = "parallel"
    adds_to = ("parallel", DPSyncKeys)
    adds_after = "cp"
    local_replicas = True
    verify_rows = {
        "diloco-ddp2": (2, "ddp", *DATA_PARALLEL),
        "diloco-hsdp2x2": (4, "hsdp,rep=2", *DATA_PARALLEL),
        # every layout inside a replica (two replicas): cp, experts over the replica's ranks, and tp and pp beside
        # FSDP (tp and pp do not compose with ddp, and hsdp needs dp_shard > 1 for them: 8 ranks)
        "diloco-hsdp2x2+tp2": (8, "hsdp,rep=2,tp=2,sp=off", *DATA_PARALLEL),
        "diloco-hsdp2x2+pp2": (8, "hsdp,rep=2,pp=2,sched=1f1b", *DATA_PARALLEL),
        "diloco-hsdp2+cp2": (4, "hsdp,rep=2,cp=2", *DATA_PARALLEL),
        "diloco-hsdp2x2+ep2": (4, "hsdp,rep=2,ep=2", "model.preset=tiny-moe", *DATA_PARALLEL),
    }
    reference_keys = ("training.grad_clip=",)

    @classmethod
    def from_config(cls, cfg) -> "DiLoCo | None":
        if not syncs_with_diloco(cfg.parallel):
            return None
        d = cfg.diloco
        outer = replace(Compression.from_config(cfg.parallel), method=d.outer_compression, powersgd_warmup_steps=0,
                        sign_ef_warmup_steps=0)
        return cls(d.inner_steps, d.outer_lr, d.outer_momentum, d.nesterov, d.fragments,
                   d.outer_dtype == "bf16" or outer.casts_to_bf16, outer, cfg.training.steps)

    @classmethod
    def check(cls, cfg) -> None:
        d = cfg.diloco
        if d.outer_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"diloco.outer_dtype must be fp32 or bf16, got {d.outer_dtype}")
        outer = Compression(d.outer_compression)
        if d.outer_dtype == "bf16" and (outer.one_bit or outer.low_rank):
            raise ConfigError(f"diloco.outer_compression={d.outer_compression} decides what the pseudo-gradient sends:"
                              " diloco.outer_dtype must be fp32 with it")
        if d.inner_steps < 1:
            raise ConfigError(f"diloco.inner_steps must be >= 1, got {d.inner_steps}")
        if not d.outer_lr > 0 or not 0 <= d.outer_momentum < 1:
            raise ConfigError(f"diloco.outer_lr must be > 0 and diloco.outer_momentum in [0, 1), got {d.outer_lr} "
                              f"and {d.outer_momentum}")
        if d.fragments < 1 or d.inner_steps % d.fragments:
            raise ConfigError(f"diloco.fragments ({d.fragments}) must be >= 1 and divide diloco.inner_steps "
                              f"({d.inner_steps}): one fragment is synchronised every inner_steps / fragments steps")
        layers = cfg.model.n_layers
        if syncs_with_diloco(cfg.parallel) and layers and d.fragments > layers:
            raise ConfigError(f"diloco.fragments ({d.fragments}) is more than the model's {layers} blocks")
        if syncs_with_diloco(cfg.parallel) and Compression.from_config(cfg.parallel).enabled:
            raise ConfigError("parallel.grad_compression compresses the per-step gradient all-reduce, which "
                              "parallel.dp_sync=diloco does not run: use diloco.outer_compression")

    def check_layout(self, layout) -> None:
        if layout.dp_replicate < 2:
            raise ConfigError(f"parallel.dp_sync=diloco runs across data-parallel replicas, but {layout.describe()} "
                              "has none: use dp_mode=ddp over several ranks, or hsdp with dp_replicate > 1")
        # (ep borrows its ranks from dp_shard, inside a replica: the experts never spread over replicas)
        if layout.zero1:
            raise ConfigError(f"parallel.dp_sync=diloco keeps each replica's optimizer to itself: {layout.describe()}"
                              " shards it over the replicas (zero1); use ddp, or hsdp for sharding inside a replica")

    @property
    def waits_in_collective_callbacks(self) -> bool:  # (the outer powersgd: torch's hook)
        return self.compression.low_rank

    # -- the estimator and the planner ---------------------------------------------------------------------------
    @classmethod
    def plan_alternative(cls, request, planning, plain) -> "DiLoCoChoice | None":
        return plan_diloco(request, planning, plain)

    def config_values(self) -> dict:
        # (a planned DiLoCo row's written config: Recipe.to_config)
        return {"parallel.dp_sync": "diloco", "diloco.inner_steps": self.inner_steps, "diloco.outer_lr": self.outer_lr,
                "diloco.outer_momentum": self.outer_momentum, "diloco.nesterov": self.nesterov,
                "diloco.fragments": self.fragments, **({"diloco.outer_dtype": "bf16"} if self.wire_bf16 else {})}

    def replica_states(self, numel: int, layout, params) -> tuple[int, str]:
        # OuterLoop's `start` and `momentum`: a copy each of the rank's local parameters (fp32 master weights; the
        # momentum is allocated even at outer_momentum 0, as the checkpoint's state keeps its shape); the outer
        # compressor's state and, overlapped, the fragment in flight (`OuterLoop.held_bytes` counts the same, built)
        total = 2 * numel * 4 + self.compressor_bytes(numel, layout.dp_replicate, [(shape, count) for _, count, shape in params])
        what = ["the round's starting weights and the outer momentum, each a fp32 copy of this rank's parameters"]
        if self.compression.enabled and total > 2 * numel * 4:
            what.append(f"{self.compression.method}'s error feedback" + (" and Q" if self.compression.low_rank else ""))
        if self.fragments > 1:
            total += 2 * 4 * math.ceil(numel * largest_fragment_share(params, self.fragments))
            what.append("the largest fragment's weights at its send and its mean, in flight for a step")
        return total, "DiLoCo: " + "; ".join(what)

    def compressor_bytes(self, numel: int, replicas: int, shapes) -> int:
        """Bytes of the outer compressor's state on a rank holding `numel` elements (`shapes`: (local shape, count)
        of its matrices, for PowerSGD's Q): sign_ef's residuals (this rank's whole pseudo-gradient and its 1 /
        replicas piece), powersgd's error feedback and warm-started Q; 0 for none and bf16."""
        c = self.compression
        if c.one_bit:
            return 4 * (numel + math.ceil(numel / replicas))
        if c.low_rank:
            qs = (powersgd_matrix(tuple(shape), c.powersgd_rank) for shape, count in shapes for _ in range(count))
            return 4 * (numel + sum(m * r for _, m, r in filter(None, qs)))
        return 0

    # -- the step (torch inside) --------------------------------------------------------------------------------
    def after_build(self, model, where) -> None:
        self.runtime["loop"] = OuterLoop(self, model, where)

    def after_optimizer_step(self, model, where) -> None:
        self.runtime["loop"].after_step()


def largest_fragment_share(params, fragments: int) -> float:
    """The share of a rank's parameter elements in its largest fragment (`fragment_of`), from (Param, count, local
    shape) of the model's table: the blocks' 1 / fragments, the embedding's with the first, the head's with the last
    (blocks spread evenly)."""
    where = {"embedding": 0, "block": 0, "head": 0}
    for p, count, shape in params:
        where[p.where] += count * math.prod(shape)
    total = sum(where.values())
    blocks = where["block"] / fragments
    return (max(where["embedding"], where["head"]) + blocks) / total if total else 1 / fragments


def fragment_of(names: list[str], fragments: int) -> list[int]:
    """The fragment of each parameter (names in the model's order): its block's group of contiguous blocks, the
    parameters before the first block with the first group and those after the last with the last."""
    blocks = [_block(n) for n in names]
    known = sorted({b for b in blocks if b is not None})
    if fragments > max(len(known), 1):
        raise UserError(f"diloco.fragments ({fragments}) is more than the {len(known)} blocks this rank holds")
    group = {b: i * fragments // len(known) for i, b in enumerate(known)}
    first = next((i for i, b in enumerate(blocks) if b is not None), len(blocks))
    return [group[b] if b is not None else (0 if i < first else fragments - 1) for i, b in enumerate(blocks)]


def _block(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


@dataclass
class Sent:
    """A fragment's pseudo-gradient on its way: launched after one step, its outer step applied after the next."""

    fragment: int
    mine: list  # the fragment's parameter indices
    weights: list | None  # this replica's weights of them at the send (None: applied at once, nothing to keep)
    finish: object  # waits for the mean and returns it (None once `mean` holds it)
    mean: object = None  # (N,) fp32: the replicas' mean pseudo-gradient


class OuterLoop:
    """One run's DiLoCo on this rank: the fragments' starting weights and outer momenta, the synchronisations (sent
    after one step, applied after the next when overlapped), the per-rank checkpoint state (a GradComm rider) and the
    step's metrics."""

    def __init__(self, setting: DiLoCo, model, where):
        # lazy: torch, only in a run (this module is read by the config checks)
        import torch

        comm = where.comm
        self.torch, self.s, self.comm, self.optimizer = torch, setting, comm, where.optimizer
        self.group = comm.dims.mesh["dp_replicate"].get_group()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [comm.canonical(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.fragment = fragment_of(self.names, setting.fragments)
        with torch.no_grad():
            self.start = [self.local(p).detach().clone() for p in self.params]
            self.momentum = [torch.zeros_like(s) for s in self.start]
        self.reducer = comm.replica_reducer(setting.compression, self.group)
        self.in_flight: Sent | None = None
        self.metrics: dict = {}
        comm.add_rider(RIDER, self)

    def local(self, p):
        return p.to_local() if hasattr(p, "to_local") else p

    def due(self, n: int) -> int | None:
        """The fragment synchronised after the run's n-th step (1-based), or None."""
        H, F = self.s.inner_steps, self.s.fragments
        for f in range(F):
            if n % H == ((f + 1) * H // F) % H:
                return f
        return None

    def after_step(self) -> None:
        n = self.comm.step + 1
        self.metrics = {"diloco_bytes": 0.0}
        if self.in_flight is not None:  # sent after the previous step
            self.apply(self.in_flight)
            self.in_flight = None
        f = self.due(n)
        if f is not None:
            overlap = self.s.fragments > 1 and n < self.s.last_step
            sent = self.send(f, keep_weights=overlap)
            if overlap:
                self.in_flight = sent
            else:
                self.apply(sent)
        self.comm.note_metrics(self.metrics)

    def send(self, f: int, keep_weights: bool) -> Sent:
        """Launch the mean of fragment f's pseudo-gradient over the replicas."""
        torch = self.torch
        mine = [i for i, g in enumerate(self.fragment) if g == f]
        with torch.no_grad():
            weights = [self.local(self.params[i]).detach().clone() for i in mine] if keep_weights else None
            delta = torch.cat([(self.start[i] - self.local(self.params[i]).detach()).reshape(-1).float()
                               for i in mine])  # (N,) this replica's pseudo-gradient
            drift = delta.norm()
            wire = delta.to(torch.bfloat16) if self.s.wire_bf16 else delta
            finish, sent = self.reducer.start(wire, [(self.names[i], tuple(self.start[i].shape)) for i in mine], f)
        # read at the synchronisations only (every H / F steps): the record's numbers are floats
        self.metrics.update(diloco_bytes=sent, diloco_drift=drift.item())
        return Sent(f, mine, weights, finish)

    def wait(self, sent: Sent) -> None:
        """The mean of a sent fragment, waited for; the host's seconds waiting in `diloco_wait_s` (the whole
        all-reduce when it was not overlapped, what the step did not hide when it was)."""
        if sent.finish is not None:
            t0 = time.perf_counter()
            sent.mean, sent.finish = sent.finish().float(), None
            self.metrics["diloco_wait_s"] = time.perf_counter() - t0

    def apply(self, sent: Sent) -> None:
        """The outer step of a sent fragment, from its mean pseudo-gradient; the replica's progress since the send
        kept on top (the module's merge rule)."""
        torch = self.torch
        self.wait(sent)
        mine, delta = sent.mine, sent.mean
        with torch.no_grad():
            m = torch.cat([self.momentum[i].reshape(-1) for i in mine])
            m.mul_(self.s.outer_momentum).add_(delta)
            step = delta.add(m, alpha=self.s.outer_momentum) if self.s.nesterov else m
            step.mul_(self.s.outer_lr)
            outer_norm = step.norm()
            sizes = [self.start[i].numel() for i in mine]
            for k, (i, m_i, step_i) in enumerate(zip(mine, m.split(sizes), step.split(sizes))):
                self.momentum[i].copy_(m_i.view_as(self.momentum[i]))
                self.start[i].sub_(step_i.view_as(self.start[i]).to(self.start[i].dtype))
                weight = self.local(self.params[i])
                progress = None if sent.weights is None else weight - sent.weights[k]  # trained since the send
                weight.copy_(self.start[i])
                if progress is not None:
                    weight.add_(progress)
        self.metrics["diloco_outer_norm"] = outer_norm.item()

    def held_bytes(self) -> int:
        """Bytes of the copies it keeps beside the model states (the dry run's count; `DiLoCo.replica_states`):
        the starts and momenta, the compressor's state (allocated at its first send: counted from the parameters),
        and with overlap the largest fragment's weights and mean in flight."""
        sizes = [t.numel() for t in self.start]
        held = sum(t.numel() * t.element_size() for t in (*self.start, *self.momentum))
        c = self.s.compression
        if c.one_bit:  # the worker residuals, and the server's of this rank's padded pieces (distributed/compression)
            unit, p = c.sign_ef_block or 8, self.group.size()
            held += 4 * sum(n + -(-n // (unit * p)) * unit for n in sizes)
        else:
            held += self.s.compressor_bytes(sum(sizes), self.group.size(), [(tuple(t.shape), 1) for t in self.start])
        if self.s.fragments > 1:
            held += 2 * 4 * max(sum(n for n, g in zip(sizes, self.fragment) if g == f) for f in range(self.s.fragments))
        return held

    # -- a GradComm rider: this rank's state in checkpoints -------------------------------------------------------
    def state(self) -> dict:
        """Per parameter: the fragment's start and momentum, and (mid-round the replicas differ) this replica's
        weights and its optimizer's state; the compressor's state; a fragment in flight (waited for here): its mean
        and this replica's weights at the send, applied after the next step as in the run that goes on."""
        out = {}
        for name, p, start, m in zip(self.names, self.params, self.start, self.momentum):
            out[f"{name}|start"], out[f"{name}|momentum"] = start, m
            out[f"{name}|weight"] = self.local(p).detach()
            for key, t in self.optimizer_state(p).items():
                out[f"{name}|opt.{key}"] = self.local(t)
        sent = self.in_flight
        if sent is not None:
            self.wait(sent)
            out[IN_FLIGHT + "fragment"] = self.torch.tensor(sent.fragment)
            out[IN_FLIGHT + "mean"] = sent.mean
            for i, w in zip(sent.mine, sent.weights):
                out[f"{self.names[i]}|sent"] = w
        out.update({OUTER + key: t for key, t in self.reducer.state().items()})
        return out

    def optimizer_state(self, p) -> dict:
        inner = getattr(self.optimizer, "optim", self.optimizer)  # (a wrapped optimizer: its local one)
        return {k: t for k, t in inner.state.get(p, {}).items()
                if self.torch.is_tensor(t) and t.dim() > 0}

    def restart(self) -> None:
        """A checkpoint without this state (another layout's, or plain data parallelism's): a new round from the
        loaded weights."""
        with self.torch.no_grad():
            for p, start, m in zip(self.params, self.start, self.momentum):
                start.copy_(self.local(p))
                m.zero_()
        self.in_flight = None
        self.reducer = self.comm.replica_reducer(self.s.compression, self.group)

    def load(self, state: dict) -> None:
        with self.torch.no_grad():
            for name, p, start, m in zip(self.names, self.params, self.start, self.momentum):
                start.copy_(state[f"{name}|start"])
                m.copy_(state[f"{name}|momentum"])
                self.local(p).copy_(state[f"{name}|weight"])
                for key, t in self.optimizer_state(p).items():
                    saved = state.get(f"{name}|opt.{key}")
                    if saved is not None:
                        self.local(t).copy_(saved)
        self.in_flight = None
        if IN_FLIGHT + "fragment" in state:
            f = int(state[IN_FLIGHT + "fragment"])
            mine = [i for i, g in enumerate(self.fragment) if g == f]
            self.in_flight = Sent(f, mine, [state[f"{self.names[i]}|sent"] for i in mine], None,
                                  state[IN_FLIGHT + "mean"])
        self.reducer.load({k[len(OUTER):]: t for k, t in state.items() if k.startswith(OUTER)})


# -- the planner: one DiLoCo replica per node, a ranked row of the plain plan (`paratrain plan --inter-node-bandwidth`)

DILOCO_INNER_STEPS = (10, 50, 100)  # the H the planner tries for DiLoCo (`plan_diloco`)
DILOCO_SYNC_SHARE = 0.05  # the smallest H whose amortised synchronisation is at most this share of a step
# DiLoCo trains differently from data parallelism, so the plan ranks it only where it saves at least this share of
# the fastest every-step layout's step (where the all-reduce across nodes dominates); on a fast link it saves little
DILOCO_MIN_SAVING = 0.25


@dataclass(frozen=True)
class DiLoCoChoice:
    """`paratrain plan --inter-node-bandwidth`: a replica per node, each laid out as one node's first choice on its
    share of the batch (FSDP inside), the pseudo-gradient all-reduced across nodes every H steps; a ranked row (`rows`)
    where it saves at least DILOCO_MIN_SAVING of the fastest every-step layout's step: the plain first choice's, or
    the same replicas' all-reducing the gradient every step (hsdp), whichever is faster."""

    replicas: int
    layout: str  # the whole run's layout: hsdp, a replica per node
    inner_steps: int  # H
    step_s: float  # per step, the synchronisation amortised over H
    every_layout: str  # the fastest every-step layout
    every_step_s: float
    every_comm_s: float  # its exposed communication per step
    plain_layout: str  # the plain first choice
    plain_step_s: float
    sync_bytes: float  # bytes a rank sends per synchronisation
    link: str
    row: object = None  # its PlanRow, None when not ranked

    @property
    def rows(self) -> list:
        return [self.row] if self.row is not None else []

    @property
    def first(self) -> bool:
        return self.row is not None and self.step_s < self.plain_step_s

    @property
    def saving(self) -> float:
        return 1 - self.step_s / self.every_step_s

    def note(self) -> str:
        return (f"dp_sync=diloco H={self.inner_steps}: {self.sync_bytes / self.inner_steps / 1e6:,.1f} MB/step per "
                "rank across nodes")

    def lines(self) -> list[str]:
        mb = self.sync_bytes / 1e6
        against = (f"{self.step_s:.3f} s per step against {self.every_step_s:.3f} s for the fastest every-step layout "
                   f"{self.every_layout}, whose exposed communication takes {self.every_comm_s:.3f} s")
        if self.row is None:
            return [f"DiLoCo not ranked ({self.link} between nodes): {against}; it trains differently from data "
                    f"parallelism, so the plan ranks it only where it saves {DILOCO_MIN_SAVING:.0%} of the step or "
                    "more (docs/layouts.md)"]
        verdict = "DiLoCo ranks first" if self.first else "DiLoCo ranks below the plain first choice"
        return [f"{verdict} ({self.link} between nodes): {against}; DiLoCo with H={self.inner_steps} sends "
                f"{mb / self.inner_steps:,.1f} MB/step per rank across nodes ({mb:,.1f} MB every {self.inner_steps} "
                "steps)",
                f"  DiLoCo trains differently from data parallelism (local steps, then an outer Nesterov step): its "
                f"config sets parallel.dp_sync = \"diloco\", diloco.inner_steps = {self.inner_steps} (docs/layouts.md)"]

    key = "diloco"  # its entry in `paratrain plan --json`

    def row_json(self) -> dict:
        return {"dp_sync": "diloco", "diloco": {"replicas": self.replicas, "inner_steps": self.inner_steps,
                                                "sync_bytes": self.sync_bytes,
                                                "bytes_per_step_across_nodes": self.sync_bytes / self.inner_steps}}

    def as_json(self) -> dict:
        return {"ranked": self.row is not None, "first": self.first, "replicas": self.replicas, "layout": self.layout,
                "inner_steps": self.inner_steps, "step_s": self.step_s, "every_step_layout": self.every_layout,
                "every_step_s": self.every_step_s, "every_step_comm_s": self.every_comm_s,
                "plain_layout": self.plain_layout, "plain_step_s": self.plain_step_s, "sync_bytes": self.sync_bytes}


def plan_diloco(request, planning, plain) -> DiLoCoChoice | None:
    """DiLoCo beside the plain plan, where `request` gives --inter-node-bandwidth over several nodes (None otherwise).
    One replica per node: one node's plan (FSDP inside, room left for DiLoCo's two copies) on 1/nodes of the batch,
    plus the pseudo-gradient's all-reduce (fp32, each rank's 1/gpus_per_node share of the weights) over the nodes
    every H steps (not overlapped); the whole run is that layout as hsdp with a replica per node."""
    ctx, world = planning.ctx, planning.world
    nodes = world // ctx.gpus_per_node
    pinned = {"dp_mode", "dp_replicate", "dp_shard"} & set(request.parallel)
    if (request.inter_node_bandwidth is None or nodes < 2 or ctx.cluster or ctx.global_seqs % nodes or pinned
            or (request.dp_modes is not None and "fsdp" not in request.dp_modes)):
        return None
    sync_bytes = planning.parameter_count() * 4 / ctx.gpus_per_node
    # a replica's layout must leave room for DiLoCo's round-start weights and outer momentum (fp32, like the
    # pseudo-gradient a rank's 1/gpus_per_node share of the weights: FSDP shards the model over the node; the row's
    # memory below is the estimator's, with them)
    room = ctx.hw.memory_bytes - 2 * int(sync_bytes)
    one = planning.of(replace(request, gpus=ctx.gpus_per_node, inter_node_bandwidth=None, dp_modes=("fsdp",),
                              gpu_memory=room, global_batch_tokens=ctx.global_seqs // nodes * ctx.seq_len))
    try:
        ranked = one.plan(10).ranked
    except UserError:  # no replica fits on one node
        return None
    # the first replica sharded inside its node (FSDP: hsdp across the nodes; tp alone in a node has no such layout)
    replica = next((r for r in ranked if r.cand.layout.dp_shard > 1), None)
    if replica is None:
        return None
    try:  # the same replicas all-reducing the gradient every step
        every = planning.evaluate(planning.candidate(f"hsdp,rep={nodes}" + replica.cand.name.removeprefix("fsdp")))
    except UserError:  # (a layout hsdp cannot run across the nodes)
        return None
    if every.pred is None:
        return None
    sync_s = planning.all_reduce_s(sync_bytes, nodes, ctx.hw.inter)
    inner = replica.pred.step_s
    h = next((h for h in DILOCO_INNER_STEPS if sync_s / h <= DILOCO_SYNC_SHARE * inner), DILOCO_INNER_STEPS[-1])
    step = inner + sync_s / h
    best = plain.ranked[0]
    fastest = min((best, every), key=lambda r: r.pred.step_s)  # (the plain row on a tie)
    choice = DiLoCoChoice(nodes, every.cand.name, h, step, fastest.cand.name, fastest.pred.step_s,
                          fastest.pred.comm_exposed_s, best.cand.name, best.pred.step_s, sync_bytes, ctx.hw.inter.name)
    if choice.saving < DILOCO_MIN_SAVING:
        return choice
    # the row: the whole run's candidate with DiLoCo in its recipe (its memory, its written config), predicted as one
    # replica's step plus the amortised synchronisation
    row = planning.evaluate(every.cand.replace(capabilities=(*every.cand.recipe.capabilities, DiLoCo(inner_steps=h))))
    if row.reason is not None:
        return choice
    p = replica.pred
    row.pred = replace(p, step_s=step, comm_exposed_s=p.comm_exposed_s + sync_s / h, comm_total_s=p.comm_total_s
                       + sync_s / h, tokens_per_s=ctx.global_seqs * ctx.seq_len / step, mfu=p.mfu * inner / step,
                       comm={**p.comm, "diloco_sync": sync_s / h}, dp_bytes=p.dp_bytes + sync_bytes / h)
    return replace(choice, row=PlanRow(row, choice.note(), choice.row_json()))
