"""Expert parallelism: each rank of the `ep` mesh axis holds E/ep experts; tokens travel to their experts and
back with `all_to_all_single` (variable split sizes, exchanged first).

The ep axis is borrowed from the data-parallel shard axis: `dp_shard` is split (unflattened) into
`dp_shard_mod_ep x ep` (ep innermost, so an ep group is ep consecutive data-parallel ranks). Each ep group
covers E experts between its ranks; the `dp_shard_mod_ep` groups (and `dp_replicate`, for hsdp) hold the
same experts for different data, and FSDP shards the expert weights over them and reduces their gradients.

Gradient scaling: the loss is the mean over data-parallel ranks of each rank's mean loss, so a non-expert
gradient is the average over all dp ranks (FSDP's default). An expert's gradient arrives at its owner
already summed over the ep ranks' tokens (the all-to-all's backward brings it home); FSDP then averages it
over the expert-data-parallel ranks, so the local expert weights scale their gradient by 1/ep on the way:
sum over ep, mean over the rest = mean over all dp ranks.

With tensor parallelism, every tp rank routes the same (whole-sequence) tokens: the experts and the router
are replicated over tp (Replicate DTensors), only the shared expert is tensor-parallel (parallelize.py).

The model is untouched apart from two seams: `MoE.dispatcher` (the all-to-all dispatcher replaces the local
one) and `GroupedExperts.weights()` (the experts' weights become DTensors sharded on dim 0 over ep, and the
experts module computes with the local shard).
"""

from __future__ import annotations

from torch import nn
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from paratrain.distributed.tensors import full_tensor
from paratrain.models.moe import moe_modules


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class AllToAllDispatcher:
    """Sends each token (one row per top-k assignment, grouped by global expert) to the ep rank that owns its
    expert, and brings the outputs back. Rank r owns experts [r * E/ep, (r + 1) * E/ep)."""

    def __init__(self, group, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        ep, local = self.ep, self.local
        # 1. How many rows each rank sends to each of my experts: recv[src, j] for my local expert j.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        recv = recv.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        # 2. The rows themselves; they arrive grouped by (source rank, local expert).
        y = _AllToAll.apply(x, recv_splits, send_splits, self.group)
        # 3. Regroup by (local expert, source rank) for the grouped matmul: stable, so token order is kept.
        key = (torch.arange(local, device=x.device)[None, :] * ep + torch.arange(ep, device=x.device)[:, None])
        perm = torch.argsort(torch.repeat_interleave(key.flatten(), recv.flatten()), stable=True)
        return y[perm], recv.sum(0), (perm, send_splits, recv_splits)

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        perm, send_splits, recv_splits = ctx
        return _AllToAll.apply(y[torch.argsort(perm)], send_splits, recv_splits, self.group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _LocalExpertWeights:
    """Mixed into a GroupedExperts whose weights are DTensors (sharded over ep, replicated over tp):
    compute with this rank's experts, scaling their gradients by 1/ep (see the module docstring)."""

    expert_grad_scale = 1.0

    def weights(self):
        return tuple(_ScaleGrad.apply(w.to_local(), self.expert_grad_scale) for w in super().weights())


_LOCAL_CLASSES: dict[type, type] = {}


def _local_weights_class(cls: type) -> type:
    # Like fully_shard, change the module's class to a subclass; parameter names stay the same.
    if cls not in _LOCAL_CLASSES:
        _LOCAL_CLASSES[cls] = type(f"Distributed{cls.__name__}", (_LocalExpertWeights, cls), {})
    return _LOCAL_CLASSES[cls]


def distribute_experts(model: nn.Module, dims):
    """Make every MoE layer's expert weights DTensors: Shard(0) over ep and/or Replicate over tp (under tensor
    parallelism every parameter is a DTensor, so optimizers and clipping never mix the two kinds), and route
    tokens with all-to-all when ep > 1. Call on the meta-device model, after tensor parallelism and before
    FSDP; initialisation later fills each rank's shard. Returns the mesh FSDP shards the experts over
    (None when ep == 1: the experts are then sharded with their block)."""
    layout = dims.layout
    moes = moe_modules(model)
    if not moes or not (layout.ep_enabled or layout.tp_enabled):
        return None
    expert_dp_mesh = ep_group = None
    if layout.ep_enabled:
        sparse = dims.expert_mesh()
        expert_mesh = sparse["ep", "tp"] if layout.tp_enabled else sparse["ep"]
        placements = [Shard(0), Replicate()] if layout.tp_enabled else [Shard(0)]
        ep_group = sparse["ep"].get_group()
        expert_dp_mesh = sparse["dp_replicate", "dp_shard_mod_ep"] if layout.hybrid else sparse["dp_shard_mod_ep"]
    else:
        expert_mesh, placements = dims.tp_mesh, [Replicate()]
    for moe in moes:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: each rank keeps its own chunk, no communication (nothing is initialised yet).
            dt = distribute_tensor(param.data, expert_mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        experts.__class__ = _local_weights_class(type(experts))
        experts.expert_grad_scale = 1.0 / layout.ep
        if layout.ep_enabled:
            moe.dispatcher = AllToAllDispatcher(ep_group, layout.ep, moe.n_experts)
    return expert_dp_mesh


def shard_experts(model: nn.Module, expert_dp_mesh, policies: dict, reshard: bool) -> None:
    """FSDP for the expert weights over the ranks that hold the same experts (averaging their gradients);
    call before the blocks' fully_shard so the blocks leave the experts out. `policies`: fully_shard's mixed
    precision and offload policies."""

    for moe in moe_modules(model):
        # Shard the hidden dimension: dim 0 is already split over ep and may have fewer rows than ranks.
        fully_shard(moe.experts, mesh=expert_dp_mesh, reshard_after_forward=reshard,
                    shard_placement_fn=lambda param: Shard(1), **policies)


class MoEMeter:
    """Per-step mixture-of-experts statistics of this rank's MoE layers (a pipeline stage's own): each layer's forward
    adds its expert loads, dropped assignments and balance loss while `recording` (the trainer's training forwards,
    not evaluation's; a forward hook, so a pipeline schedule's microbatches count as they run, and an activation
    checkpoint's recomputation in backward does not count again). `loads()` gives the step's expert loads of this
    stage's layers over the data-parallel ranks (`Capability.after_expert_loads` gets them) and the
    metrics record `step_metrics()` once per optimizer step, from the same single all-reduce, gathered over the
    pipeline stages (`pp_group`)."""

    def __init__(self, model: nn.Module, device: torch.device, pp_group=None):
        moes = set(moe_modules(model))
        named = [(name, m) for name, m in model.named_modules() if m in moes]
        self.names = [name for name, _ in named]  # their places in the whole model (a pipeline's: `_stage_order`)
        self.modules = [m for _, m in named]
        self.device, self.pp_group, self.order = device, pp_group, None
        self.recording = False
        for index, module in enumerate(self.modules):
            module.register_forward_hook(self._hook(index))
        self.reset()  # also called by the trainer at the start of each step (a retried step starts over)

    def reset(self) -> None:
        self.aux = self.tokens = self.dropped = None  # per layer: (layers,) summed aux, (layers, E), (layers,)
        self.micro = 0  # forwards of each layer
        self.reduced = None  # the step's rows summed over the data-parallel ranks, once made (`reduced_rows`)

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            if not self.recording or torch._C._current_graph_task_id() != -1:  # evaluation; a recomputation
                return
            if self.tokens is None:
                device = module.tokens_per_expert.device
                self.tokens = torch.zeros(len(self.modules), module.n_experts, dtype=torch.long, device=device)
                self.aux = torch.zeros(len(self.modules), dtype=torch.float64, device=device)
                self.dropped = torch.zeros(len(self.modules), dtype=torch.long, device=device)
            self.tokens[index] += module.tokens_per_expert
            self.aux[index] += full_tensor(module.aux_loss.detach()).double()
            self.dropped[index] += module.dropped
            self.micro += index == 0

        return record

    def reduced_rows(self, dp_group=None) -> torch.Tensor | None:
        """This stage's layers' statistics for the step, summed over the data-parallel ranks (every token counted
        once: tensor-parallel ranks route the same tokens and are not in the group), all-reduced once per step:
        (layers, E + 2) rows of loads, dropped assignments, mean aux loss; None before a forward (without a pipeline)."""
        if self.reduced is None:
            if self.pp_group is None and self.tokens is None:
                return None
            experts = self._stage_order()[0] if self.pp_group is not None else self.tokens.shape[1]
            rows = self._rows(experts)
            if dp_group is not None:
                dist.all_reduce(rows, group=dp_group)
                rows[:, -1] /= dist.get_world_size(dp_group)
            self.reduced = rows
        return self.reduced

    def loads(self, dp_group=None) -> torch.Tensor | None:
        """(this stage's MoE layers, E): the step's top-k assignments per expert over every micro-batch and
        data-parallel rank (the same on every rank), or None before a forward or on a stage without MoE layers."""
        rows = self.reduced_rows(dp_group)
        return None if rows is None or not len(self.modules) else rows[:, :-2]

    def step_metrics(self, dp_group=None) -> dict:
        """Global (summed over data-parallel ranks) numbers for this step, then reset (see `step_stats`)."""
        pending = self.step_stats(dp_group)
        return pending() if pending is not None else {}

    def step_stats(self, dp_group=None):
        """`step_metrics` in two halves: the all-reduce now (on the device, nothing read; none when `loads` made it
        this step), then reset; returns a callable that reads the numbers on the host (the trainer calls it on the
        next log step), or None. Under a pipeline every rank calls it (a stage without MoE layers too), and the
        stages' layers are gathered.

        moe_aux_loss: the unscaled balance loss, mean over layers, micro-steps and ranks (1.0 = balanced);
        moe_tokens_per_expert: per MoE layer, top-k assignments per expert over the global batch;
        moe_violation: per MoE layer, the busiest expert's assignments over the mean per expert, minus 1 (0 = balanced),
        moe_max_violation its worst layer's; moe_dropped_share: per MoE layer, the assignments the capacity limit
        dropped over all, moe_dropped_tokens their count over the global batch."""
        rows = self.reduced_rows(dp_group)
        if rows is None:
            return None
        if self.pp_group is not None:
            rows = self._gather_stages(rows)
        self.reset()

        def read() -> dict:
            values = rows.cpu()
            tokens = values[:, :-2].round().long()  # (layers, E)
            dropped = values[:, -2].round().long()  # (layers,)
            assigned = tokens.double().sum(1).clamp(min=1)
            violation = (tokens.max(1).values.double() / (assigned / tokens.shape[1]) - 1).clamp(min=0)  # (layers,)
            return {"moe_aux_loss": values[:, -1].mean().item(), "moe_max_violation": violation.max().item(),
                    "moe_violation": violation.tolist(), "moe_dropped_share": (dropped / assigned).tolist(),
                    "moe_dropped_tokens": int(dropped.sum().item()), "moe_tokens_per_expert": tokens.tolist()}

        return read

    def _rows(self, experts: int) -> torch.Tensor:
        if self.tokens is None:  # a stage without MoE layers (or none ran): no rows
            return torch.zeros(len(self.modules), experts + 2, dtype=torch.float64, device=self.device)
        return torch.cat([self.tokens.double(), self.dropped.double().unsqueeze(1),
                          (self.aux / max(1, self.micro)).unsqueeze(1)], dim=1)

    def _stage_order(self) -> tuple[int, int, list[tuple[int, int]]]:
        """Once per run (a host exchange of names over the pp group): the experts per layer, the most MoE layers a
        stage holds, and the whole model's MoE layers in order as (pp rank, row)."""
        if self.order is None:
            mine = (self.modules[0].n_experts if self.modules else 0, self.names)
            every = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(every, mine, group=self.pp_group)
            rows = sorted(((rank, i, name) for rank, (_, names) in enumerate(every) for i, name in enumerate(names)),
                          key=lambda row: _layer_key(row[2]))
            self.order = (max(e for e, _ in every), max(len(names) for _, names in every),
                          [(rank, i) for rank, i, _ in rows])
        return self.order

    def _gather_stages(self, rows: torch.Tensor) -> torch.Tensor:
        """Every pipeline rank's rows, in the whole model's layer order (padded to the same count for the gather)."""
        _, widest, order = self._stage_order()
        padded = torch.zeros(widest, rows.shape[1], dtype=rows.dtype, device=rows.device)
        padded[:len(rows)] = rows
        gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size(self.pp_group))]
        dist.all_gather(gathered, padded, group=self.pp_group)
        return torch.stack([gathered[rank][i] for rank, i in order])


def _layer_key(name: str) -> tuple:
    """A module name's place in the whole model: numbers compare as numbers (layers.10 after layers.9)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))
