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
maximum over the step (their sum is the naive upper bound other tools print). The walk (`_Walk`, one stage's backward
`_StageBackward`) reads one rank's context (`_Rank`: model states, activation sizes, parameters by block, FSDP's
dtypes) and collects its candidate peaks in one `_Peaks`. What is asked and its checks
are inputs.py, the printed table report.py, the change that would fit suggest.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from operator import mul

from paratrain import capabilities
from paratrain.estimate import activations as A
from paratrain.estimate.gpus import GiB, fits, fmt_bytes, usable_bytes
from paratrain.estimate.inputs import EstimateInputs, validate
from paratrain.estimate.model_states import (BF16, FP32, Param, StateBytes, fsdp_gathers_per_step, fsdp_numel,
                                             local_shape, model_params, rank_layers, rank_params, state_bytes,
                                             zero_table)
from paratrain.capabilities import optimizer_entry
from paratrain.capabilities.segment_checkpointing import segment_size
from paratrain.layout import Layout
from paratrain.memory import HOST_HEADROOM
from paratrain.models.presets import count_active_params
from paratrain.models.registry import family_of
from paratrain.modes import CheckpointMode, CompressionSite, Schedule
from paratrain.estimate.report import format_table
from paratrain.estimate.schedule import max_in_flight, rank_actions
from paratrain.estimate.suggest import suggest_changes
from paratrain.estimate.tiers import saved_on_host

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
        switched = capabilities.switch_values(i.recipe.capabilities)  # (JSON: each key without its section)
        switched = {key.split(".")[1]: value for key, value in switched.items()}
        return {
            "model": i.model_name, "parameters": sum(p.numel for p in model_params(i.model_args)),
            "active_parameters": count_active_params(i.model_args),
            "trainable_parameters": sum(p.numel for p in model_params(i.model_args, i.recipe.lora) if p.trainable),
            "lora": None if i.recipe.lora is None else i.recipe.lora.record(),
            "layout": {**dataclasses.asdict(lay), "world_size": lay.world_size, "description": lay.describe()},
            "precision": i.recipe.precision, "accounting": i.accounting, "optimizer": i.recipe.optimizer,
            "optimizer_impl": i.recipe.optimizer_impl, "checkpointing": i.recipe.checkpointing,
            "every_k": i.recipe.every_k, "segment_blocks": segment_size(i.recipe.segment_blocks, i.model_args.n_layers),
            "compression": i.recipe.compression.wire_settings(),
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
            # ([memory]'s keys by their names: the switches', the chunked loss's and activation and CPU offload's)
            "memory_tiers": switched,
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


@functools.lru_cache(maxsize=1024)
def _backward_events(schedule, pp: int, virtual: int, m: int, rank: int, grads_from_start: bool) -> tuple:
    """The backwards of pipeline rank `rank`'s schedule (`rank_actions`; schedule None: one stage's forward and
    backward, no pipeline) as `_Walk.schedule` shifts them, grouped by (stage, kind, first backward, what else is held
    as counts per local stage of in-flight micro-batches and of zero-bubble intermediates, flags of the stages whose
    gradients exist), in order of first occurrence. Within a group only the stage outputs and input gradients kept
    sent grow (multi-stage schedules keep them to the step's end), so its last backward holds the most of each and
    its totals never fall: each group is (its key..., first backward's index and sends, the first backward's index and
    sends with the most sends, the last one's sends). `grads_from_start`: gradients live from the step's start (no
    first backward adds them)."""
    if schedule is None:
        stages, last, owner, actions = [0], 0, (lambda s: 0), ((0, "F", 0), (0, "B", 0))
    else:
        lay = Layout(pp=pp, pp_schedule=schedule, pp_virtual=virtual)
        stages, last, owner = lay.local_stages(rank), lay.num_stages - 1, lay.stage_owner
        actions = rank_actions(schedule, pp, virtual, m, rank)
    at = {s: j for j, s in enumerate(stages)}
    stash_sends = schedule is not None and Schedule(schedule).multi_stage
    held, inter, done = [0] * len(stages), [0] * len(stages), [0] * len(stages)
    no_grads = (0,) * len(stages)
    sent_out = sent_grads = 0
    groups: dict = {}  # key -> [first index, its sends, best index, its sends, last sends]
    for index, (stage, kind, _) in enumerate(actions):
        j = at[stage]
        if kind == "F":
            held[j] += 1
            continue
        if kind == "I" and stage == 0:
            continue  # the first stage has no input gradients: its "W" runs the whole backward
        if kind == "W" and stage == 0:
            kind = "B"
        first_bwd = not done[j] and not grads_from_start
        held[j] -= 1  # (what else is held: not this micro-batch's)
        if kind == "W":
            inter[j] -= 1
        key = (stage, kind, first_bwd, tuple(held), tuple(inter), no_grads if grads_from_start else tuple(done))
        sends = (sent_out, sent_grads)
        group = groups.get(key)
        if group is None:
            groups[key] = [index, sends, index, sends, sends]
        else:
            if sum(sends) > sum(group[3]):
                group[2], group[3] = index, sends
            group[4] = sends
        if kind == "W":
            inter[j] += 1
        if kind in ("I", "B") and stash_sends and stage > 0 and owner(stage - 1) != rank:
            sent_grads += 1
        if kind == "I":
            held[j] += 1
            inter[j] += 1
        else:
            done[j] = 1
            if kind == "W":
                inter[j] -= 1
            if stash_sends and stage < last and owner(stage + 1) != rank:
                sent_out += 1
    return tuple((*key, *group) for key, group in groups.items())


def in_flight(layout: Layout, rank: int) -> float:
    """The most micro-batches whose activations pipeline rank `rank` holds at once, in units of all its blocks, from
    its schedule's order of forwards and backwards (paratrain/estimate/schedule.py). 1 without a pipeline."""
    if layout.pp == 1:
        return 1.0

    return max_in_flight(layout.pp_schedule, layout.pp, layout.pp_virtual, layout.pp_microbatches, rank)


_FSDP_BYTES: dict = {}


def _fsdp_bytes(params: list[Param], layout: Layout, pbytes: int, rbytes: int = FP32) -> tuple[int, int]:
    """(unsharded bytes in the compute dtype, reduce-scatter input bytes in the reduce dtype: fp32, or bf16 with
    bf16 gradient compression) of an FSDP group: each parameter padded to a multiple of the ranks it is sharded over
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
    staging: int = 0  # checkpoint.async_save: the staging copy of what this rank checkpoints, in host memory

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
    pieces = capabilities.loss_pieces(rec.capabilities, i.layout, rec.precision, i.model_args.vocab_size,
                                      rec.micro_batch * rec.seq_len)  # (the chunked loss's, resolved)
    return A.act_dims(i.model_args, i.layout, rec.precision, i.accounting, rec.micro_batch, rec.seq_len,
                      i.target.device, rec.lora is not None, pieces)


def _rank(i: EstimateInputs, rank: int, layers_by_stage: list[list[int]], layers: list[int]) -> _Rank:
    args, lay = i.model_args, i.layout
    rec = i.recipe
    st = state_bytes(args, lay, rec.precision, rec.optimizer, i.accounting, rank, layers_by_stage, rec.lora,
                     rec.capabilities)
    d = _act_dims(i)
    params = rank_params(args, lay, rank, layers_by_stage, i.recipe.lora)
    by_layer = {l: [] for l in layers}
    for p in params:
        if p.layer is not None:
            by_layer[p.layer].append(p)
    low = i.recipe.precision.low_precision
    classic = i.accounting == "classic" and low
    fsdp = lay.uses_fsdp and not (classic and lay.zero_stage == 2)
    pbytes = BF16 if (low and (fsdp or classic)) else FP32
    # a background checkpoint first copies the rank's saved state (trainable parameters, master weights, optimizer
    # state) to host buffers it keeps for the run (training/checkpoint.py staging_buffers)
    staging = st.params + st.master + st.optimizer if rec.async_save else 0
    host = {}
    for capability in rec.capabilities:  # (CPU offload: the sharded states in host memory)
        moved = capability.host_states(st)
        if moved is not None:
            st, host = moved
    return _Rank(i, st, d, params, by_layer, [p for p in params if p.layer is None], classic, fsdp, pbytes, host,
                 staging)


# The categories a schedule adds to each backward's own peaks: what the rest of the schedule holds then.
SHIFTED = ("pipeline", "logits_loss", "gradients", "comm_buffers")


class _Peaks:
    """A walk's candidate peaks, (total, phase, bytes by category) each: the largest is the rank's peak, and each
    category's own maximum over them is its size (kept as they come: a pipeline adds thousands)."""

    def __init__(self):
        self.best: tuple[int, str, dict] | None = None  # (read through `peak()`: its bytes may be pending)
        self.sizes: dict[str, int] = {}
        self.shifted: set = set()  # the walks added shifted so far (their unshifted sizes are grown in already)
        self.pending: tuple[dict, dict] | None = None  # the best's (categories, extra) until its bytes are asked for

    def peak(self) -> tuple[int, str, dict] | None:
        """The largest candidate peak: (total, phase, bytes by category)."""
        if self.pending is not None:  # (a schedule shifts thousands of best peaks before its end: one is built)
            cats, extra = self.pending
            self.best = (*self.best[:2], {**cats, **{k: cats.get(k, 0) + v for k, v in extra.items()}})
            self.pending = None
        return self.best

    def add(self, phase: str, **cats) -> None:
        total = sum(cats.values())
        if self.best is None or total > self.best[0]:
            self.best, self.pending = (total, phase, cats), None
        self._grow(cats)

    def add_shifted(self, shifts: dict, best: tuple | None) -> None:
        """Every candidate of each walk of `shifts` ({walk: [the largest bytes added to each of SHIFTED's categories
        over its shifts]}, in the order the walks were first shifted) with what the rest of a schedule held at each
        shift: the same peak and sizes as adding each candidate, at the cost of one per walk. `best`: (total, walk,
        its bytes added) of the first shift reaching the largest total (a schedule shifts thousands: only the best's
        bytes are built)."""
        if best is not None and (self.best is None or best[0] > self.best[0]):
            total, walk, extra = best
            _, phase, cats = walk.peak()
            self.best, self.pending = (total, phase, None), (cats, dict(zip(SHIFTED, extra)))
        for walk, most in shifts.items():
            self._grow({**walk.sizes, **{k: walk.sizes.get(k, 0) + v for k, v in zip(SHIFTED, most)}})

    def _grow(self, cats: dict) -> None:
        sizes = self.sizes
        for key, v in cats.items():
            if v > sizes.get(key, 0):
                sizes[key] = v
            else:
                sizes.setdefault(key, 0)

    def result(self, r: _Rank, moe=None) -> dict:
        """{'peak', 'phase', 'at_peak', 'sizes', 'states', 'dims', 'moe'}."""
        peak, phase, cats = self.peak()
        return {"peak": peak, "phase": phase, "at_peak": cats, "sizes": dict(self.sizes), "states": r.st, "dims": r.d,
                "moe": moe}


def rank_walk(i: EstimateInputs, rank: int) -> "_Walk":
    """Pipeline rank `rank`'s walk of a training step, set up and not yet walked (`_walk`; tests walk its schedule
    both ways: `schedule_by_events`, `schedule_in_order`)."""
    return _Walk(validate(i), rank, rank_layers(i.layout, i.model_args))


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
    walk = _Walk(i, rank, layers_by_stage)
    peaks = walk.schedule()
    walk.end_of_pipeline_step(peaks)
    host_states = walk.optimizer_step(peaks)
    return walk.result(peaks, host_states)


class _Walk:
    """One rank's walk of a training step (`_walk`): what its stages hold, set up once concern by concern (the
    rank's stages, activations, gradients, communication buffers, gradient compression), then its schedule's
    backwards (`_StageBackward`), the end of a pipeline step and the optimizer step, collected in one `_Peaks`."""

    def __init__(self, i: EstimateInputs, rank: int, layers_by_stage: list[list[int]]):
        self.i, self.rank = i, rank
        self._set_up_stages(layers_by_stage)
        self._set_up_activations()
        self._set_up_gradients()
        self._set_up_communication()
        self._set_up_compression()
        self._set_up_held_throughout()

    def _set_up_stages(self, layers_by_stage: list[list[int]]) -> None:
        """The rank's pipeline stages and their blocks, its `_Rank` context and the MoE dimensions."""
        i, rank = self.i, self.rank
        args, lay = self.args, self.lay = i.model_args, i.layout
        pipelined = self.pipelined = lay.pp > 1
        stages = self.stages = lay.local_stages(rank) if pipelined else [0]
        layers_of = self.layers_of = {s: lay.stage_layers(s) for s in stages} if pipelined else {0: layers_by_stage[0]}
        self.last_stage = lay.num_stages - 1 if pipelined else 0
        r = self.r = _rank(i, rank, layers_by_stage, [l for s in stages for l in layers_of[s]])
        self.st, self.d, self.params, self.by_layer = r.st, r.d, r.params, r.by_layer
        self.classic, self.fsdp, self.pbytes = r.classic, r.fsdp, r.pbytes
        self.moe = (A.moe_dims(args, lay, i.recipe.micro_batch, i.recipe.seq_len, i.moe_imbalance) if args.moe_experts
                    else None)

    def _set_up_activations(self) -> None:
        """What each block saves (less what activation offloading moves), what each stage holds per micro-batch in
        flight, the token ids and a pipeline's receive buffers."""
        i, args, d, by_layer, stages = self.i, self.args, self.d, self.by_layer, self.stages
        layers_of, last_stage, pipelined = self.layers_of, self.last_stage, self.pipelined
        modes = self.modes = i.recipe.checkpointing.block_checkpointing(args.n_layers, i.recipe.every_k)
        moe_of = self.moe_of = {l: (self.moe if args.is_moe_layer(l) else None) for l in by_layer}
        present = i.recipe.capabilities  # (a checkpointing mode that is a capability groups the blocks)
        full = self.full = A.stored_by_block(d, modes, list(layers_of.values()), moe_of, present)  # each block's saved
        # the blocks checkpointed with each block (its segment's, under segments; else itself), per stage
        self.unit_of = {l: unit for s in stages for unit in capabilities.checkpoint_units(present, layers_of[s],
                                                                                          args.n_layers) for l in unit}
        moved, self.ahead_of = saved_on_host(i.recipe.capabilities, args.n_layers, d, modes, moe_of, list(by_layer))
        self.moved = moved
        stored = self.stored = {l: full[l] - moved[l] for l in by_layer}  # what stays on the device (offloading
        # moves the rest)
        binp = self.binp = A.block_input(d)
        head = self.head = sum(b for _, b in A.head_saved(d))
        logits = self.logits = d.N * d.V * d.L if pipelined else 0  # a pipeline's last stage keeps its output for
        # its backward
        shared_input = binp if (pipelined and d.R == FP32) else 0  # the first block saves the receive buffer itself
        # (an offloaded first block saves a host copy of it instead, and backward gets a device copy back)
        self.shared_of = {s: 0 if (s == 0 or moved[layers_of[s][0]]) else shared_input for s in stages
                          if layers_of[s]}
        # per in-flight micro-batch: activations, and the last stage's logits and loss tensors
        self.hold, self.hold_head = {}, {}
        for s in stages:
            h = sum(stored[l] for l in layers_of[s]) + (A.final_residual(d) if s == last_stage else binp)
            self.hold[s] = h - self.shared_of.get(s, 0)
            self.hold_head[s] = head + logits if s == last_stage else 0
        m = self.m = self.lay.pp_microbatches if pipelined else 1
        self.tokens = m * A.inputs_bytes(d)  # the micro-batches this rank runs (a pipeline's whole batch)
        self.p2p = sum(((s > 0) + (s < last_stage)) * m * binp for s in stages)

    def _set_up_gradients(self) -> None:
        """When each stage's and block's gradients appear and how many bytes they hold, and the loss's backward."""
        i, lay, r, d, st = self.i, self.lay, self.r, self.d, self.st
        pipelined, by_layer, last_stage = self.pipelined, self.by_layer, self.last_stage
        emb_params, head_params = r.where("embedding"), r.where("head")
        per_block = self.per_block = self.fsdp and not pipelined  # FSDP gathers and reduce-scatters block by block
        # (a pipeline: once a step)
        self.zero2 = per_block and not lay.reshard_after_forward  # gathered parameters kept from forward to backward
        self.gbytes = BF16 if self.classic else FP32  # gradient dtype held by the optimizer
        accum = self.accum = i.recipe.accum_steps
        # Megatron/DeepSpeed allocate their gradient buffers up front (classic accounting), and accumulation's earlier
        # micro-steps left every gradient: all live from the start, none added.
        self.g_const = st.grads if (self.classic or (accum > 1 and not pipelined)) else 0
        self.stage_grads = {s: self.step_grads([p for l in self.layers_of[s] for p in by_layer[l]]
                                               + (emb_params if s == 0 else [])
                                               + (head_params if s == last_stage else []))
                            for s in self.stages}
        self.block_grads = {l: self.step_grads(by_layer[l]) for l in by_layer}
        # FSDP block by block: the head's gradients stay unsharded until the root's post-backward, at backward's end
        self.head_grads = 0 if per_block else self.step_grads(head_params)
        self.root_grads_live = r.grad_numel(head_params) * self.pbytes if per_block else 0
        self.dw2 = {l: r.ffn_output(l) for l in by_layer}  # elements of the first weight gradient of a block's
        # backward
        # the output weight's gradient in the dtype autograd sums it in: the unsharded parameter's under FSDP,
        # autocast's bf16 copy's, else fp32
        output_weight = [p for p in head_params if p.role == "output"] or r.where("embedding")
        self.loss_extra = A.loss_backward_extra(d, r.local_numel(output_weight) * (
            self.pbytes if self.fsdp else BF16 if d.regime == "autocast" else FP32))

    def reduced_grad_bytes(self, ps) -> int:
        """This rank's gradients of these params once reduced (FSDP: its shards)."""
        ps = [p for p in ps if p.trainable]
        if self.classic:
            return math.ceil(self.r.local_numel(ps) / self.lay.shard_degree) * self.gbytes
        if self.fsdp:
            return sum(fsdp_numel(p, self.lay) for p in ps) * FP32
        return self.r.local_numel(ps) * FP32

    def step_grads(self, ps) -> int:
        """Gradient bytes these params hold on the device from their backward to the step's end."""
        if self.classic or (self.per_block and self.r.host):  # preallocated (counted in full); CPU offload: reduced
            # to the host
            return 0
        if self.per_block:
            return self.reduced_grad_bytes(ps)
        if self.fsdp:
            return _fsdp_bytes(ps, self.lay, self.pbytes)[1]  # accumulated unsharded to the step's end
        return self.r.grad_numel(ps) * FP32

    def _set_up_communication(self) -> None:
        """DDP's buckets, FSDP's working copies (unsharded bytes per block and of the root, reduce-scatter inputs) and
        what is held for communication through the whole backward."""
        i, lay, r, fsdp, per_block, by_layer = self.i, self.lay, self.r, self.fsdp, self.per_block, self.by_layer
        # DDP's flat bucket buffers are a second copy of the gradients (gradient_as_bucket_view=False); classic
        # frameworks reduce from one contiguous gradient buffer instead.
        self.ddp_buckets = r.grad_numel(self.params) * self.gbytes if (lay.uses_ddp and not self.classic) else 0
        site = i.recipe.compression.site(lay)
        rbytes = BF16 if site is CompressionSite.REDUCE_DTYPE else FP32
        unsh = self.unsh = ({l: _fsdp_bytes(by_layer[l], lay, self.pbytes, rbytes if per_block else FP32)
                             for l in by_layer} if fsdp else {})
        self.root_unsh = _fsdp_bytes(r.root, lay, self.pbytes)[0] if (fsdp and r.root) else 0
        gathered = sum(u for u, _ in unsh.values()) + self.root_unsh if (fsdp and not per_block) else 0
        self.held_comm = self.ddp_buckets + self.p2p + gathered  # communication buffers live the whole backward
        self.ahead = max(1, i.recipe.fsdp_backward_prefetch)  # blocks gathered ahead of the one in backward

    def _set_up_compression(self) -> None:
        """Gradient compression (or the optimizer's own, 1-bit Adam's of the momenta): error feedback kept between
        steps; the hook's temporaries (DDP: at the end of backward)."""
        i, lay = self.i, self.lay
        self.run_comp = i.recipe.compression.run_by(optimizer_entry(i.recipe.optimizer))
        self.comp_site = self.run_comp.site(lay)
        self.comp = None
        if self.comp_site.hooked:
            shapes = [local_shape(q, lay) for q in self.params if q.trainable]
            if self.comp_site is CompressionSite.REPLICATE_HOOK:
                shapes = [(math.ceil(sh[0] / lay.dp_shard), *sh[1:]) for sh in shapes]
            self.comp = self.run_comp.cost(shapes, lay.dp if self.comp_site is CompressionSite.DDP_HOOK
                                           else lay.dp_replicate)

    def _set_up_held_throughout(self) -> None:
        """The model states every candidate peak holds, and what a zero-bubble input-gradient step leaves for the
        weight-gradient step, per stage."""
        st, d, comp = self.st, self.d, self.comp
        self.base = dict(parameters=st.params + st.rope_buffers * len(self.stages), frozen=st.frozen,
                         optimizer=st.optimizer, master=st.master, compression=comp.state_bytes if comp else 0,
                         **({"replica_states": st.replica_states} if st.replica_states else {}))
        self.autocast = st.autocast_copies
        self.inter = {s: len(self.layers_of[s]) * _zb_intermediates(d)
                      + (_zb_head_intermediates(d) if s == self.last_stage else 0) for s in self.stages}

    def schedule(self) -> _Peaks:
        """The rank's schedule in order, each backward's candidate peaks shifted by what the rest of the schedule
        holds then.

        What the rank's stages hold as the schedule runs: per micro-batch forwarded and not yet (weight-)backwarded
        its `hold` (and the last stage's `hold_head`); per micro-batch of a zero-bubble schedule whose input
        gradients are done and weight gradients not yet, its `inter`; and the gradients of the stages that have run a
        backward. The multi-stage schedules wait for their sends only at the end of the step, and a send keeps its
        tensor: every stage output sent to another rank (once its micro-batch is backwarded, no longer counted in
        `hold`) and every input gradient sent back stays allocated to the end of the step."""
        values = [*self.hold.values(), *self.hold_head.values(), *self.inter.values(), *self.stage_grads.values(),
                  self.binp, self.g_const]
        if all(type(v) is int for v in values):  # (bytes: exact in any order, so summed per distinct backward)
            return self.schedule_by_events()
        return self.schedule_in_order()

    def schedule_in_order(self) -> _Peaks:
        """`schedule`, action by action."""
        lay, rank, hold, hold_head, inter = self.lay, self.rank, self.hold, self.hold_head, self.inter
        peaks = _Peaks()
        stash_sends = self.pipelined and lay.pp_schedule.multi_stage
        remote_next = {s: s < self.last_stage and lay.stage_owner(s + 1) != rank for s in self.stages}
        remote_prev = {s: s > 0 and lay.stage_owner(s - 1) != rank for s in self.stages}
        actions = (rank_actions(lay.pp_schedule, lay.pp, lay.pp_virtual, self.m, rank) if self.pipelined
                   else ((0, "F", 0), (0, "B", 0)))
        held = held_head = grads_so_far = sent_out = sent_grads = 0
        grads_done: set[int] = set()
        walked: dict = {}
        shifts: dict = {}  # walk -> the largest of each SHIFTED category added to it (first shifted first)
        best = None  # (total, walk, SHIFTED bytes) of the first shift with the largest total
        g_const = self.g_const
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
            first_bwd = stage not in grads_done and not self.g_const
            # The stage's own walk is the same at every micro-batch (what else is held only adds to each of its
            # candidates): walked once per (stage, kind, first backward), shifted by this point's additions.
            walk = self._walk(walked, stage, kind, first_bwd)
            extra = (others, held_head - hold_head[stage], g_const + grads_so_far, sent_grads)
            total = walk.best[0] + others + extra[1] + extra[2] + sent_grads
            if best is None or total > best[0]:
                best = (total, walk, extra)
            _raise_shifts(shifts, walk, extra)
            if kind in ("I", "B") and stash_sends and remote_prev[stage]:
                sent_grads += self.binp
            if kind == "I":
                held += inter[stage]
            else:
                held -= hold[stage]
                held_head -= hold_head[stage]
                if first_bwd:
                    grads_so_far += self.stage_grads[stage]
                grads_done.add(stage)
                if kind == "W":
                    held -= inter[stage]
                if stash_sends and remote_next[stage]:
                    sent_out += self.binp
        peaks.add_shifted(shifts, best)
        return peaks

    def _walk(self, walked: dict, stage, kind: str, first_bwd: bool):
        """The stage's backward walk of this kind (`_StageBackward.peaks`), made once per (stage, kind, first)."""
        walk = walked.get((stage, kind, first_bwd))
        if walk is None:
            walk = walked[stage, kind, first_bwd] = _StageBackward(self, stage, kind, first_bwd).peaks()
            walk.peak()
        return walk

    def schedule_by_events(self) -> _Peaks:
        """`schedule` from the rank's groups of like backwards (`_backward_events`): the same peaks, phases and sizes
        (a group's largest additions are its last backward's; the first largest total is, within a group, its first
        backward with the most sends, or its first when sends weigh nothing)."""
        lay, stages = self.lay, self.stages
        if self.pipelined:
            events = _backward_events(lay.pp_schedule, lay.pp, lay.pp_virtual, self.m, self.rank, bool(self.g_const))
        else:
            events = _backward_events(None, 1, 1, 1, 0, bool(self.g_const))
        hold = [self.hold[s] for s in stages]
        head = [self.hold_head[s] for s in stages]
        inter = [self.inter[s] for s in stages]
        grads = [self.stage_grads[s] for s in stages]
        binp, g_const = self.binp, self.g_const
        walked: dict = {}
        shifts: dict = {}  # walk -> the largest of each SHIFTED category added to it (first shifted first)
        best = None  # (total, index, walk, SHIFTED bytes) of the first backward with the largest total
        for stage, kind, first_bwd, held, inter_held, done, first, first_sends, top, top_sends, last_sends in events:
            walk = self._walk(walked, stage, kind, first_bwd)
            others = sum(map(mul, held, hold)) + sum(map(mul, inter_held, inter))
            held_head = sum(map(mul, held, head))
            grads_now = g_const + sum(map(mul, done, grads))
            index, (out, back) = (top, top_sends) if binp else (first, first_sends)
            extra = (others + out * binp, held_head, grads_now, back * binp)
            total = walk.best[0] + extra[0] + extra[1] + extra[2] + extra[3]
            if best is None or total > best[0] or (total == best[0] and index < best[1]):
                best = (total, index, walk, extra)
            out, back = last_sends
            last = (others + out * binp, held_head, grads_now, back * binp)
            _raise_shifts(shifts, walk, last)
        peaks = _Peaks()
        peaks.add_shifted(shifts, best and (best[0], best[2], best[3]))
        return peaks

    def end_of_pipeline_step(self, peaks: _Peaks) -> None:
        """The end of a pipeline step: FSDP reshards and reduce-scatters each group's accumulated gradients (the
        largest group's buffers at the worst time: all gradients still unsharded)."""
        if self.fsdp and not self.per_block and self.unsh:
            rs_in = max(x for _, x in self.unsh.values())
            peaks.add("reduce-scatter after the last micro-batch", **self.base,
                      gradients=sum(self.stage_grads.values()), comm_buffers=self.held_comm + rs_in // self.lay.shard_degree
                      + (rs_in if self.i.target.device == "cpu" else 0), activations=self.tokens)

    def optimizer_step(self, peaks: _Peaks) -> dict:
        """O, the optimizer step (and a DDP hook's compression of the last bucket before it); returns the host
        memory of CPU-offloaded model states then."""
        st, comp = self.st, self.comp
        opt_temp = self._optimizer_temporaries()
        host_states = _host_total(self.r.host, opt_temp)
        if self.r.host:
            opt_temp = 0  # the optimizer steps on the CPU
        if comp is not None and self.comp_site is CompressionSite.DDP_HOOK:  # the hook compresses the last bucket:
            # all grads
            peaks.add("gradient compression (DDP hook)", **self.base, gradients=st.grads,
                      comm_buffers=self.ddp_buckets + self.p2p, temporaries=comp.transient_bytes)
        if comp is not None and self.run_comp is not self.i.recipe.compression:  # the optimizer compresses its
            # momenta in its step
            opt_temp = max(opt_temp, comp.transient_bytes)
        peaks.add("optimizer step", **self.base, gradients=st.grads, comm_buffers=self.ddp_buckets + self.p2p,
                  temporaries=opt_temp)
        return host_states

    def _optimizer_temporaries(self) -> int:
        """What the optimizer step allocates beside the states: foreach's per-group temporaries, or a capability's
        optimizer's own (`Capability.optimizer_temporaries`: whole matrices orthogonalised) where larger."""
        i, lay, st, params = self.i, self.lay, self.st, self.params
        opt_temp = 0
        if i.recipe.optimizer_impl != "fused" and optimizer_entry(i.recipe.optimizer).foreach_temporary:
            # _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) per parameter group (matrices, then norm gains)
            small = self.reduced_grad_bytes([p for p in params if len(p.shape) < 2])
            opt_temp = max(self.r.host.get("gradients", st.grads) - small, small) * (FP32 // self.gbytes)
            if lay.zero1:
                opt_temp = math.ceil(st.optimizer / 2)
        for capability in i.recipe.capabilities:
            opt_temp = max(opt_temp, capability.optimizer_temporaries(params, lay, self.reduced_grad_bytes,
                                                                      i.target.device == "cpu"))
        return opt_temp

    def result(self, peaks: _Peaks, host_states: dict) -> dict:
        """The walk's answer (`_Peaks.result`), with the gradients' size and the host memory per rank."""
        out = peaks.result(self.r, self.moe)
        out["sizes"]["gradients"] = max(out["sizes"].get("gradients", 0), self.st.grads)
        host_acts = int(in_flight(self.lay, self.rank) * sum(self.moved.values()))  # offloaded micro-batches in
        # flight
        out["host"] = {**host_states, **({"activations": host_acts} if host_acts else {}),
                       **({"checkpoint staging": self.r.staging} if self.r.staging else {})}
        return out


@dataclass
class _Block:
    """One block in a stage's backward: what its candidate peaks share."""

    layer: int
    index: int  # its place among the stage's blocks
    first: int  # the stage's receive buffer, which the stage's first block saves as its input (else 0)
    unit: list[int]  # the blocks checkpointed with it
    before: list[int]  # the blocks of its unit below it (recomputed with it, holding their tensors)
    waiting: int  # what those hold until their own backward
    acts: int  # its activations live in its backward
    live_temps: int  # its backward's own temporaries
    from_head: int  # the gradient the loss/output backward made (its stage's last block on the last stage)
    what: str  # its name in a phase
    comm: int  # communication buffers live in its backward
    prefetched: int = 0  # FSDP block by block: the blocks gathered ahead of it
    kept_gathered: int = 0  # zero2: the blocks below kept gathered


class _StageBackward:
    """Candidate peaks of one stage's backward of one micro-batch, alone (the schedule adds what else is held):
    "B" (the whole backward), the zero-bubble input-gradient step "I" (nothing is freed: the graph is kept for "W",
    and each block leaves the gradients of its weights' outputs), or the weight-gradient step "W" (at its start, and
    at its end when the stage's gradients exist)."""

    def __init__(self, w: _Walk, stage: int, kind: str, first_bwd: bool):
        self.w, self.stage, self.kind, self.first_bwd = w, stage, kind, first_bwd
        self.found = _Peaks()
        self.layers, self.last = w.layers_of[stage], stage == w.last_stage
        self.where = f" (stage {stage}{', input gradients' if kind == 'I' else ''})" if w.pipelined else ""
        self.shared = w.shared_of.get(stage, 0)
        self.stage_acts = sum(w.stored[l] for l in self.layers) - self.shared
        self.keep = w.binp if not self.last else 0  # a stage's output stays referenced to the end of its backward
        self.weights = kind == "B"
        self.grads_now = 0
        self.held = 0  # zero bubble: the weights' output gradients kept so far
        self.current_head = w.head + w.logits if (self.last and not self.weights) else 0  # kept for "W"
        # The root's parameters are gathered again by its pre-backward, when the gradient reaches its forward's
        # output: the logits (the whole loss is computed after the model's forward), or the loss itself (a chunked
        # loss is part of the forward). zero2 keeps them gathered throughout.
        self.root_at_norm = w.root_unsh if (w.per_block and not w.zero2) else 0
        self.stored_below = self.stage_acts
        self.fetched: set[int] = set()
        self.rs_kept = 0  # FSDP block by block: the last reduce-scatter's buffer, kept until the next

    def add(self, phase: str, **cats) -> None:
        """A candidate peak, with the model states (autocast's cached low-precision weights live until the backward
        ends)."""
        self.found.add(phase, **self.w.base, autocast_copies=self.w.autocast, **cats)

    def peaks(self) -> _Peaks:
        """Every candidate peak of this backward: the weight-gradient step's, or the loss's and each block's, last to
        first."""
        if self.kind == "W":
            self.weight_gradient_step()
            return self.found
        if self.last:
            self.loss_backward()
        for idx in reversed(range(len(self.layers))):
            self.block_backward(idx)
        return self.found

    def weight_gradient_step(self) -> None:
        """"W": at its start (the input-gradient step's intermediates live), and at its end."""
        w, d, last, stage = self.w, self.w.d, self.last, self.stage
        self.add(f"weight gradients (stage {stage})", gradients=0, activations=self.stage_acts + w.tokens + self.keep,
                 logits_loss=(w.head + w.logits if last else 0), comm_buffers=w.held_comm,
                 temporaries=len(self.layers) * _zb_intermediates(d) + (_zb_head_intermediates(d) if last else 0))
        self.add(f"end of weight gradients (stage {stage})",
                 gradients=w.stage_grads[stage] if self.first_bwd else 0, activations=w.tokens,
                 comm_buffers=w.held_comm)

    def loss_backward(self) -> None:
        """The last stage's loss backward and its final norm's backward."""
        w, d = self.w, self.w.d
        comm = w.held_comm
        if w.per_block:
            if w.zero2:
                comm += sum(u for u, _ in w.unsh.values()) + w.root_unsh
            elif self.layers:  # the last block is not resharded after forward, except expert-parallel experts
                comm += _fsdp_bytes([p for p in w.by_layer[self.layers[-1]] if not (p.expert and w.lay.ep > 1)], w.lay,
                                    w.pbytes)[0]
        micro = f" (micro-step {w.accum} of {w.accum})" if (w.accum > 1 and not w.pipelined) else ""
        self.add(f"loss backward{self.where or micro}", gradients=0,
                 activations=self.stage_acts + A.final_residual(d) + w.tokens,
                 logits_loss=w.head + w.logits + w.loss_extra,
                 comm_buffers=comm + (self.root_at_norm if d.chunks > 1 else 0))
        if self.weights and self.first_bwd:  # (an input-gradient step makes no weight gradients)
            self.grads_now += w.head_grads
        if not self.weights:
            self.held += _zb_head_intermediates(d)
        # the final norm's backward: the head's gradients made, the logits gone (the peak once they are small:
        # chunked)
        self.add(f"final norm backward{self.where}", gradients=self.grads_now,
                 activations=self.stage_acts + A.final_residual(d) + w.tokens,
                 logits_loss=A.final_norm_backward(d) + self.current_head, comm_buffers=comm + self.root_at_norm,
                 temporaries=self.held + w.root_grads_live)

    def block_backward(self, idx: int) -> None:
        """The backward of the stage's block `idx`: its own peaks, ring attention's, its recomputation's, FSDP's end
        of it and reduce-scatter; then its gradients exist."""
        w = self.w
        b = self._block(idx)
        l = b.layer
        if self.weights:
            temps = b.live_temps + b.waiting + (w.dw2[l] * w.pbytes if w.fsdp else 0) + w.root_grads_live - b.from_head
            self.add(f"backward of {b.what}", gradients=self.grads_now + self._new_grad(l),
                     activations=self.stored_below + b.acts + w.tokens + self.keep, logits_loss=b.from_head,
                     comm_buffers=b.comm, temporaries=temps)
        else:
            self._input_gradient_peaks(b)
        if w.lay.cp > 1 and self.weights:
            self._ring_attention_peak(b)
        if w.modes[l].recomputes and l == b.unit[-1]:  # (a segment recomputes in its last block's backward)
            self._recomputation_peak(b)
        if w.per_block:
            self._fsdp_block_end_peaks(b)
        if self.weights and self.first_bwd:
            self.grads_now += w.block_grads[l]

    def _block(self, idx: int) -> _Block:
        """Block `idx`'s shared terms; moves `stored_below` to what the blocks below it hold (and fetches the
        offloaded block below it ahead)."""
        w, d, layers = self.w, self.w.d, self.layers
        l = layers[idx]
        first = self.shared if idx == 0 else 0
        # an offloaded block's tensors are back for its backward, and the offloaded block below it is fetched ahead
        self.stored_below -= (w.full[l] if l in self.fetched else w.stored[l]) - first
        if l in w.ahead_of:
            self.stored_below += w.moved[w.ahead_of[l]]
            self.fetched.add(w.ahead_of[l])
        # Under segments the blocks below l in its segment were recomputed with it and hold their tensors (FSDP:
        # their parameters stay gathered, the recomputation ran inside backward) until their own backward.
        unit = w.unit_of[l]
        before = unit[:unit.index(l)]
        waiting = sum(A.segment_recomputed(d, m == unit[0], w.moe_of[m]) for m in before)
        b_acts, b_temps = A.block_backward_live(d, w.modes[l], w.moe_of[l], not before)
        b_acts -= first
        from_head = w.binp if (self.last and idx == len(layers) - 1) else 0  # made by the loss/output backward
        comm = w.held_comm
        prefetched = kept_gathered = 0
        if w.per_block:
            prefetched = sum(w.unsh[m][0] for m in set(layers[max(0, idx - w.ahead):idx]) | set(before))
            kept_gathered = sum(w.unsh[k][0] for k in layers[:idx - 1]) if (w.zero2 and idx > 1) else 0
            comm += w.unsh[l][0] + prefetched + self.rs_kept + w.root_unsh + kept_gathered
        return _Block(l, idx, first, unit, before, waiting, b_acts, b_temps, from_head, f"block {l}{self.where}",
                      comm, prefetched, kept_gathered)

    def _new_grad(self, l: int) -> int:
        """The first weight gradient of block `l`'s backward, where it is new (FSDP: unsharded, in its temporaries)."""
        w = self.w
        return w.dw2[l] * w.gbytes if (self.first_bwd and self.weights and not w.fsdp) else 0

    def _input_gradient_peaks(self, b: _Block) -> None:
        """A zero-bubble input-gradient step of the block: nothing of it is freed; its weights' output gradients
        accumulate."""
        w, d, l = self.w, self.w.d, b.layer
        self.add(f"backward of {b.what}", gradients=self.grads_now, activations=self.stage_acts + w.tokens + self.keep,
                 logits_loss=b.from_head + self.current_head, comm_buffers=b.comm,
                 temporaries=self.held + b.live_temps - (w.stored[l] - b.first - b.acts) - b.from_head)
        self.held += _zb_intermediates(d)
        self.add(f"end of {b.what}", gradients=self.grads_now, activations=self.stage_acts + w.tokens + self.keep,
                 logits_loss=self.current_head, comm_buffers=b.comm,
                 temporaries=self.held + (ZB_NORM_BACKWARD_VALUES * d.N // d.seq_div * d.C - d.N // d.seq_div * d.C)
                 * FP32 + w.binp)

    def _ring_attention_peak(self, b: _Block) -> None:
        """Ring attention's backward (context parallel): the block's MLP is done (its gradients exist, unsharded under
        FSDP), its attention tensors are still saved, the ring's buffers are live beside the incoming gradients (the
        residual's and the attention output's). (Under checkpointing the recomputed tensors count as temporaries,
        what the checkpoint holds as activations.)"""
        w, d, l = self.w, self.w.d, b.layer
        live = A.ring_backward_block(d, w.modes[l])
        kept = min(live, w.full[l]) if w.modes[l].recomputes else live  # (an offloaded block's are back)
        done = w.r.after_attention_inputs(l) * w.pbytes
        dout = d.N * d.Hq * d.D * d.L
        self.add(f"ring attention backward of {b.what}", gradients=self.grads_now,
                 activations=self.stored_below + kept + w.tokens + self.keep, logits_loss=0, comm_buffers=b.comm,
                 temporaries=live - kept + A.ring_backward_temps(d) + dout + w.binp + done + w.root_grads_live
                 + b.waiting)

    def _recomputation_peak(self, b: _Block) -> None:
        """The end of the block's recomputation (a segment's, in its last block's backward)."""
        w, l = self.w, b.layer
        r_acts, r_temps = A.recompute_end(w.d, w.modes[l], w.moe_of[l], not b.before)
        self.add(f"recomputation of {b.what}", gradients=self.grads_now,
                 activations=self.stored_below + r_acts + w.tokens + self.keep - b.first,
                 logits_loss=b.from_head + self.current_head, comm_buffers=b.comm,
                 temporaries=self.held + r_temps + b.waiting - b.from_head + w.root_grads_live)

    def _fsdp_block_end_peaks(self, b: _Block) -> None:
        """FSDP block by block: the end of the block's backward, and its post-backward's reduce-scatter."""
        w, d, l = self.w, self.w.d, b.layer
        # The end of block l's backward (its attention backward), before FSDP's post-backward: all its unsharded
        # gradients exist (what dominates when the micro-batch is small); of its activations only the input is left;
        # SDPA's backward has made dq, dk, dv, then the q/k/v input's gradient, beside the incoming one.
        q_size = d.N * d.Hq * d.D * d.L
        self.add(f"end of {b.what}'s backward", gradients=self.grads_now,
                 activations=self.stored_below + w.tokens + w.binp, logits_loss=0, comm_buffers=b.comm,
                 temporaries=w.binp + 3 * q_size + d.N * d.C * d.L + w.root_grads_live + w.unsh[l][0] + b.waiting)
        # FSDP's post-backward of block l: its parameters resharded, its gradients copied into the reduce-scatter
        # input, the sharded output allocated (gloo also copies the input: CPU runs only).
        rs_in = w.unsh[l][1]
        rs_out = rs_in // w.lay.shard_degree
        comm = (w.ddp_buckets + b.prefetched + rs_in + rs_out + (rs_in if w.i.target.device == "cpu" else 0)
                + w.root_unsh + b.kept_gathered)
        self.add(f"reduce-scatter of {b.what}", gradients=self.grads_now, activations=self.stored_below + w.tokens,
                 logits_loss=0, comm_buffers=comm,
                 temporaries=w.binp + w.root_grads_live + w.dw2[l] * w.pbytes + b.waiting)
        self.rs_kept = rs_in


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
    half = i.recipe.precision.compute_precision  # (the 16-bit format of the regimes that have one: bf16 or fp16)
    regime = {"single": "fp32 activations", "autocast": f"autocast: fp32 residual stream, {half} matmul/attention",
              "pure": f"{half} compute, fp32 norm statistics and loss"}[d.regime]
    unchecked = A.block_stored(d, CheckpointMode.NONE, None)
    notes.append(f"activations: {regime}; per block {fmt_bytes(unchecked, 'GiB')} "
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
    if i.recipe.precision.low_precision and optimizer_entry(i.recipe.optimizer).state_bytes and i.recipe.lora is None:
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
    modes = i.recipe.checkpointing.block_checkpointing(args.n_layers, i.recipe.every_k)
    moe_of = {l: moe if args.is_moe_layer(l) else None for l in layers}
    stages = [lay.stage_layers(s) for s in lay.local_stages(lay.pp - 1)] if lay.pp > 1 else [layers]
    acts = sum(A.stored_by_block(d, modes, stages, moe_of, i.recipe.capabilities).values())
    acts -= sum(saved_on_host(i.recipe.capabilities, args.n_layers, d, modes, moe_of, layers)[0].values())
    return {"activations": acts + A.final_residual(d) + A.inputs_bytes(d),
            "logits_loss": sum(b for _, b in A.head_saved(d))}


def _raise_shifts(shifts: dict, walk, values) -> None:
    """shifts[walk]: the largest of each SHIFTED category added to that walk so far, raised to `values`'."""
    most = shifts.get(walk)
    if most is None:
        shifts[walk] = list(values)
        return
    for j, value in enumerate(values):
        if value > most[j]:
            most[j] = value
