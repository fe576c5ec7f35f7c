"""Pipeline parallelism with `torch.distributed.pipelining`: whole blocks per stage, a named schedule.

Planning (`plan_pipeline`) needs only the config, the model size and the batch, and runs before any
process starts. Building (`build_pipeline`) cuts the meta-device model into stages that keep their
parameter names (`layers.5.attention.wq.weight` stays `layers.5...` on whichever stage owns it), so DCP
checkpoints reshard between pipelined and plain layouts. Each stage then gets the usual layout pieces
(tensor parallel, activation checkpointing, compile, FSDP on the data-parallel mesh) and is wrapped in a
`PipelineStage`. A rank that holds several stages (interleaved schedules) trains one "rank model": a
pruned Transformer whose modules are the same objects as its stages' modules, which the optimizer,
gradient clipping and checkpoints see like any other model.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.tensors import full_tensor
from paratrain.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv")  # several (virtual) stages per rank
FSDP_MODES = ("zero2", "fsdp", "hsdp")


@dataclass(frozen=True)
class PipelinePlan:
    pp: int
    schedule: str
    virtual: int  # stages per rank
    microbatches: int  # per optimizer step and data-parallel rank
    split: tuple[int, ...]  # blocks per stage, stage 0 first

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stage_owner(self, stage: int) -> int:
        """The pp rank that runs a stage: round robin ('loop'), or a V for zbv (rank r: r and 2p-1-r)."""
        if self.schedule == "zbv":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def local_stages(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_owner(s) == pp_rank]

    def stage_layers(self, stage: int) -> list[int]:
        start = sum(self.split[:stage])
        return list(range(start, start + self.split[stage]))

    def predicted_bubble(self) -> float:
        return predicted_bubble(self.pp, self.microbatches, self.virtual)

    def describe(self) -> str:
        return (f"pipeline: {self.schedule}, {self.pp} ranks x {self.virtual} stage(s) = {self.num_stages} stages "
                f"(blocks per stage {list(self.split)}), {self.microbatches} microbatches; predicted bubble "
                f"{self.predicted_bubble():.1%}")


def predicted_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a GPipe/1F1B pipeline, (p-1)/(m+p-1); interleaving divides it by the stages per rank."""
    return (pp - 1) / (microbatches + pp - 1) / virtual


def block_params(args, index: int) -> int:
    """Parameters of block `index` (dense or mixture of experts), counted on a meta-device block."""
    from paratrain.models.llama import TransformerBlock

    with torch.device("meta"):
        return sum(p.numel() for p in TransformerBlock(args, index).parameters())


def balanced_split(args, num_stages: int) -> tuple[int, ...]:
    """Contiguous blocks per stage minimising the largest stage's parameters (embedding counts on the
    first stage, norm + output on the last)."""
    n = args.n_layers
    cost = [block_params(args, i) for i in range(n)]
    cost[0] += args.vocab_size * args.dim
    cost[-1] += args.vocab_size * args.dim + args.dim
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-stage cost of the first i blocks cut into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def plan_pipeline(p, args, per_dp_batch: int, dims=None) -> PipelinePlan | None:
    """Validate the pipeline settings against the model and the batch; None when pp == 1."""
    if p.pp == 1:
        return None
    schedule = p.pp_schedule
    if schedule not in SCHEDULES:  # config validation normally catches this first
        import difflib

        close = difflib.get_close_matches(schedule, SCHEDULES, n=1)
        raise ConfigError(f"parallel.pp_schedule: unknown schedule '{schedule}'"
                          + (f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(SCHEDULES)})"))
    if schedule in MULTI_STAGE:
        virtual = p.pp_virtual_stages if p.pp_virtual_stages > 1 else 2
        if schedule == "zbv" and virtual != 2:
            raise ConfigError(f"parallel.pp_schedule=zbv runs exactly 2 stages per rank, not "
                              f"parallel.pp_virtual_stages={virtual}")
    else:
        virtual = p.pp_virtual_stages
        if virtual != 1:
            raise ConfigError(f"parallel.pp_virtual_stages={virtual} needs an interleaved schedule "
                              f"(interleaved_1f1b, interleaved_zero_bubble or zbv), not {schedule}")
    stages = p.pp * virtual
    if stages > args.n_layers:
        what = f"parallel.pp={p.pp}" + (f" x {virtual} virtual stages ({schedule})" if virtual > 1 else "")
        raise ConfigError(f"{what} = {stages} pipeline stages, but the model has only {args.n_layers} blocks "
                          "(model.n_layers); each stage needs at least one block")
    if args.tie_embeddings:
        raise ConfigError("tied embeddings do not compose with pipeline parallelism (the embedding is on the first "
                          "stage, the output on the last); set model.tie_embeddings=false")
    if args.moe_experts:
        raise ConfigError("pipeline parallelism does not support mixture-of-experts models yet (parallel.pp > 1 "
                          "with model.moe_experts > 0)")
    if dims is not None and dims.dp > 1 and dims.dp_mode not in FSDP_MODES:
        raise ConfigError(f"parallel.pp={p.pp} with data parallelism needs dp_mode fsdp, zero2 or hsdp, "
                          f"not {dims.dp_mode}")
    if p.pp_split:
        try:
            split = tuple(int(x) for x in p.pp_split.split(","))
        except ValueError:
            raise ConfigError(f"parallel.pp_split='{p.pp_split}' must be comma-separated block counts, "
                              "e.g. '3,3,2'") from None
        if len(split) != stages or min(split) < 1 or sum(split) != args.n_layers:
            raise ConfigError(f"parallel.pp_split='{p.pp_split}' must give {stages} stages of at least one block "
                              f"each, summing to model.n_layers={args.n_layers}")
    else:
        split = balanced_split(args, stages)
    m = p.pp_microbatches
    if m == 0:
        # Automatic: the smallest divisor of the per-rank batch that reaches 2 x stages (a small bubble), else all.
        m = next((d for d in range(1, per_dp_batch + 1) if per_dp_batch % d == 0 and d >= 2 * stages), per_dp_batch)
    elif per_dp_batch % m:
        raise ConfigError(f"parallel.pp_microbatches={m} does not divide the batch of each data-parallel rank "
                          f"({per_dp_batch} sequences = global batch / data-parallel degree)")
    if schedule != "gpipe" and m < p.pp:
        raise ConfigError(f"parallel.pp_schedule={schedule} needs at least parallel.pp={p.pp} microbatches, got "
                          f"{m} (parallel.pp_microbatches, at most the {per_dp_batch} sequences per data-parallel rank)")
    if schedule in MULTI_STAGE and m % max(1, m // p.pp):
        raise ConfigError(f"parallel.pp_schedule={schedule}: {m} microbatches must be a multiple of the "
                          f"{m // p.pp} rounds of {p.pp} (choose a multiple of parallel.pp)")
    return PipelinePlan(p.pp, schedule, virtual, m, split)


# -- building ------------------------------------------------------------------------------------

def prune(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """Keep only `layers` (names unchanged), the embedding on the first stage, norm + output on the last."""
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


@dataclass
class Pipeline:
    """This rank's share of a pipelined model: stage modules, PipelineStages and the schedule."""

    plan: PipelinePlan
    model: nn.Module  # the rank model (what the optimizer and checkpoints see)
    modules: dict[int, nn.Module]  # stage index -> stage module
    stages: list
    schedule: object
    group: object  # the pp process group
    pp_rank: int
    device: torch.device
    busy_s: float = 0.0
    step_s: float = 0.0
    bubble_history: list = field(default_factory=list)

    @property
    def has_first(self) -> bool:
        return 0 in self.modules

    @property
    def has_last(self) -> bool:
        return self.plan.num_stages - 1 in self.modules

    @property
    def last_owner(self) -> int:
        return self.plan.stage_owner(self.plan.num_stages - 1)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this data-parallel rank's batch; returns the batch's mean loss on every pp rank."""
        losses: list = []
        self.busy_s = 0.0
        start = time.perf_counter()
        target = y if self.has_last else None
        if self.has_first:
            self.schedule.step(x, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_s = time.perf_counter() - start
        if self.has_last:
            loss = torch.stack([full_tensor(v).detach().float().reshape(()) for v in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        return self._from_last(loss)

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device).contiguous()
        dist.broadcast(value, group=self.group, group_src=self.last_owner)
        return value

    def measured_bubble(self) -> list[float]:
        """Idle fraction of each pp rank in the last step: 1 - compute time / step time (one tiny all-gather)."""
        mine = torch.tensor([1.0 - min(1.0, self.busy_s / self.step_s) if self.step_s > 0 else 0.0])
        out = [torch.zeros(1) for _ in range(self.plan.pp)]
        dist.all_gather(out, mine, group=self.group)
        values = [float(o) for o in out]
        self.bubble_history.append(values)
        return values

    # -- forward only: evaluation and generation --------------------------------------------------
    def forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Run all stages in order (sends/receives between ranks); the last stage's owner gets the output."""
        h = tokens
        p = self.plan
        for s in range(p.num_stages):
            owner = p.stage_owner(s)
            if owner != self.pp_rank:
                continue
            if s > 0 and p.stage_owner(s - 1) != owner:
                h = _recv(p.stage_owner(s - 1), self.group, self.device)
            h = self.modules[s](h)
            if s < p.num_stages - 1 and p.stage_owner(s + 1) != owner:
                _send(full_tensor(h), p.stage_owner(s + 1), self.group)
        return h if self.has_last else None

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        out = self.forward(x)
        loss = full_tensor(loss_fn(out, y)).detach().float() if self.has_last else torch.zeros((), device=self.device)
        return self._from_last(loss)

    def last_logits(self, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        out = self.forward(tokens)
        if self.has_last:
            logits = full_tensor(out)[:, -1:, :].float().contiguous()
        else:
            logits = torch.zeros(tokens.shape[0], 1, vocab, device=self.device)
        return self._from_last(logits)


class PipelineSampler(nn.Module):
    """A callable model for `generate.sample`: last-position logits on every rank, stage by stage."""

    def __init__(self, pipeline: Pipeline, vocab: int):
        super().__init__()
        self._pipeline, self._vocab = pipeline, vocab

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self._pipeline.modules.values():
            m.train(mode)
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._pipeline.last_logits(tokens, self._vocab)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _send(t: torch.Tensor, dst: int, group) -> None:
    header = torch.zeros(6, dtype=torch.int64)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2:2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(t.device), group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv(src: int, group, device) -> torch.Tensor:
    header = torch.zeros(6, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    header = header.tolist()
    t = torch.empty(header[2:2 + header[0]], dtype=_DTYPES[header[1]], device=device)
    dist.recv(t, group=group, group_src=src)
    return t


def _timed(pipeline: Pipeline, fn):
    def wrapper(*args, **kwargs):
        if pipeline.device.type == "cuda":
            torch.cuda.synchronize(pipeline.device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if pipeline.device.type == "cuda":
                torch.cuda.synchronize(pipeline.device)
            pipeline.busy_s += time.perf_counter() - start

    return wrapper


def build_pipeline(plan: PipelinePlan, args, dims, mesh, checkpointing, precision: str, compile: bool,
                   device: torch.device, seed: int, loss_fn) -> Pipeline:
    """Cut the model into this rank's stages, lay each out (TP, AC, compile, FSDP), wrap them and build the schedule."""
    import dataclasses

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    from paratrain.distributed.parallelize import (apply_activation_checkpointing, apply_compile, apply_fsdp,
                                                   apply_tp, fsdp_mesh, uses_fsdp)
    from paratrain.models.init import init_weights
    from paratrain.models.llama import Transformer

    pp_mesh = mesh["pp"]
    pp_rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    with torch.device("meta"):
        full = Transformer(args)
    seq_shards = dims.tp if dims.tp > 1 and dims.sequence_parallel else 1
    modules: dict[int, nn.Module] = {}
    for s in plan.local_stages(pp_rank):
        m = prune(copy.deepcopy(full), plan.stage_layers(s), s == 0, s == plan.num_stages - 1)
        m.seq_shards = seq_shards  # a later stage receives the residual stream split along the sequence
        modules[s] = m
    if len(modules) == 1:
        rank_model = next(iter(modules.values()))
    else:
        # One model over all of this rank's stages, sharing their modules (and so their parameters).
        rank_model = copy.deepcopy(full)
        owned = {str(i): mod.layers[str(i)] for mod in modules.values() for i in [int(k) for k in mod.layers]}
        rank_model.layers = nn.ModuleDict({k: owned[k] for k in sorted(owned, key=int)})
        rank_model.tok_embeddings = modules[0].tok_embeddings if 0 in modules else None
        last = modules.get(plan.num_stages - 1)
        rank_model.norm = last.norm if last is not None else None
        rank_model.output = last.output if last is not None else None

    # The logits of the last stage stay whole (no loss parallelism): the schedule's loss sees a plain tensor.
    stage_dims = dataclasses.replace(dims, loss_parallel=False)
    for m in modules.values():
        if dims.tp_enabled:
            with warnings.catch_warnings():  # the plan names modules a stage does not have
                warnings.simplefilter("ignore")
                apply_tp(m, mesh["tp"], dims.sequence_parallel, False)
        apply_activation_checkpointing(m, checkpointing)
        if compile:
            apply_compile(m)
        if uses_fsdp(stage_dims):
            apply_fsdp(m, fsdp_mesh(mesh, stage_dims), stage_dims, precision)
    for m in modules.values():
        m.to_empty(device=device)
    if rank_model not in modules.values():
        for name, buf in list(rank_model.named_buffers(recurse=False)):
            setattr(rank_model, name, torch.empty_like(buf, device=device))
    init_weights(rank_model, seed)
    for m in modules.values():
        m.reset_buffers()

    stages = [PipelineStage(modules[s], s, plan.num_stages, device, group=group) for s in sorted(modules)]
    cls = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "interleaved_1f1b": S.ScheduleInterleaved1F1B,
           "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble, "zbv": S.ScheduleZBVZeroBubble}[plan.schedule]
    # Each microbatch's loss is a mean; scale_grads divides the summed gradients by the microbatch count, so
    # the gradient is the mean over this rank's batch (FSDP then averages over data-parallel ranks).
    schedule = cls(stages[0] if plan.schedule not in MULTI_STAGE else stages, n_microbatches=plan.microbatches,
                   loss_fn=loss_fn, scale_grads=True)
    pipe = Pipeline(plan, rank_model, modules, stages, schedule, group, pp_rank, device)
    for st in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(st, name):
                setattr(st, name, _timed(pipe, getattr(st, name)))
    return pipe
