"""Parameters, gradients, optimizer states and master weights per rank, exactly, from the model's shapes.

Every parameter comes from the model family's parameter table (`paratrain.models.family`: its shape and
tensor-parallel role) and each layout splits it:

- tensor parallel (distributed/tensor_parallel.py plans each role): column-parallel weights and biases and the
  vocabulary-parallel embedding and output split dim 0; row-parallel weights split dim 1; norm gains, row-parallel
  biases (and a mixture of experts' router and routed experts) are replicated;
- expert parallel: routed experts split dim 0 (experts) over ep;
- FSDP2 (`fully_shard`): dim 0 of the (tensor-parallel local) tensor in chunks of ceil(rows / shard)
  rows; every rank's storage is padded to the full chunk, so the worst rank holds ceil(rows / shard) rows
  (expert weights under ep are sharded on dim 1 over dp_shard / ep ranks, as expert_parallel.shard_experts);
- ZeRO-1 (`ZeroRedundancyOptimizer`): whole parameters assigned greedily, largest first, to the rank
  with the fewest elements so far (its exact algorithm), so ranks differ and the worst one is reported;
- pipeline stages: the first holds the embedding, the last the final norm and output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from paratrain.capabilities import implied_by_settings, optimizer_entry
from paratrain.layout import Layout
from paratrain.models.args import ModelArgs
from paratrain.models.family import Param
from paratrain.capabilities.lora import LoRA
from paratrain.models.lora_params import adapted_params
from paratrain.models.registry import parameters
from paratrain.modes import Precision
from paratrain.stage_split import balanced_split

# Bytes per element.
FP32, BF16 = 4, 2


@functools.lru_cache(maxsize=256)
def model_params(args: ModelArgs, lora: LoRA | None = None) -> tuple[Param, ...]:
    """Every parameter in named_parameters() order (tied output weight listed once): the family's parameter table,
    with `lora`'s adapters (trainable) beside their weights (frozen). Cached (both are frozen): the planner asks for
    the same table thousands of times."""
    return tuple(adapted_params(parameters(args), lora))


@functools.lru_cache(maxsize=64)
def hidden_matrix_names(args: ModelArgs, lora: LoRA | None = None) -> frozenset[str]:
    """The trainable hidden matrices' names (`Param.hidden_matrix`: what an optimizer with a hidden_state updates on
    its own, as whole matrices)."""
    return frozenset(p.name for p in model_params(args, lora) if p.hidden_matrix and p.trainable)


def local_shape(p: Param, layout: Layout) -> tuple[int, ...]:
    """Shape of this parameter's tensor on one rank after tp and ep (before FSDP)."""
    shape = list(p.shape)
    if p.expert and layout.ep > 1:
        shape[0] //= layout.ep
    elif p.tp_dim is not None and layout.tp > 1:
        shape[p.tp_dim] //= layout.tp
    return tuple(shape)


def fsdp_numel(p: Param, layout: Layout, shard: int | None = None) -> int:
    """Elements of the worst rank's (padded) FSDP shard of `p`."""
    shape = list(local_shape(p, layout))
    n = layout.shard_degree if shard is None else shard
    dim = 0
    if p.expert and layout.ep > 1:
        n, dim = max(1, layout.dp_shard // layout.ep), 1  # expert_parallel.shard_experts: Shard(1) over dp_shard/ep
    if n > 1:
        shape[dim] = math.ceil(shape[dim] / n)
    return math.prod(shape)


def stage_of(p: Param, layout: Layout, rank_layers: list[list[int]]) -> list[int]:
    """Pipeline ranks (positions along pp) holding this parameter."""
    if layout.pp == 1:
        return [0]
    if p.where == "embedding":
        return [layout.stage_owner(0)]
    if p.where == "head":
        return [layout.stage_owner(layout.num_stages - 1)]  # zbv: the V puts the last stage on rank 0
    return [s for s, layers in enumerate(rank_layers) if p.layer in layers]


def rank_params(args: ModelArgs, layout: Layout, rank: int, layers: list[list[int]],
                lora: LoRA | None = None) -> list[Param]:
    """The parameters pipeline rank `rank` holds (all of them without a pipeline)."""
    params = model_params(args, lora)
    if layout.pp == 1:
        return params
    mine = set(layers[rank])
    first, last = layout.stage_owner(0) == rank, layout.stage_owner(layout.num_stages - 1) == rank
    return [p for p in params if (p.layer in mine if p.layer is not None else (first if p.where == "embedding"
                                                                               else last))]


def rank_layers(layout: Layout, args: ModelArgs) -> list[list[int]]:
    """Blocks held by each pipeline rank, as the layout places its stages (`Layout.local_stages`): blocks per stage
    from `pp_split`, else balanced by parameter count as `Layout.validate` fills it in."""
    if layout.pp == 1:
        return [list(range(args.n_layers))]
    if layout.pp_split is None:
        layout = dataclasses.replace(layout, pp_split=balanced_split(args, layout.num_stages))
    owners = tuple(layout.stage_owner(s) for s in range(layout.num_stages))
    return [list(b) for b in _rank_layers(layout.pp, owners, layout.pp_split)]


def stage_blocks(layout: Layout, args: ModelArgs) -> list[list[int]]:
    """Blocks of each pipeline stage (the whole model without a pipeline), split as `rank_layers` splits them."""
    split = (layout.pp_split or balanced_split(args, layout.num_stages)) if layout.pp > 1 else (args.n_layers,)
    return [list(range(sum(split[:s]), sum(split[:s + 1]))) for s in range(len(split))]


@functools.lru_cache(maxsize=4096)
def _rank_layers(pp: int, owners: tuple[int, ...], split: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    starts = [sum(split[:s]) for s in range(len(split))]
    out = [[] for _ in range(pp)]
    for s, n in enumerate(split):
        out[owners[s]] += range(starts[s], starts[s] + n)
    return tuple(tuple(sorted(b)) for b in out)


def fsdp_gathers_per_step(layout: Layout, args: ModelArgs, micro_steps: int, layers: list[list[int]] | None = None,
                          moe_blocks: tuple[int, ...] | None = None) -> int:
    """FSDP parameter all-gathers per optimizer step on the pipeline rank that runs the most
    (`Layout.fsdp_all_gathers` over `Layout.fsdp_groups` of each rank's blocks): the count the memory estimator and
    the planner's cost model both report. `layers` (rank_layers) and `moe_blocks` (each rank's mixture-of-experts
    blocks), when the caller has them."""
    if not layout.uses_fsdp:
        return 0
    layers = layers if layers is not None else rank_layers(layout, args)
    if moe_blocks is None:
        moe_blocks = [sum(map(args.is_moe_layer, b)) for b in layers]
    return max(layout.fsdp_all_gathers(micro_steps, layout.fsdp_groups(len(b), moe, r))
               for r, (b, moe) in enumerate(zip(layers, moe_blocks)))


def zero1_worst_numel(params: list[tuple[Param, int]], ranks: int) -> int:
    """ZeroRedundancyOptimizer's greedy partition (largest first, to the least-loaded rank, over the
    decay group then the no-decay group); returns the largest per-rank element count."""
    sizes = [0] * ranks
    decay = [n for p, n in params if len(p.shape) >= 2]
    no_decay = [n for p, n in params if len(p.shape) < 2]
    for group in (decay, no_decay):
        for n in sorted(group, reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += n
    return max(sizes)


@dataclass
class StateBytes:
    """Model-state bytes on one rank (or one stage's worst rank)."""

    params: int
    grads: int
    optimizer: int
    master: int
    autocast_copies: int  # bf16 copies of matmul weights made by autocast (alive from forward to backward)
    frozen: int = 0  # LoRA's frozen base: its parameters in their storage dtype (no gradient, no optimizer state)
    param_numel: int = 0  # elements this rank holds (for display)
    unsharded_numel: int = 0  # elements of the parameters this rank computes with (after tp/ep/pp, before FSDP)
    rope_buffers: int = 0
    notes: tuple[str, ...] = ()
    grads_beyond_shards: int = 0  # of `grads`: bytes beyond each parameter's own sharded shape (a whole gradient)
    replica_states: int = 0  # a capability's copies beside the states (local SGD: round-start weights, outer momentum)


_STATES: dict = {}


def state_bytes(args: ModelArgs, layout: Layout, precision: str, optimizer: str, accounting: str, stage: int = 0,
                layers: list[list[int]] | None = None, lora: LoRA | None = None,
                capabilities: tuple | None = None) -> StateBytes:
    """Model states of the worst rank of pipeline stage `stage` (see `_state_bytes`; cached: the planner asks for the
    same ones often). `lora`: adapters train, the rest is frozen. `capabilities`: the recipe's (paratrain/capabilities),
    whose weight copies count; None: those the precision and the optimizer imply (the planner's)."""
    layers = layers or rank_layers(layout, args)
    if capabilities is None:
        capabilities = _implied(precision, optimizer)
    # (what the states read of the layout: the planner asks for layouts differing in nothing else, e.g. schedules
    # placing the same blocks on the rank)
    where = ((tuple(layers[stage]), layout.stage_owner(0) == stage, layout.stage_owner(layout.num_stages - 1) == stage)
             if layout.pp > 1 else None)
    key = (args, _states_key(layout), precision, optimizer, accounting, stage == 0, where, lora, capabilities)
    hit = _STATES.get(key)
    if hit is None:
        if len(_STATES) > 4096:
            _STATES.clear()
        hit = _STATES[key] = _state_bytes(args, layout, precision, optimizer, accounting, stage, layers, lora,
                                          capabilities)
    return hit


def _states_key(layout: Layout) -> tuple:
    """Every value of the layout `_state_bytes` reads but a pipeline rank's blocks (`_param_kinds`, `rank_params`):
    the tp and ep splits (`local_shape`), FSDP's shards (`fsdp_numel`), the data-parallel mode's sharding (zero1,
    hybrid, `_classic_states`)."""
    return (layout.tp, layout.ep, layout.dp_replicate, layout.dp_shard, layout.cp, layout.zero_stage,
            layout.dp_mode.replicates_shards)


@functools.lru_cache(maxsize=64)
def _implied(precision: str, optimizer: str) -> tuple:
    return implied_by_settings(precision, optimizer)


_KINDS: dict[tuple, tuple[tuple[Param, int], ...]] = {}


def _param_kinds(args: ModelArgs, layout: Layout, rank: int, layers: list[list[int]],
                 lora: LoRA | None = None) -> tuple[tuple[Param, int], ...]:
    """The parameters of pipeline rank `rank` (`rank_params`) grouped by what the model states read of them (shape,
    tp split, expert, matmul weight, where, trainable): (the first of each kind, how many), in order. A model repeats
    a few shapes many times: the states count each kind once (cached)."""
    if layout.pp == 1:
        key = (tuple(vars(args).values()), lora)
    else:
        key = (tuple(vars(args).values()), lora, tuple(layers[rank]), layout.stage_owner(0) == rank,
               layout.stage_owner(layout.num_stages - 1) == rank)
    hit = _KINDS.get(key)
    if hit is None:
        kinds: dict[tuple, list] = {}
        for p in rank_params(args, layout, rank, layers, lora):
            kinds.setdefault((p.shape, p.tp_dim, p.expert, p.matmul, p.where, p.trainable), [p, 0])[1] += 1
        if len(_KINDS) > 4096:
            _KINDS.clear()
        hit = _KINDS[key] = tuple((p, count) for p, count in kinds.values())
    return hit


_LOCAL: dict = {}


def _local_kinds(args: ModelArgs, layout: Layout, rank: int, layers: list[list[int]],
                 lora: LoRA | None) -> tuple[list, list]:
    """The (kind, count, local elements) of `_param_kinds` after tp and ep (`local_shape`): (the trainable, the
    frozen), cached (the same lists for the same kinds and split: `_fsdp_sum` caches by them)."""
    kinds = _param_kinds(args, layout, rank, layers, lora)
    key = (id(kinds), layout.tp, layout.ep)
    hit = _LOCAL.get(key)
    if hit is None or hit[0] is not kinds:
        local = [(p, count, math.prod(local_shape(p, layout))) for p, count in kinds]
        if len(_LOCAL) > 4096:
            _LOCAL.clear()
        hit = _LOCAL[key] = (kinds, [k for k in local if k[0].trainable], [k for k in local if not k[0].trainable])
    return hit[1], hit[2]


_SUMS: dict = {}


def _fsdp_sum(kinds: list, layout: Layout) -> int:
    """Elements of the worst rank's FSDP shards of `kinds` (a list of `_local_kinds`), cached per list and sharding."""
    key = (id(kinds), layout.shard_degree, layout.dp_shard, layout.ep, layout.tp)
    hit = _SUMS.get(key)
    if hit is None or hit[0] is not kinds:
        if len(_SUMS) > 4096:
            _SUMS.clear()
        hit = _SUMS[key] = (kinds, sum(count * fsdp_numel(p, layout) for p, count, _ in kinds))
    return hit[1]


def _state_bytes(args: ModelArgs, layout: Layout, precision: str, optimizer: str, accounting: str, stage: int,
                 layers: list[list[int]], lora: LoRA | None = None, capabilities: tuple = ()) -> StateBytes:
    """Model states of the worst rank of pipeline stage `stage`: its trainable parameters' (`_trainable_bytes`) and,
    with LoRA, its frozen ones' (stored in the compute dtype, sharded like the rest; nothing else)."""
    layers = layers or rank_layers(layout, args)
    trainable, frozen = _local_kinds(args, layout, stage, layers, lora)
    out = _trainable_bytes(args, layout, precision, optimizer, accounting, stage, trainable, capabilities)
    if not frozen:
        return out
    if accounting == "classic" and Precision(precision).low_precision:
        full = sum(count * n for _, count, n in frozen)
        n = layout.dp_shard if layout.hybrid else layout.dp
        numel = math.ceil(full / n) if layout.zero_stage >= 3 and n > 1 else full
    elif layout.uses_fsdp:
        numel = _fsdp_sum(frozen, layout)
    else:
        numel = sum(count * n for _, count, n in frozen)
    frozen_bytes = numel * Precision(precision).value_bytes
    return dataclasses.replace(out, frozen=frozen_bytes, param_numel=out.param_numel + numel,
                               unsharded_numel=out.unsharded_numel + sum(count * n for _, count, n in frozen),
                               notes=out.notes + (f"LoRA: the frozen base in {precision}, no gradients or optimizer "
                                                  "state for it",))


def _trainable_bytes(args: ModelArgs, layout: Layout, precision: str, optimizer: str, accounting: str, stage: int,
                     kinds: list[tuple[Param, int, int]], capabilities: tuple = ()) -> StateBytes:
    """Model states of the trainable parameters (`kinds`: (kind, count, local elements)) of the worst rank of
    pipeline stage `stage`.

    accounting="paratrain": what our trainer allocates. fp32 parameters and gradients everywhere (they are
    the master copy: FSDP2 keeps the sharded fp32 parameters and all-gathers bf16 copies; elsewhere autocast
    computes in bf16 from fp32 weights, caching a bf16 copy of each matmul weight during forward+backward).
    accounting="classic": Megatron/DeepSpeed-style mixed precision: bf16 parameters and gradients, plus an
    fp32 master copy and fp32 optimizer moments (2 + 2 + 4 + 8 = 16 bytes per parameter with Adam);
    ZeRO-1 splits master + moments, ZeRO-2 also gradients, ZeRO-3 also parameters.
    """
    local_numel = sum(count * n for _, count, n in kinds)
    entry = optimizer_entry(optimizer)
    per_opt, tensors = _optimizer_state_per_element(entry, kinds, local_numel)
    low = Precision(precision).low_precision
    rope = 2 * args.max_seq_len * (args.head_dim // 2) * FP32  # rope_cos, rope_sin buffers
    notes = []
    dp = layout.dp
    if accounting == "classic" and low:
        return _classic_states(layout, local_numel, per_opt)
    if layout.uses_fsdp:
        numel = _fsdp_sum(kinds, layout)
        opt_numel = numel
        grads_numel = numel
        if low:
            notes.append(f"the sharded fp32 parameters are the master weights; "
                         f"{Precision(precision).compute_precision} copies are all-gathered per block")
    else:
        numel = local_numel
        grads_numel = numel
        opt_numel = numel
        if layout.zero1:
            opt_numel = zero1_worst_numel([(p, n) for p, count, n in kinds for _ in range(count)], dp)
            notes.append(f"ZeRO-1 partitions whole parameters over {dp} ranks (worst rank shown)")
    autocast = _low_precision_weight_copies(args, layout, precision, kinds, notes, capabilities)
    whole_numel = _whole_embedding_gradient(layout, stage, kinds, notes)
    grads_numel += whole_numel
    # Per parameter tensor: Adam's step count (a 4-byte fp32 tensor each; ZeRO-1: its partition's share).
    steps = tensors * entry.tensor_state_bytes
    if steps and layout.zero1:
        steps = math.ceil(tensors / layout.dp) * entry.tensor_state_bytes
    shaped = [(p, count, local_shape(p, layout)) for p, count, _ in kinds] if capabilities else []
    replica = [r for r in (cap.replica_states(numel, layout, shaped) for cap in capabilities) if r is not None]
    notes += [note for _, note in replica]
    return StateBytes(params=numel * FP32, grads=grads_numel * FP32, optimizer=round(opt_numel * per_opt) + steps,
                      master=0, autocast_copies=autocast, param_numel=numel, unsharded_numel=local_numel, rope_buffers=rope,
                      notes=tuple(notes), grads_beyond_shards=whole_numel * FP32,
                      replica_states=sum(b for b, _ in replica))


def _optimizer_state_per_element(entry, kinds: list[tuple[Param, int, int]], local_numel: int) -> tuple[float, int]:
    """(bytes the optimizer keeps per element, averaged over the rank's elements; the parameter tensors with a step
    count). An entry with a hidden_state keeps that for a hidden matrix (an orthogonalising optimizer: one momentum)
    and its param_state and step count (AdamW's) for the rest."""
    hidden = [(count, n) for p, count, n in kinds if p.hidden_matrix] if entry.hidden_state is not None else []
    hidden_numel = sum(count * n for count, n in hidden)
    per_opt = entry.state_bytes if not local_numel else \
        (hidden_numel * entry.hidden_state_bytes() + (local_numel - hidden_numel) * entry.state_bytes) / local_numel
    tensors = sum(count for _, count, _ in kinds) - sum(count for count, _ in hidden)  # those with a step count
    return per_opt, tensors


def _classic_states(layout: Layout, full: int, per_opt: float) -> StateBytes:
    """Classic mixed-precision accounting (Megatron/DeepSpeed) by ZeRO stage: ddp = none, zero1 = optimizer+master,
    zero2 = + grads, fsdp/hsdp = + params."""
    n = layout.dp_shard if layout.hybrid else layout.dp
    stage_n = layout.zero_stage

    def div(k: int) -> int:
        return math.ceil(full / n) if stage_n >= k and n > 1 else full

    return StateBytes(params=div(3) * BF16, grads=div(2) * BF16, optimizer=round(div(1) * per_opt),
                      master=div(1) * FP32, autocast_copies=0, param_numel=div(3), unsharded_numel=full,
                      rope_buffers=0, notes=("classic mixed-precision accounting (Megatron/DeepSpeed style)",))


def _low_precision_weight_copies(args: ModelArgs, layout: Layout, precision: str, kinds: list[tuple[Param, int, int]],
                                 notes: list[str], capabilities: tuple = ()) -> int:
    """Bytes of the low-precision weight copies a step keeps: autocast's cache of each matmul weight (no FSDP), and
    the capabilities' own (fp8's casts; `Capability.weight_copies`), each with its note."""
    copies = [c for c in (cap.weight_copies(args, kinds) for cap in capabilities) if c is not None]
    uncached = frozenset().union(*(c.uncached for c in copies))
    autocast = 0
    if Precision(precision).low_precision and not layout.uses_fsdp:
        # (routed experts' grouped matmul is not an autocast op: no cached copy of them; a capability's layers that
        # cast their weights themselves do not use autocast's cache either)
        autocast = sum(count * n for p, count, n in kinds if p.matmul and not p.expert and p.name not in uncached) * BF16
        notes.append(f"fp32 parameters are the master weights; autocast caches each matmul weight's "
                     f"{Precision(precision).compute_precision} copy from forward to backward")
    for c in copies:
        autocast += c.bytes
        notes.append(c.note)
    return autocast


def _whole_embedding_gradient(layout: Layout, stage: int, kinds: list[tuple[Param, int, int]],
                              notes: list[str]) -> int:
    """Elements of the embedding's gradient beyond its tensor-parallel shard (with its note)."""
    if layout.tp > 1 and not layout.uses_fsdp and stage == 0:
        # Measured (torch 2.13): the vocabulary-parallel embedding's gradient comes back whole (V x C) on every
        # tensor-parallel rank, not as its V/tp shard.
        emb = next((p for p, _, _ in kinds if p.where == "embedding"), None)  # (LoRA: the embedding is frozen)
        if emb is not None:
            notes.append("tensor parallel: the embedding's gradient is whole (V x C) on each rank")
            return emb.numel - math.prod(local_shape(emb, layout))
    return 0


def zero_table(args: ModelArgs, ranks: int, optimizer: str = "adamw") -> list[dict]:
    """The classic mixed-precision breakdown (bf16 params/grads, fp32 master, fp32 moments) for one rank and
    ZeRO-1/2/3 over `ranks` ranks: bytes per row per stage."""
    n = sum(p.numel for p in model_params(args))
    per_opt = optimizer_entry(optimizer).state_bytes
    rows = [("parameters (bf16)", n * BF16, 3), ("gradients (bf16)", n * BF16, 2),
            ("optimizer moments (fp32)", n * per_opt, 1), ("master weights (fp32)", n * FP32, 1)]
    out = []
    for label, full, stage in rows:
        row = {"row": label, "one_rank": full}
        for z in (1, 2, 3):
            row[f"zero{z}"] = math.ceil(full / ranks) if z >= stage else full
        out.append(row)
    total = {"row": "total", "one_rank": sum(r["one_rank"] for r in out)}
    for z in (1, 2, 3):
        total[f"zero{z}"] = sum(r[f"zero{z}"] for r in out)
    out.append(total)
    return out
