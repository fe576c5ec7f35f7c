"""The estimate: per-rank memory at the peak of a training step, by category, and whether it fits.

The peak is found by walking one step of the trainer at block granularity and taking the largest total:

  L    the loss's backward (every block's activations stored, the log-softmax and its gradients live);
  B_i  the backward of block i, last to first (blocks below i still stored, block i's saved tensors and its
       gradient temporaries live, gradients of the blocks above i accumulated; with FSDP: the root, block i
       and the prefetched block i-1 unsharded, the previous block's reduce-scatter buffer kept);
  O    the optimizer step (parameters, gradients, optimizer states, and foreach temporaries).

One walk (`_walk`) for every rank: its schedule's actions in order, a rank without a pipeline being one stage whose
schedule is the last micro-step's forward and backward (with gradient accumulation the last micro-step is the worst:
gradients from the earlier ones are live). Pipeline ranks are each walked with their own stages and in-flight
micro-batches, and the worst is reported. Categories are what is live at that moment; `size` is each category's own
maximum over the step (their sum is the naive upper bound other tools print). The walk reads one rank's context
(`_Rank`: model states, activation sizes, parameters by block, FSDP's dtypes) and collects its candidate peaks in one
`_Peaks`. What is asked and its checks
are inputs.py, the printed table report.py, the change that would fit suggest.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from paratrain.estimate import activations as A
from paratrain.estimate.compression import compression_cost
from paratrain.estimate.gpus import GiB, fits, fmt_bytes, usable_bytes
from paratrain.estimate.inputs import EstimateInputs, validate
from paratrain.estimate.model_states import (BF16, FP32, Param, StateBytes, fsdp_gathers_per_step, fsdp_numel,
                                             local_shape, model_params, rank_layers, rank_params, state_bytes,
                                             zero_table)
from paratrain.layout import Layout, grad_compression_site
from paratrain.memory import HOST_HEADROOM
from paratrain.models.presets import count_active_params
from paratrain.models.registry import family_of
from paratrain.modes import (CompressionSite, block_checkpointing, compute_precision, low_precision, multi_stage,
                             recomputes, segment_size)
from paratrain.optimizers import optimizer_entry
from paratrain.estimate.report import format_table
from paratrain.estimate.schedule import max_in_flight, rank_actions
from paratrain.estimate.suggest import suggest_changes
from paratrain.estimate.tiers import activation_offload_plan, cpu_offload_states

# Runtime overhead per rank outside PyTorch's tensor allocations (what torch.cuda.max_memory_allocated does
# not see): the CUDA context and kernels (~0.5-0.8 GiB with lazy module loading), cuBLAS/cuDNN workspaces and
# allocator fragmentation headroom (~0.25 GiB), and NCCL's communicator buffers when there is more than one rank.
CONTEXT_OVERHEAD_GIB = 1.0
NCCL_OVERHEAD_GIB = 0.5


@dataclass
class Estimate:
    inputs: EstimateInputs
    peak_bytes: int  # tensors at the peak (what torch.cuda.max_memory_allocated reports)
    overhead_bytes: int
    at_peak: dict[str, int]  # category -> bytes live at the peak
    sizes: dict[str, int]  # category -> its own maximum over the step
    phase: str  # where the peak is
    stage: int  # pipeline stage of the worst rank
    notes: list[str] = field(default_factory=list)
    per_block: list[tuple[str, int]] = field(default_factory=list)  # one block's saved tensors ("none")
    zero: list[dict] = field(default_factory=list)
    zero_ranks: int = 0
    suggestion: dict | None = None
    alternatives: list[dict] = field(default_factory=list)
    searched: bool = False  # whether suggestions were looked for
    stages: list[dict] = field(default_factory=list)  # per pipeline stage: peak and phase
    fsdp_all_gathers: int = 0  # FSDP parameter all-gathers per step on the worst rank (Layout.fsdp_all_gathers)
    host: dict[str, int] = field(default_factory=dict)  # host memory per rank at its peak, by category (offloading)

    @property
    def host_bytes(self) -> int:
        """Host memory per rank (offloaded activations and model states)."""
        return sum(self.host.values())

    @property
    def host_node_bytes(self) -> int:
        """Host memory per node: every rank of the node's."""
        return self.host_bytes * self.inputs.node_ranks

    @property
    def host_fits(self) -> bool | None:
        """Whether the node's host memory holds it (memory.HOST_HEADROOM kept free); None: --host-memory not given."""
        limit = self.inputs.target.host_bytes
        return None if limit is None else self.host_node_bytes <= usable_bytes(limit, HOST_HEADROOM)

    @property
    def host_limit_text(self) -> str:
        usable = usable_bytes(self.inputs.target.host_bytes, HOST_HEADROOM)
        return (f"limit {1 - HOST_HEADROOM:.0%} = {fmt_bytes(usable)}: "
                "the rest for the OS, the data loaders and the ranks' processes")

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    @property
    def gpu_bytes(self) -> int | None:
        return self.inputs.target.gpu_bytes

    @property
    def usable_bytes(self) -> int | None:
        """The GPU's memory less the headroom (estimate.gpus.usable_bytes): the most a rank may use."""
        return None if self.gpu_bytes is None else usable_bytes(self.gpu_bytes, self.inputs.target.headroom)

    @property
    def fits(self) -> bool | None:
        """The device's memory holds it (and the host's, when --host-memory is given)."""
        if self.gpu_bytes is None:
            return None
        return fits(self.total_bytes, self.gpu_bytes, self.inputs.target.headroom) and self.host_fits is not False

    @property
    def headroom_bytes(self) -> int | None:
        """Memory left below the usable limit (negative: over it)."""
        return None if self.gpu_bytes is None else self.usable_bytes - self.total_bytes

    def to_dict(self) -> dict:
        i = self.inputs
        lay = i.layout
        return {
            "model": i.model_name, "parameters": sum(p.numel for p in model_params(i.model_args)),
            "active_parameters": count_active_params(i.model_args),
            "trainable_parameters": sum(p.numel for p in model_params(i.model_args, i.recipe.lora) if p.trainable),
            "lora": None if i.recipe.lora is None else i.recipe.lora.record(),
            "layout": {**dataclasses.asdict(lay), "world_size": lay.world_size, "description": lay.describe()},
            "precision": i.recipe.precision, "accounting": i.accounting, "optimizer": i.recipe.optimizer,
            "optimizer_impl": i.recipe.optimizer_impl, "checkpointing": i.recipe.checkpointing,
            "every_k": i.recipe.every_k, "segment_blocks": segment_size(i.recipe.segment_blocks, i.model_args.n_layers),
            "compression": dataclasses.asdict(i.recipe.compression),
            "micro_batch": i.recipe.micro_batch, "seq_len": i.recipe.seq_len, "accum_steps": i.recipe.accum_steps,
            "gpu": i.target.gpu_name, "gpu_bytes": i.target.gpu_bytes, "headroom_fraction": i.target.headroom,
            "usable_bytes": self.usable_bytes,
            "peak_phase": self.phase, "worst_stage": self.stage,
            "at_peak_bytes": self.at_peak, "size_bytes": self.sizes,
            "tensor_peak_bytes": self.peak_bytes, "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
            "notes": self.notes, "block_activation_bytes": dict(self.per_block),
            "zero_breakdown": {"ranks": self.zero_ranks, "rows": self.zero, "units": "bytes"},
            "stages": self.stages, "fsdp_all_gathers_per_step": self.fsdp_all_gathers,
            "suggestion": self.suggestion, "alternatives": self.alternatives,
            "host_bytes": self.host_bytes, "host_breakdown_bytes": self.host, "host_node_bytes": self.host_node_bytes,
            "host_memory_bytes": i.target.host_bytes, "host_fits": self.host_fits,
            "memory_tiers": dataclasses.asdict(i.recipe.tiers),  # ([memory]'s keys: MemoryTiers has their names)
        }

    def memory_line(self) -> str:
        """Per rank on the device and in host memory, in one line: what the trainer's header, `paratrain estimate` and
        `paratrain train --dry-run` all print for the same run."""
        host = (f", host {fmt_bytes(self.host_bytes)} per rank ({fmt_bytes(self.host_node_bytes)} per node of "
                f"{self.inputs.node_ranks})") if self.host else ""
        return f"memory per rank: device {fmt_bytes(self.total_bytes)}{host}"

    def format_table(self, units: str = "GiB") -> str:
        """The table `paratrain estimate` prints (estimate/report.py)."""

        return format_table(self, units)

    def compare_line(self, measured_bytes: int, units: str = "GiB",
                     what: str = "torch.cuda.max_memory_allocated") -> str:
        """One line for the trainer's log: the estimated tensor peak against a measured one."""
        diff = (self.peak_bytes - measured_bytes) / measured_bytes * 100 if measured_bytes else float("nan")
        return (f"memory: estimated peak {fmt_bytes(self.peak_bytes, units)} of tensors ({self.phase}), measured "
                f"{fmt_bytes(measured_bytes, units)} ({what}); estimate {diff:+.1f}%")


# ---------------------------------------------------------------------------------------------

def default_overhead(layout: Layout, device: str = "cuda") -> int:
    if device != "cuda":
        return 0
    return int((CONTEXT_OVERHEAD_GIB + (NCCL_OVERHEAD_GIB if layout.world_size > 1 else 0.0)) * GiB)


def in_flight(layout: Layout, rank: int) -> float:
    """The most micro-batches whose activations pipeline rank `rank` holds at once, in units of all its blocks, from
    its schedule's order of forwards and backwards (paratrain/estimate/schedule.py). 1 without a pipeline."""
    if layout.pp == 1:
        return 1.0

    return max_in_flight(layout.pp_schedule, layout.pp, layout.pp_virtual, layout.pp_microbatches, rank)


_FSDP_BYTES: dict = {}


def _fsdp_bytes(params: list[Param], layout: Layout, pbytes: int, rbytes: int = FP32) -> tuple[int, int]:
    """(unsharded bytes in the compute dtype, reduce-scatter input bytes in the reduce dtype: fp32, or bf16 with
    grad_compression=bf16) of an FSDP group: each parameter padded to a multiple of the ranks it is sharded over
    (experts under ep: dp_shard / ep). Cached: the planner asks for the same groups thousands of times."""
    key = (tuple((p.shape, p.tp_dim, p.expert, p.trainable) for p in params), layout, pbytes, rbytes)
    hit = _FSDP_BYTES.get(key)
    if hit is None:
        if len(_FSDP_BYTES) > 4096:
            _FSDP_BYTES.clear()
        hit = _FSDP_BYTES[key] = _fsdp_bytes_of(params, layout, pbytes, rbytes)
    return hit


def _fsdp_bytes_of(params: list[Param], layout: Layout, pbytes: int, rbytes: int) -> tuple[int, int]:
    unsh = rs = 0
    for p in params:
        n = max(1, layout.dp_shard // layout.ep) if (p.expert and layout.ep > 1) else layout.shard_degree
        padded = math.prod(local_shape(p, layout)) if n == 1 else fsdp_numel(p, layout) * n
        unsh += padded * pbytes
        rs += padded * rbytes if p.trainable else 0  # a frozen parameter has no gradient to reduce
    return unsh, rs


@dataclass
class _Rank:
    """What the walk reads of one rank (a whole model, or a pipeline rank's stages): its model states, activation
    sizes, parameters by block, and the dtypes FSDP works in."""

    i: EstimateInputs
    st: StateBytes
    d: A.ActDims
    params: list[Param]
    by_layer: dict[int, list[Param]]  # this rank's blocks -> their parameters
    root: list[Param]  # the parameters outside the blocks (embedding, final norm, output) this rank holds
    classic: bool  # classic mixed-precision accounting (Megatron/DeepSpeed) in bf16/fp16
    fsdp: bool  # FSDP's unsharded working copies (classic ZeRO-2 keeps whole bf16 parameters in its parameters row)
    pbytes: int  # dtype the unsharded parameters compute in
    host: dict  # model states in host memory (CPU offload: the sharded parameters, gradients, optimizer state)

    def local_numel(self, ps) -> int:
        return sum(math.prod(local_shape(p, self.i.layout)) for p in ps)

    def grad_numel(self, ps) -> int:
        """Elements of the gradients of these parameters (the trainable ones)."""
        return self.local_numel(p for p in ps if p.trainable)

    def where(self, where: str) -> list[Param]:
        return [p for p in self.root if p.where == where]

    # What a block's backward makes first and last, read off the family's table by role and sublayer kind.
    def ffn_output(self, layer: int) -> int:
        """Elements of the weights writing block `layer`'s feed-forward output, whose gradients its backward makes
        first: its mlp's row-parallel projection (a mixture of experts': its shared experts'), else a mixture's
        routed experts' down projection (the stacked weight writing the model width)."""
        kinds = ("mlp", "moe")
        out = [p for p in self.sublayer_params(layer, kinds, role="rowwise") if p.matmul]
        if not out:
            out = [p for p in self.sublayer_params(layer, kinds, role="expert")
                   if p.shape[-1] == self.i.model_args.dim][:1]
        return self.grad_numel(out)

    def after_attention_inputs(self, layer: int) -> int:
        """Elements of block `layer`'s parameters whose gradients exist once its attention's backward starts: all
        from the attention's row-parallel output projection on (not the norm before it nor the q/k/v projections,
        whose gradients come last)."""
        ps, output = self.by_layer[layer], self.sublayer_params(layer, ("attention",), role="rowwise")[0]
        return self.grad_numel(ps[next(k for k, p in enumerate(ps) if p is output):])

    def sublayer_params(self, layer: int, kinds: tuple[str, ...], role: str | None = None) -> list[Param]:
        """Block `layer`'s parameters (of this role) in its sublayers of these kinds (the family's `sublayers`)."""
        args = self.i.model_args
        names = {name for name, kind in family_of(args).sublayers(args, layer).items() if kind in kinds}
        return [p for p in self.by_layer[layer]
                if p.module.split(".", 1)[0] in names and (role is None or p.role == role)]


def _act_dims(i: EstimateInputs) -> A.ActDims:
    rec = i.recipe
    return A.act_dims(i.model_args, i.layout, rec.precision, i.accounting, rec.micro_batch, rec.seq_len,
                      i.target.device, rec.lora is not None, rec.tiers.loss_chunks)


def _rank(i: EstimateInputs, rank: int, layers_by_stage: list[list[int]], layers: list[int]) -> _Rank:
    args, lay = i.model_args, i.layout
    rec = i.recipe
    st = state_bytes(args, lay, rec.precision, rec.optimizer, i.accounting, rank, layers_by_stage, rec.lora)
    d = _act_dims(i)
    params = rank_params(args, lay, rank, layers_by_stage, i.recipe.lora)
    by_layer = {l: [] for l in layers}
    for p in params:
        if p.layer is not None:
            by_layer[p.layer].append(p)
    low = low_precision(i.recipe.precision)
    classic = i.accounting == "classic" and low
    fsdp = lay.uses_fsdp and not (classic and lay.zero_stage == 2)
    pbytes = BF16 if (low and (fsdp or classic)) else FP32
    host = {}
    if i.recipe.tiers.cpu_offload:
        st, host = cpu_offload_states(st)
    return _Rank(i, st, d, params, by_layer, [p for p in params if p.layer is None], classic, fsdp, pbytes, host)


class _Peaks:
    """A walk's candidate peaks, (total, phase, bytes by category) each: the largest is the rank's peak, and each
    category's own maximum over them is its size (kept as they come: a pipeline adds thousands)."""

    def __init__(self):
        self.best: tuple[int, str, dict] | None = None
        self.sizes: dict[str, int] = {}

    def add(self, phase: str, **cats) -> None:
        total = sum(cats.values())
        if self.best is None or total > self.best[0]:
            self.best = (total, phase, cats)
        self._grow(cats)

    def add_shifted(self, walk: "_Peaks", extra: dict) -> None:
        """Every candidate of `walk` with `extra` bytes added to its categories (what the rest of a schedule holds
        then): the same peak and sizes as adding each, at the cost of one."""
        total, phase, cats = walk.best
        if self.best is None or total + sum(extra.values()) > self.best[0]:
            shifted = {**cats, **{k: cats.get(k, 0) + v for k, v in extra.items()}}
            self.best = (total + sum(extra.values()), phase, shifted)
        self._grow({**walk.sizes, **{k: walk.sizes.get(k, 0) + v for k, v in extra.items()}})

    def _grow(self, cats: dict) -> None:
        sizes = self.sizes
        for key, v in cats.items():
            if v > sizes.get(key, 0):
                sizes[key] = v
            else:
                sizes.setdefault(key, 0)

    def result(self, r: _Rank, moe=None) -> dict:
        """{'peak', 'phase', 'at_peak', 'sizes', 'states', 'dims', 'moe'}."""
        peak, phase, cats = self.best
        return {"peak": peak, "phase": phase, "at_peak": cats, "sizes": dict(self.sizes), "states": r.st, "dims": r.d,
                "moe": moe}


def _walk(i: EstimateInputs, rank: int, layers_by_stage: list[list[int]]) -> dict:
    """Peak of rank `rank` (a pipeline rank; without a pipeline every rank is alike): its schedule's actions in order
    (paratrain/estimate/schedule.py; without a pipeline the schedule is one stage's forward and backward, the last
    micro-step's), each backward walked block by block, last to first, on top of what the rest of the schedule holds
    then; then the optimizer step.

    Held per micro-batch from its forward to its backward (its weight-gradient step "W" in the zero-bubble
    schedules): each block's saved tensors (less what activation offloading moved to host); a pipeline stage's
    output, which the stage keeps for its backward (on the last stage: the logits, the final norm's and the loss's
    saved tensors). A non-first stage's first block saves its received input, which is the stage's receive buffer
    when the residual stream is fp32 (not counted twice). Between "I" and "W" the zero-bubble schedules also keep
    the gradients of each weight's output.
    Held for the whole step: the token ids and targets of the micro-batches it runs, a pipeline's receive buffers
    (one activation and one gradient buffer per micro-batch and stage boundary, `PipelineStage` preallocates them),
    DDP's gradient buckets, and FSDP's working copies: without a pipeline gathered block by block (prefetched ahead,
    reduce-scattered after each block's backward); inside a pipeline step every block's gathered once and its
    gradients accumulated unsharded to the step's end (`Layout.reshard_after_forward`). Gradients of a stage exist
    from its first backward on (accumulation's earlier micro-steps, and classic accounting's preallocated buffers:
    all of them from the start)."""
    args, lay = i.model_args, i.layout
    pipelined = lay.pp > 1
    stages = lay.local_stages(rank) if pipelined else [0]
    layers_of = {s: lay.stage_layers(s) for s in stages} if pipelined else {0: layers_by_stage[0]}
    last_stage = lay.num_stages - 1 if pipelined else 0
    r = _rank(i, rank, layers_by_stage, [l for s in stages for l in layers_of[s]])
    st, d, params, by_layer = r.st, r.d, r.params, r.by_layer
    classic, fsdp, pbytes, local_numel = r.classic, r.fsdp, r.pbytes, r.local_numel
    moe = A.moe_dims(args, lay, i.recipe.micro_batch, i.recipe.seq_len, i.moe_imbalance) if args.moe_experts else None
    modes = block_checkpointing(i.recipe.checkpointing, args.n_layers, i.recipe.every_k)
    moe_of = {l: (moe if args.is_moe_layer(l) else None) for l in by_layer}
    size = segment_size(i.recipe.segment_blocks, args.n_layers)
    full = A.stored_by_block(d, modes, list(layers_of.values()), moe_of, size)  # each block's saved tensors
    # the blocks checkpointed with each block (its segment's, under segments; else itself), per stage
    unit_of = {l: unit for s in stages for unit in A.checkpoint_units(i.recipe.checkpointing, layers_of[s], size)
               for l in unit}
    moved, ahead_of = activation_offload_plan(i.recipe.tiers, args.n_layers, d, modes, moe_of, list(by_layer))
    stored = {l: full[l] - moved[l] for l in by_layer}  # what stays on the device (offloading moves the rest)
    emb_params, head_params = r.where("embedding"), r.where("head")
    per_block = fsdp and not pipelined  # FSDP gathers and reduce-scatters block by block (a pipeline: once a step)
    zero2 = per_block and not lay.reshard_after_forward  # gathered parameters kept from forward to backward
    gbytes = BF16 if classic else FP32  # gradient dtype held by the optimizer
    accum = i.recipe.accum_steps

    def reduced_grad_bytes(ps):  # this rank's gradients of these params once reduced (FSDP: its shards)
        ps = [p for p in ps if p.trainable]
        if classic:
            return math.ceil(local_numel(ps) / lay.shard_degree) * gbytes
        if fsdp:
            return sum(fsdp_numel(p, lay) for p in ps) * FP32
        return local_numel(ps) * FP32

    def step_grads(ps):  # gradient bytes these params hold on the device from their backward to the step's end
        if classic or (per_block and r.host):  # preallocated (counted in full); CPU offload: reduced to the host
            return 0
        if per_block:
            return reduced_grad_bytes(ps)
        if fsdp:
            return _fsdp_bytes(ps, lay, pbytes)[1]  # accumulated unsharded to the step's end
        return r.grad_numel(ps) * FP32

    # Megatron/DeepSpeed allocate their gradient buffers up front (classic accounting), and accumulation's earlier
    # micro-steps left every gradient: all live from the start, none added.
    g_const = st.grads if (classic or (accum > 1 and not pipelined)) else 0
    stage_grads = {s: step_grads([p for l in layers_of[s] for p in by_layer[l]]
                                 + (emb_params if s == 0 else []) + (head_params if s == last_stage else []))
                   for s in stages}
    block_grads = {l: step_grads(by_layer[l]) for l in by_layer}
    # FSDP block by block: the head's gradients stay unsharded until the root's post-backward, at backward's end
    head_grads = 0 if per_block else step_grads(head_params)
    root_grads_live = r.grad_numel(head_params) * pbytes if per_block else 0
    dw2 = {l: r.ffn_output(l) for l in by_layer}  # elements of the first weight gradient of a block's backward
    # DDP's flat bucket buffers are a second copy of the gradients (gradient_as_bucket_view=False); classic
    # frameworks reduce from one contiguous gradient buffer instead.
    ddp_buckets = r.grad_numel(params) * gbytes if (lay.uses_ddp and not classic) else 0
    autocast = st.autocast_copies
    binp = A.block_input(d)
    head = sum(b for _, b in A.head_saved(d))
    # the output weight's gradient in the dtype autograd sums it in: the unsharded parameter's under FSDP, autocast's
    # bf16 copy's, else fp32
    output_weight = [p for p in head_params if p.role == "output"] or r.where("embedding")
    loss_extra = A.loss_backward_extra(d, local_numel(output_weight) * (pbytes if fsdp else BF16 if d.regime ==
                                                                        "autocast" else FP32))
    logits = d.N * d.V * d.L if pipelined else 0  # a pipeline's last stage keeps its output for its backward
    shared_input = binp if (pipelined and d.R == FP32) else 0  # the first block saves the receive buffer itself
    # (an offloaded first block saves a host copy of it instead, and backward gets a device copy back)
    shared_of = {s: 0 if (s == 0 or moved[layers_of[s][0]]) else shared_input for s in stages if layers_of[s]}
    hold, hold_head = {}, {}  # per in-flight micro-batch: activations, and the last stage's logits and loss tensors
    for s in stages:
        h = sum(stored[l] for l in layers_of[s]) + (A.final_residual(d) if s == last_stage else binp)
        hold[s] = h - shared_of.get(s, 0)
        hold_head[s] = head + logits if s == last_stage else 0
    m = lay.pp_microbatches if pipelined else 1
    tokens = m * A.inputs_bytes(d)  # the micro-batches this rank runs (a pipeline's whole batch)
    p2p = sum(((s > 0) + (s < last_stage)) * m * binp for s in stages)

    # FSDP's working copies: unsharded bytes per block and of the root, and reduce-scatter inputs.
    site = grad_compression_site(lay, i.recipe.compression.method)
    rbytes = BF16 if site is CompressionSite.REDUCE_DTYPE else FP32
    unsh = {l: _fsdp_bytes(by_layer[l], lay, pbytes, rbytes if per_block else FP32) for l in by_layer} if fsdp else {}
    root_unsh = _fsdp_bytes(r.root, lay, pbytes)[0] if (fsdp and r.root) else 0
    gathered = sum(u for u, _ in unsh.values()) + root_unsh if (fsdp and not per_block) else 0
    held_comm = ddp_buckets + p2p + gathered  # communication buffers live the whole backward
    ahead = max(1, i.recipe.fsdp_backward_prefetch)  # blocks gathered ahead of the one in backward

    # Gradient compression (or the optimizer's own, 1-bit Adam's of the momenta): error feedback kept between steps;
    # the hook's temporaries (DDP: at the end of backward).
    run_comp = optimizer_entry(i.recipe.optimizer).run_compression(i.recipe.compression)
    comp_site = grad_compression_site(lay, run_comp.method)
    comp = None
    if comp_site.hooked:
        shapes = [local_shape(q, lay) for q in params if q.trainable]
        if comp_site is CompressionSite.REPLICATE_HOOK:
            shapes = [(math.ceil(sh[0] / lay.dp_shard), *sh[1:]) for sh in shapes]
        comp = compression_cost(run_comp, shapes,
                                lay.dp if comp_site is CompressionSite.DDP_HOOK else lay.dp_replicate)

    base = dict(parameters=st.params + st.rope_buffers * len(stages), frozen=st.frozen, optimizer=st.optimizer,
                master=st.master, compression=comp.state_bytes if comp else 0)
    # what an input-gradient step leaves for the weight-gradient step, per stage
    inter = {s: len(layers_of[s]) * _zb_intermediates(d) + (_zb_head_intermediates(d) if s == last_stage else 0)
             for s in stages}

    def backward(stage: int, kind: str, first_bwd: bool) -> _Peaks:
        """Candidate peaks of one stage's backward of one micro-batch, alone (the schedule adds what else is held):
        "B" (the whole backward), the zero-bubble input-gradient step "I" (nothing is freed: the graph is kept for
        "W", and each block leaves the gradients of its weights' outputs), or the weight-gradient step "W" (at its
        start, and at its end when the stage's gradients exist)."""
        found = _Peaks()

        def add(phase, **cats):  # (autocast's cached low-precision weights live until the backward ends)
            found.add(phase, **base, autocast_copies=autocast, **cats)

        layers, last = layers_of[stage], stage == last_stage
        where = f" (stage {stage}{', input gradients' if kind == 'I' else ''})" if pipelined else ""
        shared = shared_of.get(stage, 0)
        stage_acts = sum(stored[l] for l in layers) - shared
        keep = binp if not last else 0  # a stage's output stays referenced to the end of its backward
        if kind == "W":
            add(f"weight gradients (stage {stage})", gradients=0, activations=stage_acts + tokens + keep,
                logits_loss=(head + logits if last else 0), comm_buffers=held_comm,
                temporaries=len(layers) * _zb_intermediates(d) + (_zb_head_intermediates(d) if last else 0))
            add(f"end of weight gradients (stage {stage})", gradients=stage_grads[stage] if first_bwd else 0,
                activations=tokens, comm_buffers=held_comm)
            return found
        weights = kind == "B"
        grads_now = 0
        held = 0  # zero bubble: the weights' output gradients kept so far
        current_head = head + logits if (last and not weights) else 0  # kept for "W"
        comm = held_comm
        if per_block:
            if zero2:
                comm += sum(u for u, _ in unsh.values()) + root_unsh
            elif layers:  # the last block is not resharded after forward, except expert-parallel experts
                comm += _fsdp_bytes([p for p in by_layer[layers[-1]] if not (p.expert and lay.ep > 1)], lay,
                                    pbytes)[0]
        # The root's parameters are gathered again by its pre-backward, when the gradient reaches its forward's
        # output: the logits (the whole loss is computed after the model's forward), or the loss itself (a chunked
        # loss is part of the forward). zero2 keeps them gathered throughout.
        root_at_norm = root_unsh if (per_block and not zero2) else 0
        if last:
            micro = f" (micro-step {accum} of {accum})" if (accum > 1 and not pipelined) else ""
            add(f"loss backward{where or micro}", gradients=0, activations=stage_acts + A.final_residual(d) + tokens,
                logits_loss=head + logits + loss_extra, comm_buffers=comm + (root_at_norm if d.chunks > 1 else 0))
            if weights and first_bwd:  # (an input-gradient step makes no weight gradients)
                grads_now += head_grads
            if not weights:
                held += _zb_head_intermediates(d)
            # the final norm's backward: the head's gradients made, the logits gone (the peak once they are small:
            # chunked)
            add(f"final norm backward{where}", gradients=grads_now, activations=stage_acts + A.final_residual(d) +
                tokens, logits_loss=A.final_norm_backward(d) + current_head, comm_buffers=comm + root_at_norm,
                temporaries=held + root_grads_live)
        stored_below = stage_acts
        fetched: set[int] = set()
        rs_kept = 0  # FSDP block by block: the last reduce-scatter's buffer, kept until the next
        for idx in reversed(range(len(layers))):
            l = layers[idx]
            first = shared if idx == 0 else 0
            # an offloaded block's tensors are back for its backward, and the offloaded block below it is fetched
            # ahead
            stored_below -= (full[l] if l in fetched else stored[l]) - first
            if l in ahead_of:
                stored_below += moved[ahead_of[l]]
                fetched.add(ahead_of[l])
            # Under segments the blocks below l in its segment were recomputed with it and hold their tensors (FSDP:
            # their parameters stay gathered, the recomputation ran inside backward) until their own backward.
            unit = unit_of[l]
            before = unit[:unit.index(l)]
            waiting = sum(A.segment_recomputed(d, m == unit[0], moe_of[m]) for m in before)
            b_acts, b_temps = A.block_backward_live(d, modes[l], moe_of[l], not before)
            b_acts -= first
            from_head = binp if (last and idx == len(layers) - 1) else 0  # made by the loss/output backward
            what = f"block {l}{where}"
            comm = held_comm
            if per_block:
                prefetched = sum(unsh[m][0] for m in set(layers[max(0, idx - ahead):idx]) | set(before))
                kept_gathered = sum(unsh[k][0] for k in layers[:idx - 1]) if (zero2 and idx > 1) else 0
                comm += unsh[l][0] + prefetched + rs_kept + root_unsh + kept_gathered
            new_grad = dw2[l] * gbytes if (first_bwd and weights and not fsdp) else 0  # FSDP: unsharded, below
            temps = b_temps + waiting + (dw2[l] * pbytes if fsdp else 0) + root_grads_live - from_head
            if weights:
                add(f"backward of {what}", gradients=grads_now + new_grad,
                    activations=stored_below + b_acts + tokens + keep, logits_loss=from_head, comm_buffers=comm,
                    temporaries=temps)
            else:  # nothing of the block is freed; its weights' output gradients accumulate
                add(f"backward of {what}", gradients=grads_now, activations=stage_acts + tokens + keep,
                    logits_loss=from_head + current_head, comm_buffers=comm,
                    temporaries=held + b_temps - (stored[l] - first - b_acts) - from_head)
                held += _zb_intermediates(d)
                add(f"end of {what}", gradients=grads_now, activations=stage_acts + tokens + keep,
                    logits_loss=current_head, comm_buffers=comm,
                    temporaries=held + (ZB_NORM_BACKWARD_VALUES * d.N // d.seq_div * d.C - d.N // d.seq_div * d.C)
                    * FP32 + binp)
            if lay.cp > 1 and weights:
                # Ring attention's backward (context parallel): the block's MLP is done (its gradients exist,
                # unsharded under FSDP), its attention tensors are still saved, the ring's buffers are live beside
                # the incoming gradients (the residual's and the attention output's). (Under checkpointing the
                # recomputed tensors count as temporaries, what the checkpoint holds as activations.)
                live = A.ring_backward_block(d, modes[l])
                kept = min(live, full[l]) if recomputes(modes[l]) else live  # (an offloaded block's are back)
                done = r.after_attention_inputs(l) * pbytes
                dout = d.N * d.Hq * d.D * d.L
                add(f"ring attention backward of {what}", gradients=grads_now,
                    activations=stored_below + kept + tokens + keep, logits_loss=0, comm_buffers=comm,
                    temporaries=live - kept + A.ring_backward_temps(d) + dout + binp + done + root_grads_live
                    + waiting)
            if recomputes(modes[l]) and l == unit[-1]:  # (a segment recomputes in its last block's backward)
                r_acts, r_temps = A.recompute_end(d, modes[l], moe_of[l], not before)
                add(f"recomputation of {what}", gradients=grads_now,
                    activations=stored_below + r_acts + tokens + keep - first, logits_loss=from_head + current_head,
                    comm_buffers=comm, temporaries=held + r_temps + waiting - from_head + root_grads_live)
            if per_block:
                # The end of block l's backward (its attention backward), before FSDP's post-backward: all its
                # unsharded gradients exist (what dominates when the micro-batch is small); of its activations only
                # the input is left; SDPA's backward has made dq, dk, dv, then the q/k/v input's gradient, beside
                # the incoming one.
                q_size = d.N * d.Hq * d.D * d.L
                add(f"end of {what}'s backward", gradients=grads_now, activations=stored_below + tokens + binp,
                    logits_loss=0, comm_buffers=comm,
                    temporaries=binp + 3 * q_size + d.N * d.C * d.L + root_grads_live + unsh[l][0] + waiting)
                # FSDP's post-backward of block l: its parameters resharded, its gradients copied into the
                # reduce-scatter input, the sharded output allocated (gloo also copies the input: CPU runs only).
                rs_in = unsh[l][1]
                rs_out = rs_in // lay.shard_degree
                comm = (ddp_buckets + prefetched + rs_in + rs_out + (rs_in if i.target.device == "cpu" else 0)
                        + root_unsh + kept_gathered)
                add(f"reduce-scatter of {what}", gradients=grads_now, activations=stored_below + tokens,
                    logits_loss=0, comm_buffers=comm, temporaries=binp + root_grads_live + dw2[l] * pbytes + waiting)
                rs_kept = rs_in
            if weights and first_bwd:
                grads_now += block_grads[l]
        return found

    peaks = _Peaks()
    # What the rank's stages hold as the schedule runs: per micro-batch forwarded and not yet (weight-)backwarded its
    # `hold` (and the last stage's `hold_head`); per micro-batch of a zero-bubble schedule whose input gradients are
    # done and weight gradients not yet, its `inter`; and the gradients of the stages that have run a backward.
    # The multi-stage schedules wait for their sends only at the end of the step, and a send keeps its tensor: every
    # stage output sent to another rank (once its micro-batch is backwarded, no longer counted in `hold`) and every
    # input gradient sent back stays allocated to the end of the step.
    stash_sends = pipelined and multi_stage(lay.pp_schedule)
    remote_next = {s: s < last_stage and lay.stage_owner(s + 1) != rank for s in stages}
    remote_prev = {s: s > 0 and lay.stage_owner(s - 1) != rank for s in stages}
    actions = rank_actions(lay.pp_schedule, lay.pp, lay.pp_virtual, m, rank) if pipelined else ((0, "F", 0),
                                                                                               (0, "B", 0))
    held = held_head = grads_so_far = sent_out = sent_grads = 0
    grads_done: set[int] = set()
    walked: dict = {}
    for stage, kind, _ in actions:
        if kind == "F":
            held += hold[stage]
            held_head += hold_head[stage]
            continue
        if kind == "I" and stage == 0:
            continue  # the first stage has no input gradients: its "W" runs the whole backward
        if kind == "W" and stage == 0:
            kind = "B"
        others = held - hold[stage] + sent_out - (inter[stage] if kind == "W" else 0)
        first_bwd = stage not in grads_done and not g_const
        # The stage's own walk is the same at every micro-batch (what else is held only adds to each of its
        # candidates): walked once per (stage, kind, first backward), shifted by this point's additions.
        if (stage, kind, first_bwd) not in walked:
            walked[stage, kind, first_bwd] = backward(stage, kind, first_bwd)
        peaks.add_shifted(walked[stage, kind, first_bwd], {
            "pipeline": others, "logits_loss": held_head - hold_head[stage], "gradients": g_const + grads_so_far,
            "comm_buffers": sent_grads})
        if kind in ("I", "B") and stash_sends and remote_prev[stage]:
            sent_grads += binp
        if kind == "I":
            held += inter[stage]
        else:
            held -= hold[stage]
            held_head -= hold_head[stage]
            if first_bwd:
                grads_so_far += stage_grads[stage]
            grads_done.add(stage)
            if kind == "W":
                held -= inter[stage]
            if stash_sends and remote_next[stage]:
                sent_out += binp

    # the end of a pipeline step: FSDP reshards and reduce-scatters each group's accumulated gradients (the largest
    # group's buffers at the worst time: all gradients still unsharded)
    if fsdp and not per_block and unsh:
        rs_in = max(x for _, x in unsh.values())
        peaks.add("reduce-scatter after the last micro-batch", **base, gradients=sum(stage_grads.values()),
                  comm_buffers=held_comm + rs_in // lay.shard_degree + (rs_in if i.target.device == "cpu" else 0),
                  activations=tokens)
    # O: the optimizer step
    opt_temp = 0
    if i.recipe.optimizer_impl != "fused" and optimizer_entry(i.recipe.optimizer).foreach_temporary:
        # _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) per parameter group (matrices, then norm gains)
        small = reduced_grad_bytes([p for p in params if len(p.shape) < 2])
        opt_temp = max(r.host.get("gradients", st.grads) - small, small) * (FP32 // gbytes)
        if lay.zero1:
            opt_temp = math.ceil(st.optimizer / 2)
    if optimizer_entry(i.recipe.optimizer).hidden_state is not None:
        opt_temp = max(opt_temp, muon_temporaries([p for p in params if p.hidden_matrix and p.trainable], lay,
                                                  reduced_grad_bytes, i.target.device == "cpu"))
    host_states = _host_total(r.host, opt_temp)
    if r.host:
        opt_temp = 0  # the optimizer steps on the CPU
    if comp is not None and comp_site is CompressionSite.DDP_HOOK:  # the hook compresses the last bucket: all grads
        peaks.add("gradient compression (DDP hook)", **base, gradients=st.grads, comm_buffers=ddp_buckets + p2p,
                  temporaries=comp.transient_bytes)
    if comp is not None and run_comp is not i.recipe.compression:  # the optimizer compresses its momenta in its step
        opt_temp = max(opt_temp, comp.transient_bytes)
    peaks.add("optimizer step", **base, gradients=st.grads, comm_buffers=ddp_buckets + p2p, temporaries=opt_temp)

    out = peaks.result(r, moe)
    out["sizes"]["gradients"] = max(out["sizes"].get("gradients", 0), st.grads)
    host_acts = int(in_flight(lay, rank) * sum(moved.values()))  # offloaded micro-batches in flight
    out["host"] = {**host_states, **({"activations": host_acts} if host_acts else {})}
    return out


def muon_temporaries(hidden: list, lay: Layout, reduced_grad_bytes, gloo: bool) -> int:
    """What Muon's step holds beside the states (paratrain/training/muon.py), at its largest batch (the hidden
    matrices of one shape): their updates (the Nesterov look-ahead; this rank's shards), and either their results
    (orthogonalised here: one process, ZeRO-1) or the stack of the updates, the whole matrices this rank
    orthogonalises (its share of the stack: input and result) and the stack brought back; plus the iteration's own
    matrices (X, its Gram and the quintic's update, for one matrix). On gloo (a CPU) DTensor's all-to-all is an
    all-gather and a slice: the share in flight is the whole stack."""
    if not hidden:
        return 0
    shapes: dict = {}
    for p in hidden:
        shapes.setdefault(p.shape, []).append(p)
    group = max(shapes.values(), key=lambda ps: reduced_grad_bytes(ps))
    mine = reduced_grad_bytes(group)
    rows, cols = group[0].shape[-2:]
    small, large = min(rows, cols), max(rows, cols)
    iteration = (2 * small * large + 2 * small * small) * FP32
    holders = max(1, lay.world_size // lay.pp)
    if holders == 1 or lay.zero1:
        return 2 * mine + iteration
    whole = len(group) * math.prod(group[0].shape) * FP32
    share = whole if gloo else math.ceil(len(group) / holders) * math.prod(group[0].shape) * FP32
    return 3 * mine + 2 * share + iteration


def _host_total(states: dict, opt_temp: int) -> dict:
    """Host memory of CPU-offloaded model states at the optimizer step (its foreach temporaries are host memory too)."""
    if not states:
        return {}
    return {**states, **({"temporaries": opt_temp} if opt_temp else {})}


def _zb_intermediates(d: A.ActDims) -> int:
    """What a zero-bubble input-gradient step keeps of one block for its weight-gradient step: the gradient of each
    weight's output (q, k, v, o, w1, w3, w2 in the matmul dtype, the two norm gains' in the residual dtype, and the
    per-head q/k norm gains' in the matmul dtype)."""
    N = d.N
    head_norms = (d.Hq + d.Hkv) * d.D if d.qk_norm else 0
    return N * (d.Hq * d.D + 2 * d.Hkv * d.D + 2 * d.C + 2 * d.F + head_norms) * d.L + 2 * N // d.seq_div * d.C * d.R


def _zb_head_intermediates(d: A.ActDims) -> int:
    """The last stage's: the logits' gradient (the output weight's) and the final norm gain's."""
    return d.N * d.V * FP32 + d.N // d.seq_div * d.C * d.R


# The end of a block's input-gradient step: the attention norm's backward in fp32 (x^2, mean, rsqrt products) beside
# the incoming gradient, in units of N x C fp32 values (measured: bench/memory_accuracy.py zero-bubble rows).
ZB_NORM_BACKWARD_VALUES = 6


def candidate_ranks(lay: Layout, layers_by_stage: list[list[int]]) -> list[int]:
    """The pipeline ranks that can hold the most (the planner estimates only these): the first two and the last two
    (the first holds the most micro-batches in flight, the last the logits, and with an even split the next ones hold
    the most blocks), the owners of the first and last stage, and every rank with the most blocks."""
    most = max(len(b) for b in layers_by_stage)
    ranks = {0, min(1, lay.pp - 1), max(lay.pp - 2, 0), lay.pp - 1, lay.stage_owner(0),
             lay.stage_owner(lay.num_stages - 1)}
    ranks |= {r for r, b in enumerate(layers_by_stage) if len(b) == most and r <= 2}
    return sorted(ranks)


def estimate(i: EstimateInputs, suggest: bool = True, all_ranks: bool = True) -> Estimate:
    """The per-rank memory estimate for one configuration (UserError on inputs that cannot run). all_ranks=False
    walks only the pipeline ranks that can be the worst (`candidate_ranks`; the planner's shortcut): same worst
    rank, `stages` then lists only those."""
    i = validate(i)
    lay, args = i.layout, i.model_args
    layers_by_stage = rank_layers(lay, args)
    ranks = range(lay.pp) if (all_ranks or lay.pp <= 4) else candidate_ranks(lay, layers_by_stage)
    walks = {s: _walk(i, s, layers_by_stage) for s in ranks}
    worst = max(walks, key=lambda s: walks[s]["peak"])
    w = walks[worst]
    overhead = i.target.overhead_bytes
    if overhead is None:
        overhead = default_overhead(lay, i.target.device)
    at = {k: int(v) for k, v in w["at_peak"].items() if v}
    at["overhead"] = overhead
    sizes = {k: int(v) for k, v in w["sizes"].items() if v}
    sizes["overhead"] = overhead
    d = w["dims"]
    notes = list(w["states"].notes)
    half = compute_precision(i.recipe.precision)  # (the 16-bit format of the regimes that have one: bf16 or fp16)
    regime = {"single": "fp32 activations", "autocast": f"autocast: fp32 residual stream, {half} matmul/attention",
              "pure": f"{half} compute, fp32 norm statistics and loss"}[d.regime]
    notes.append(f"activations: {regime}; per block {fmt_bytes(A.block_stored(d, 'none', None), 'GiB')} "
                 f"without checkpointing")
    if w["moe"] is not None:
        notes.append("MoE layers: activation formula from paratrain/models/moe.py, not yet checked against "
                     f"measurement; routed-token imbalance x{i.moe_imbalance:g}")
    if lay.pp > 1:
        notes.append(f"pipeline: at most {in_flight(lay, worst):g} micro-batches in flight on pp rank {worst} "
                     f"({lay.pp_schedule}; its order of forwards and backwards walked, checked against measurement in "
                     "bench/memory_accuracy.py)")
    micro = lay.pp_microbatches if lay.pp > 1 else i.recipe.accum_steps
    gathers = fsdp_gathers_per_step(lay, args, micro)
    if gathers:
        notes.append(f"FSDP: {gathers} parameter all-gathers per step on the rank with the most blocks"
                     + (" (each group gathered once per pipeline step and kept to its end)" if lay.pp > 1 else ""))
    if lay.uses_ddp and i.accounting != "classic":
        notes.append("DDP keeps flat gradient buckets as large as the gradients (gradient_as_bucket_view=False)")
    est = Estimate(i, int(w["peak"]), overhead, at, sizes, w["phase"], worst, notes,
                   per_block=A.block_saved(d, None), fsdp_all_gathers=gathers,
                   host={k: int(v) for k, v in max((x.get("host", {}) for x in walks.values()),
                                                   key=lambda h: sum(h.values())).items()})
    if lay.pp > 1:
        est.stages = [{"stage": s, "tensor_peak_bytes": int(x["peak"]), "total_bytes": int(x["peak"]) + overhead,
                       "phase": x["phase"]} for s, x in walks.items()]
    if low_precision(i.recipe.precision) and optimizer_entry(i.recipe.optimizer).state_bytes and i.recipe.lora is None:
        est.zero_ranks = lay.dp if lay.dp > 1 else 8
        est.zero = zero_table(args, est.zero_ranks, i.recipe.optimizer)
    if suggest and est.fits is False:

        est.suggestion, est.alternatives = suggest_changes(i, lambda c: estimate(c, suggest=False))
        est.searched = True
    return est


def forward_end_bytes(i: EstimateInputs) -> dict[str, int]:
    """Bytes stored when the forward of one micro-batch ends (one process, or the last pipeline stage): the
    blocks' activations as checkpointing leaves them (+ the final residual and the token ids) and the final
    norm / output / loss tensors kept for backward. What activation checkpointing is about."""
    args, lay = i.model_args, i.layout
    d = _act_dims(i)
    moe = A.moe_dims(args, lay, i.recipe.micro_batch, i.recipe.seq_len, i.moe_imbalance) if args.moe_experts else None
    layers = rank_layers(lay, args)[lay.pp - 1]
    modes = block_checkpointing(i.recipe.checkpointing, args.n_layers, i.recipe.every_k)
    moe_of = {l: moe if args.is_moe_layer(l) else None for l in layers}
    stages = [lay.stage_layers(s) for s in lay.local_stages(lay.pp - 1)] if lay.pp > 1 else [layers]
    acts = sum(A.stored_by_block(d, modes, stages, moe_of,
                                 segment_size(i.recipe.segment_blocks, args.n_layers)).values())
    acts -= sum(activation_offload_plan(i.recipe.tiers, args.n_layers, d, modes, moe_of, layers)[0].values())
    return {"activations": acts + A.final_residual(d) + A.inputs_bytes(d),
            "logits_loss": sum(b for _, b in A.head_saved(d))}
