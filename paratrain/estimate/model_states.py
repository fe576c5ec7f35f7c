"""Parameters, gradients, optimizer states and master weights per rank, exactly, from the model's shapes.

Every parameter of `paratrain.models` is listed with its shape and how each layout splits it:

- tensor parallel (DTensor plans in parallelize.apply_tp): q/k/v, w1/w3 and the vocabulary-parallel
  embedding and output split dim 0; wo and w2 split dim 1; norm gains (and a mixture of experts' router
  and routed experts) are replicated;
- expert parallel: routed experts split dim 0 (experts) over ep;
- FSDP2 (`fully_shard`): dim 0 of the (tensor-parallel local) tensor in chunks of ceil(rows / shard)
  rows; every rank's storage is padded to the full chunk, so the worst rank holds ceil(rows / shard) rows
  (expert weights under ep are sharded on dim 1 over dp_shard / ep ranks, as expert_parallel.shard_experts);
- ZeRO-1 (`ZeroRedundancyOptimizer`): whole parameters assigned greedily, largest first, to the rank
  with the fewest elements so far (its exact algorithm), so ranks differ and the worst one is reported;
- pipeline stages: the first holds the embedding, the last the final norm and output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.estimate.layout import Layout, _expert_hidden, _is_moe

# Bytes per element.
FP32, BF16 = 4, 2


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dim split by tensor parallelism (None: replicated)
    layer: int | None  # block index (None: embedding / final norm / output)
    where: str  # "embedding" | "block" | "head"
    expert: bool = False  # routed-expert weight (split over ep on dim 0)
    matmul: bool = False  # used as a matmul weight (autocast makes a low-precision copy of it)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_params(args) -> list[Param]:
    """Every parameter in named_parameters() order (tied output weight listed once)."""
    C, hd = args.dim, args.head_dim
    out = [Param("tok_embeddings.weight", (args.vocab_size, C), 0, None, "embedding")]
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out += [Param(p + "attention_norm.weight", (C,), None, i, "block"),
                Param(p + "attention.wq.weight", (args.n_heads * hd, C), 0, i, "block", matmul=True),
                Param(p + "attention.wk.weight", (args.n_kv_heads * hd, C), 0, i, "block", matmul=True),
                Param(p + "attention.wv.weight", (args.n_kv_heads * hd, C), 0, i, "block", matmul=True),
                Param(p + "attention.wo.weight", (C, args.n_heads * hd), 1, i, "block", matmul=True),
                Param(p + "ffn_norm.weight", (C,), None, i, "block")]
        if _is_moe(args, i):
            E, H = args.moe_experts, _expert_hidden(args)
            out += [Param(p + "feed_forward.router.weight", (E, C), None, i, "block"),
                    Param(p + "feed_forward.experts.w1", (E, C, H), None, i, "block", expert=True, matmul=True),
                    Param(p + "feed_forward.experts.w2", (E, H, C), None, i, "block", expert=True, matmul=True),
                    Param(p + "feed_forward.experts.w3", (E, C, H), None, i, "block", expert=True, matmul=True)]
            if args.moe_shared_experts:
                S = H * args.moe_shared_experts
                out += [Param(p + "feed_forward.shared.w1.weight", (S, C), 0, i, "block", matmul=True),
                        Param(p + "feed_forward.shared.w2.weight", (C, S), 1, i, "block", matmul=True),
                        Param(p + "feed_forward.shared.w3.weight", (S, C), 0, i, "block", matmul=True)]
        else:
            F = args.ffn_hidden
            out += [Param(p + "feed_forward.w1.weight", (F, C), 0, i, "block", matmul=True),
                    Param(p + "feed_forward.w2.weight", (C, F), 1, i, "block", matmul=True),
                    Param(p + "feed_forward.w3.weight", (F, C), 0, i, "block", matmul=True)]
    out.append(Param("norm.weight", (C,), None, None, "head"))
    if not args.tie_embeddings:
        out.append(Param("output.weight", (args.vocab_size, C), 0, None, "head", matmul=True))
    return out


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


def stage_of(p: Param, layout: Layout, stage_layers: list[list[int]]) -> list[int]:
    """Pipeline stages (rank positions along pp) holding this parameter."""
    if layout.pp == 1:
        return [0]
    if p.where == "embedding":
        return [0]
    if p.where == "head":
        return [layout.pp - 1]
    return [s for s, layers in enumerate(stage_layers) if p.layer in layers]


def stage_layers(n_layers: int, layout: Layout, args=None) -> list[list[int]]:
    """Blocks held by each pipeline rank, as paratrain/distributed/pipeline.py places them: pp x v stages of
    contiguous blocks (`pp_split`, else balanced by parameter count with the embedding on the first stage and the
    output on the last), stage s on rank s mod pp, or for zbv (V-shape) stages r and 2pp-1-r on rank r."""
    pp, v = layout.pp, layout.pp_virtual
    if pp == 1:
        return [list(range(n_layers))]
    n_stages = pp * v
    split = layout.pp_split
    if split is None and args is not None:
        try:
            from paratrain.distributed.pipeline import balanced_split

            split = tuple(balanced_split(args, n_stages))
        except ImportError:  # pragma: no cover - older trees without pipeline support
            split = None
    if split is None:
        base, extra = divmod(n_layers, n_stages)
        split = tuple(base + (1 if c < extra else 0) for c in range(n_stages))
    chunks, start = [], 0
    for size in split:
        chunks.append(list(range(start, start + size)))
        start += size
    ranks = []
    for r in range(pp):
        own = [r, 2 * pp - 1 - r] if layout.pp_schedule == "zbv" else [r + k * pp for k in range(v)]
        ranks.append(sorted(layer for c in own for layer in chunks[c]))
    return ranks


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
    param_numel: int  # elements this rank holds (for display)
    unsharded_numel: int  # elements of the parameters this rank computes with (after tp/ep/pp, before FSDP)
    rope_buffers: int = 0
    notes: tuple[str, ...] = ()


OPTIMIZER_STATE_BYTES = {"adamw": 2 * FP32, "adam": 2 * FP32, "sgd": FP32, "sgd-nomomentum": 0}


def state_bytes(args, layout: Layout, precision: str, optimizer: str, accounting: str, stage: int = 0,
                layers: list[list[int]] | None = None) -> StateBytes:
    """Model states of the worst rank of pipeline stage `stage`.

    accounting="paratrain": what our trainer allocates. fp32 parameters and gradients everywhere (they are
    the master copy: FSDP2 keeps the sharded fp32 parameters and all-gathers bf16 copies; elsewhere autocast
    computes in bf16 from fp32 weights, caching a bf16 copy of each matmul weight during forward+backward).
    accounting="classic": Megatron/DeepSpeed-style mixed precision: bf16 parameters and gradients, plus an
    fp32 master copy and fp32 optimizer moments (2 + 2 + 4 + 8 = 16 bytes per parameter with Adam);
    ZeRO-1 splits master + moments, ZeRO-2 also gradients, ZeRO-3 also parameters.
    """
    layers = layers or stage_layers(args.n_layers, layout, args)
    params = [p for p in model_params(args) if stage in stage_of(p, layout, layers)]
    unsharded = [(p, math.prod(local_shape(p, layout))) for p in params]
    local_numel = sum(n for _, n in unsharded)
    per_opt = OPTIMIZER_STATE_BYTES[optimizer]
    low = precision != "fp32"
    rope = 2 * args.max_seq_len * (args.head_dim // 2) * FP32  # rope_cos, rope_sin buffers
    notes = []
    dp = layout.dp
    if accounting == "classic" and low:
        # Stage by dp_mode: ddp = none, zero1 = optimizer+master, zero2 = + grads, fsdp/hsdp = + params.
        n = layout.dp_shard if layout.dp_mode == "hsdp" else dp
        stage_n = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}[layout.dp_mode] if dp > 1 else 0
        full = local_numel

        def div(k: int) -> int:
            return math.ceil(full / n) if stage_n >= k and n > 1 else full

        return StateBytes(params=div(3) * BF16, grads=div(2) * BF16, optimizer=div(1) * per_opt,
                          master=div(1) * FP32, autocast_copies=0, param_numel=div(3), unsharded_numel=full,
                          rope_buffers=0, notes=("classic mixed-precision accounting (Megatron/DeepSpeed style)",))
    if layout.uses_fsdp:
        numel = sum(fsdp_numel(p, layout) for p, _ in unsharded)
        opt_numel = numel
        grads_numel = numel
        if low:
            notes.append("the sharded fp32 parameters are the master weights; bf16 copies are all-gathered per block")
    else:
        numel = local_numel
        grads_numel = numel
        opt_numel = numel
        if layout.uses_ddp and layout.dp_mode == "zero1":
            opt_numel = zero1_worst_numel(unsharded, dp)
            notes.append(f"ZeRO-1 partitions whole parameters over {dp} ranks (worst rank shown)")
    autocast = 0
    if low and not layout.uses_fsdp:
        # (routed experts' grouped matmul is not an autocast op: no cached copy of them)
        autocast = sum(n for p, n in unsharded if p.matmul and not p.expert) * BF16
        notes.append("fp32 parameters are the master weights; autocast caches a bf16 copy of each matmul weight "
                     "from forward to backward")
    if layout.tp > 1 and not layout.uses_fsdp and stage == 0:
        # Measured (torch 2.13): the vocabulary-parallel embedding's gradient comes back whole (V x C) on every
        # tensor-parallel rank, not as its V/tp shard.
        emb = next(p for p, _ in unsharded if p.where == "embedding")
        grads_numel += emb.numel - math.prod(local_shape(emb, layout))
        notes.append("tensor parallel: the embedding's gradient is whole (V x C) on each rank")
    # Adam keeps a step count per parameter tensor (a 4-byte fp32 tensor each; ZeRO-1: its partition's share).
    steps = len(unsharded) * FP32 if optimizer in ("adamw", "adam") else 0
    if steps and layout.uses_ddp and layout.dp_mode == "zero1":
        steps = math.ceil(len(unsharded) / layout.dp) * FP32
    return StateBytes(params=numel * FP32, grads=grads_numel * FP32, optimizer=opt_numel * per_opt + steps, master=0,
                      autocast_copies=autocast, param_numel=numel, unsharded_numel=local_numel, rope_buffers=rope,
                      notes=tuple(notes))


def zero_table(args, ranks: int, optimizer: str = "adamw") -> list[dict]:
    """The classic mixed-precision breakdown (bf16 params/grads, fp32 master, fp32 moments) for one rank and
    ZeRO-1/2/3 over `ranks` ranks: bytes per row per stage."""
    n = sum(p.numel for p in model_params(args))
    per_opt = OPTIMIZER_STATE_BYTES[optimizer]
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
