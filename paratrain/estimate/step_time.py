"""The planner's cost model: predicted time of one optimizer step for a layout, split into compute, exposed
communication, pipeline bubble and recompute. Every term is a formula of the model's sizes, the layout and the
hardware profile (paratrain/estimate/profile.py, made by paratrain/estimate/hardware.py); what is fitted to published
runs is the profile's efficiency model (hardware.py: achieved GEMM and attention rates by GPU generation, element-wise
bandwidth, execution-mode factors, each with its source), not these formulas.

Compute. Each rank runs its share of every block's GEMMs (q, k, v, o, w1, w2, w3; the output head on the last
stage; routed experts with ep) for each micro-step, on micro_batch x seq / cp tokens (context parallelism splits
every sequence over cp ranks); a GEMM of F FLOPs takes F / rate(F), where rate() is the profile's achieved matmul
rate at that size (small GEMMs — tp-split, small micro-batches — run slower) for the run's precision
(`Context.math`): the profile's bf16 curve times the ratio of the datasheet peaks (`Hardware.speed`; an A100's plain
fp32 is 1/16 of its bf16, TF32 1/2); the blocks' linear layers at a capability's rate where it has one
(`Context.capabilities`: fp8's GEMM rate; the head stays at the run's). Backward is twice the forward. Attention
adds 4 x seq x dim / tp FLOPs per token forward (the 12 L C T term of `flops_per_token`; causal: half of it is
computed; under cp each rank computes its 1/cp, in blocks of seq/cp) at the profile's attention rate (profiles
without one: at ATTENTION_EFFICIENCY of the GEMM rate). Element-wise work (norms, rotary, SwiGLU, softmax, residuals,
loss) is memory-bound: ELEMWISE_VALUES_PER_TOKEN values per token and block read/written at the profile's memory
bandwidth. The element-wise and per-operator time is multiplied by the execution mode's factor (`Context.mode`: eager
1, compile the profile's, from fusion). Each operator
also costs the profile's fixed per-operator overhead (launch/dispatch; large on a CPU, mostly hidden on a GPU),
OPS_PER_BLOCK per block forward and twice that backward (DTensor under tp multiplies it by TP_DISPATCH; each FSDP
collective adds FSDP_GROUP_OPS operators of hooks and copies). The
optimizer step reads and writes the rank's shards of what its registry entry names (`OptimizerEntry.step_bytes`:
AdamW the parameter, gradient and two moments, fp32) and launches its `step_kernels`.

Communication (alpha-beta, ring algorithms, p ranks, n bytes, link latency a and bandwidth B):
  all-reduce      2 (p-1) a + 2 (p-1)/p n / B
  all-gather      (p-1) a + (p-1)/p n / B      (n: the gathered size)
  reduce-scatter  (p-1) a + (p-1)/p n / B      (n: the input size)
  all-to-all      (p-1) a + (p-1)/p n / B
  point-to-point  a + n / B
A group uses the intra-node link when its ranks are on one node (mesh order pp, dp_replicate, dp_shard, cp, tp,
ranks numbered node by node), else the inter-node link. FSDP shards over dp_shard x cp. Per step:
  ddp/zero1  all-reduce of the fp32 gradients once per step (DDP skips sync on accumulation micro-steps), in
             buckets of 25 MB; zero1 adds an all-gather of the updated parameters after the step;
  zero2      per micro-step one all-gather of the parameters (compute dtype) and one reduce-scatter of the fp32
             gradients, block by block;  fsdp: two all-gathers (forward, backward) and one reduce-scatter; under a
             pipeline one all-gather and one reduce-scatter per group and step (Layout.fsdp_all_gathers: the count the
             trainer runs and the estimator uses);
  hsdp       fsdp over dp_shard plus an all-reduce of the gradient shards over dp_replicate;
  tp         per block and micro-step, with sequence parallelism 2 all-gathers + 2 reduce-scatters of the
             activations forward and again backward (without: 2 all-reduces each way), plus the vocabulary-
             parallel embedding/loss; recomputation repeats the forward ones;
  pp         one send of the activations per micro-batch and stage boundary forward and one backward;
  ep         all-to-all dispatch and combine per MoE layer, forward and backward;
  cp         ring attention, per block and micro-step: forward cp-1 point-to-point steps, each passing a K/V block
             (2 x tokens x kv heads x head_dim / tp in the compute dtype) to the next rank; backward the same plus
             the fp32 dK/dV accumulators, cp steps. Each step overlaps the attention of the block in hand by the
             profile's `overlap` fraction (a step's attention is 1/cp of the rank's); the rest is exposed.
             Full checkpointing repeats the forward ring (selective keeps the ring's output).
Gradient compression (`--grad-compression`, `[parallel] grad_compression`; its terms: `Compression.cost` and
`CompressionCost.seconds`, paratrain/capabilities/grad_compression.py, priced on the profile passed here): the
compressed collective sends its bytes times the method's wire fraction (bf16 1/2, powersgd sum r(n+m) / sum nm over
the matrices it compresses, sign_ef ~1/32) and pays its latency per collective (powersgd 3 all-reduces per bucket,
sign_ef an all-to-all and an all-gather); compressing and decompressing is compute on the critical path
(`compress_s`): PowerSGD's matrix products at the GEMM rate, the element-wise passes at memory bandwidth, and an
operator overhead per launch. bf16 with FSDP halves the reduce-scatter (and hsdp's all-reduce).
Data-parallel collectives overlap compute by the profile's `overlap` fraction (separate streams on a GPU; none on
a CPU whose cores are all busy computing), but at least one block's worth stays exposed; tp, ep and pp
communication is on the critical path (paratrain has no asynchronous TP), so it is all exposed.

Calibrated profiles carry `compute_scale`: the measured training step of a fixed reference model (not the model
being planned) over what these formulas predict for it on the same profile; it multiplies compute, recompute and
the optimizer step (what the terms above miss: autograd bookkeeping, the loss, allocator). Datasheet profiles: 1.

LoRA (`Context.lora`): the base is frozen, so backward makes only input gradients (one GEMM per linear instead of
two; the adapters' own GEMMs are negligible), and the gradients reduced, the ZeRO-1 all-gather and the optimizer step
are the adapters' alone; the base is all-gathered by FSDP like any parameter.

Pipeline bubble: (p-1)/(m+p-1)/v of the pipelined time (`paratrain.layout.predicted_bubble`: gpipe
and 1f1b v=1; interleaved schedules v stages per rank; zbv v=2), i.e. bubble = work x b / (1 - b). Each pipeline
rank's time per micro-batch is its own blocks (and the head on the last stage) on its own hardware
(`Context.stage_hw`, heterogeneous clusters); the slowest rank sets the step and the fill/drain is the other ranks'
time relative to it: with equal stages that is the formula above.

Recompute: full = one more forward of every block (GEMMs, element-wise and operators); every_k = 1/k of that;
selective = the element-wise work and operators of the forward (matmul and attention outputs are kept); segments =
as full (every block once more, a segment at a time).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from paratrain import capabilities
from paratrain.capabilities import implied_by_settings, optimizer_entry
from paratrain.estimate.model_states import fsdp_gathers_per_step, rank_layers
from paratrain.layout import Layout, predicted_bubble
from paratrain.models.args import ModelArgs
from paratrain.modes import CheckpointMode, CompressionSite, Precision, resolve_impl
from paratrain.optimizers import GradientReduction, Phase
from paratrain.recipe import Recipe
from paratrain.estimate.profile import Hardware, Link
from paratrain.estimate import activations as A
from paratrain.estimate.model_states import local_shape, model_params
from paratrain.models.presets import count_params, flops_per_token
from paratrain.models.registry import attention_shape, parameters, side_blocks

ELEMWISE_VALUES_PER_TOKEN = (80, 20)  # x dim, x ffn/tp: values read+written per token and block, fwd+bwd
OPS_PER_BLOCK = 35  # operators in one block's forward (backward: twice)
# DTensor dispatch (sharding propagation, redistribution) multiplies the per-operator overhead under tp: measured
# ~30x an eager operator on CPU ranks (bench/planner_accuracy.py); on a GPU mostly hidden behind device time.
TP_DISPATCH = {"cpu": 30.0, "cuda": 3.0}
# FSDP's per-group work around each collective (hooks, copy-in/copy-out, stream waits), in operators.
FSDP_GROUP_OPS = 150
# Profiles without an attention rate (CPU calibrations without a model): fused attention at half the GEMM rate.
ATTENTION_EFFICIENCY = 0.5
RING = "context-parallel ring"  # the exposed part of ring attention's point-to-point traffic


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner considers: a view of the recipe it stands for (`Context.candidate`), the run's
    settings with its own layout (degrees, dp mode, pipeline schedule and microbatches), activation checkpointing,
    micro-batch and memory tiers (the chunked loss, and the capabilities a layout's name switches on:
    Capability.layout_item, activation offload, CPU offload)."""

    recipe: Recipe  # (what `paratrain plan` writes as its config)

    def __post_init__(self) -> None:
        # the recipe's settings a candidate is read by, as plain attributes: the planner reads them in its inner loops
        # (layout, ac: the checkpointing mode, every_k, segment_blocks, micro_batch, loss_chunks; switched: the
        # capabilities its name switches on, with their settings)
        r = self.recipe
        self.__dict__.update(layout=r.layout, ac=r.checkpointing, every_k=r.every_k, segment_blocks=r.segment_blocks,
                             micro_batch=r.micro_batch, **_capability_views(r.capabilities))

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def micro_steps(self) -> int:
        """Micro-batches per rank and optimizer step: the pipeline's, else gradient accumulation steps."""
        return self.recipe.micro_steps

    @property
    def name(self) -> str:
        """The layout's name (paratrain/layout_grammar.py), e.g. `fsdp,tp=2,ac=full,mb=1,loss=8`, with its memory
        tiers."""
        return self.recipe.name

    @classmethod
    def of(cls, recipe: Recipe) -> "Candidate":
        """The candidate a run's recipe is (its chunked loss automatic: one chunk, as the planner starts from)."""
        return cls(recipe.replace(loss_chunks=max(recipe.loss_chunks, 1)))

    def replace(self, **changes) -> "Candidate":
        """This candidate with other recipe settings (`Recipe.replace`)."""
        return Candidate(self.recipe.replace(**changes))

    def switching(self, on: tuple) -> "Candidate":
        """This candidate with the layout-switched capabilities `on` instead of its own."""
        kept = tuple(c for c in self.recipe.capabilities if not c.layout_item)
        return self.replace(capabilities=(*kept, *on))

    def describe(self) -> str:
        return self.layout.short_name()


@functools.lru_cache(maxsize=256)
def _capability_views(present: tuple) -> dict:
    """A candidate's `loss_chunks` and `switched` of its recipe's capabilities, once per tuple of them."""
    return {"loss_chunks": capabilities.setting(present, "loss_chunks"),
            "switched": tuple(c for c in present if c.layout_item)}


@dataclass
class Context:
    """What every candidate shares: model, batch, hardware, topology, and the run's settings (`run`: the sequence
    length, precision, TF32, optimizer, gradient compression, LoRA, compilation and capabilities; each candidate
    replaces its layout, checkpointing, micro-batch and memory tiers)."""

    args: ModelArgs
    run: Recipe
    global_seqs: int  # sequences per optimizer step
    hw: Hardware
    gpus_per_node: int
    model_name: str = "model"
    native_max_seq_len: int | None = None  # the model's own max_seq_len when seq_len goes beyond it (long context)
    stage_hw: list[Hardware] | None = None  # heterogeneous clusters: the hardware of each pipeline rank, in order
    cluster: list | None = None  # heterogeneous clusters: the GPU groups in rank order (estimate/hetero.py GpuGroup)
    host_memory_bytes: int | None = None  # host memory per node (--host-memory; None: not checked)
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # per-shape compute terms (block_costs)

    def candidate(self, layout: Layout, **settings) -> Candidate:
        """The run on `layout` with the recipe `settings` given (checkpointing=, every_k=, micro_batch=,
        loss_chunks=, ...), its accumulation from the global batch (a batch that does not divide is
        `search.structural_reason`'s to reject)."""
        micro_batch = settings.pop("micro_batch", self.run.micro_batch)
        return self.candidate_maker(**settings)(layout, micro_batch)

    def candidate_maker(self, **settings):
        """`candidate(layout, micro_batch=mb, **settings)` as a function of (layout, mb): the planner makes tens of
        thousands with the same other settings."""
        # (the run with the other settings once per context: the planner's candidates differ in layout and micro-batch;
        # a context made by dataclasses.replace shares the cache, so a base is the run's it was made of)
        key = ("candidate settings", *sorted(settings.items()))
        hit = self.cache.get(key)
        if hit is None or hit[0] is not self.run:
            base = self.run.replace(**settings)
            hit = self.cache[key] = (self.run, base, Candidate(base).__dict__)
        recipe_type, recipe_fields, candidate_fields = type(hit[1]), hit[1].__dict__, hit[2]
        global_seqs, new = self.global_seqs, object.__new__

        def make(layout: Layout, micro_batch: int) -> Candidate:
            accum = 1 if layout.pipelined else max(1, global_seqs // (layout.dp * micro_batch))
            # (`Recipe.replace` and `Candidate.__post_init__` of plain fields, done directly)
            recipe = new(recipe_type)
            recipe.__dict__.update(recipe_fields, layout=layout, accum_steps=accum, micro_batch=micro_batch)
            candidate = new(Candidate)
            candidate.__dict__.update(candidate_fields, recipe=recipe, layout=layout, micro_batch=micro_batch)
            return candidate

        return make

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "run":
            # the run's settings the cost model reads, as plain attributes (it reads them in the planner's inner
            # loops): seq_len, precision, tf32, optimizer (an entry of capabilities.OPTIMIZERS), compression, lora
            # (adapters on a frozen model: only they reduce gradients and update states), capabilities (whose time
            # terms count: fp8's GEMMs and casts, ...), mode (eager | compile: the profile's factor on the
            # non-matmul time), ddp_bucket_mb (DDP's buckets: their all-reduces' latency)
            self.__dict__.update(seq_len=value.seq_len, precision=value.precision, tf32=value.tf32,
                                 optimizer=value.optimizer, compression=value.compression, lora=value.lora,
                                 capabilities=value.capabilities, mode="compile" if value.compile else "eager",
                                 ddp_bucket_mb=value.ddp_bucket_mb)

    def rank_hw(self, pp_rank: int) -> Hardware:
        return self.stage_hw[pp_rank] if self.stage_hw else self.hw

    def math(self, hw: Hardware | None = None, precision: str | None = None) -> str:
        """The datasheet rate matmuls in `precision` (default: the run's) go at on `hw` (default: the context's):
        modes.matmul_math, TF32 where the device has it."""
        tf32 = self.precision.tf32_on(self.tf32)  # (an fp32 tensor of a bf16 run: TF32 only if switched on)
        return Precision(precision or self.precision).matmul_math(tf32, "tf32" in (hw or self.hw).peaks)


def planned_run(hw: Hardware, **settings) -> Recipe:
    """A Context's run (`Context.run`) from the Recipe's settings by name (precision=, seq_len=, optimizer=, ...); the
    rest as the planner starts from them: one sequence per micro-step, the loss in one chunk, the optimizer's
    kernels those `optimizer.impl = "auto"` picks on the hardware's device."""
    run = Recipe(Layout.resolve(1), **{"micro_batch": 1, **settings})  # (a Recipe's loss: whole, unless given)
    if "optimizer_impl" in settings:
        return run
    return run.replace(optimizer_impl=resolve_impl("auto", hw.device, run.precision, run.optimizer))


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm_exposed_s: float
    bubble_s: float
    recompute_s: float
    optimizer_s: float
    comm_total_s: float
    tokens_per_s: float
    mfu: float
    comm: dict[str, float] = field(default_factory=dict)  # exposed seconds by kind
    compress_s: float = 0.0  # compressing and decompressing gradients (grad_compression)
    fsdp_all_gathers: int = 0  # FSDP parameter all-gathers per step on the busiest rank (Layout.fsdp_all_gathers)
    dp_bytes: float = 0.0  # bytes this rank sends per step for the data-parallel gradient (or momentum) reduction
    phases: tuple = ()  # an optimizer's kinds of steps: (name, step_s, dp_bytes) each (`predict`)

    def breakdown(self) -> str:
        return (f"compute {self.compute_s * 1e3:.1f} ms + exposed comm {self.comm_exposed_s * 1e3:.1f} ms + bubble "
                f"{self.bubble_s * 1e3:.1f} ms + recompute {self.recompute_s * 1e3:.1f} ms + optimizer "
                f"{self.optimizer_s * 1e3:.1f} ms" + (f" + compression {self.compress_s * 1e3:.1f} ms"
                                                       if self.compress_s else ""))


# -- collectives ---------------------------------------------------------------------------------------------------

def all_reduce_time(nbytes: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth


def all_gather_time(nbytes: float, p: int, link: Link) -> float:
    """nbytes: the gathered (output) size; reduce-scatter: the input size (same cost)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.latency + (p - 1) / p * nbytes / link.bandwidth


def reduce_scatter_time(nbytes: float, p: int, link: Link) -> float:
    """nbytes: the input size; the ring's cost, times what a calibration measured for this link."""
    return all_gather_time(nbytes, p, link) * link.reduce_scatter_factor


all_to_all_time = all_gather_time


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    return predicted_bubble(pp, microbatches, virtual) if pp > 1 else 0.0


def group_link(ctx: Context, stride: int, size: int) -> Link:
    """The link a group of `size` ranks `stride` apart uses: intra-node if they all sit on one node."""
    if size <= 1 or stride * size <= ctx.gpus_per_node or ctx.hw.inter is None:
        return ctx.hw.intra
    return ctx.hw.inter


# -- the model -----------------------------------------------------------------------------------------------------

def _act_bytes(ctx: Context) -> int:
    return ctx.precision.value_bytes


@dataclass(frozen=True)
class BlockCosts:
    """Seconds of one micro-step on one rank, for a hardware profile and a shape (tp, micro-batch, ep, mode)."""

    forward: float  # one block's forward
    backward: float  # one block's backward
    recompute: float  # one checkpointed block's recomputation under the candidate's mode (0: none)
    head: float  # the output head and the loss, forward + backward (the last stage)
    attention: float = 0.0  # one block's fused attention, forward (what ring attention's transfers hide behind)


def cached(ctx: Context, key, compute):
    """`compute()` once per context and key (the planner predicts tens of thousands of layouts of one model)."""
    hit = ctx.cache.get(key)
    if hit is None:
        hit = ctx.cache[key] = compute()
    return hit


def block_costs(ctx: Context, hw: Hardware, tp: int, micro_batch: int, ep: int, ac: str, cp: int = 1) -> BlockCosts:
    """The compute terms of the cost model for one shape, cached per context: the planner asks for the same shape
    for every data-parallel mode, schedule and replicate degree."""
    key = (id(hw), tp, micro_batch, ep, ac, cp, ctx.mode, ctx.capabilities, ctx.seq_len, ctx.precision, ctx.tf32,
           ctx.lora)
    return cached(ctx, key, lambda: _block_costs(ctx, hw, tp, micro_batch, ep, ac, cp))


@functools.lru_cache(maxsize=256)
def attention_gemms(args: ModelArgs, tp: int) -> tuple[tuple[float, float], ...]:
    """(input, output) widths per token of a block's attention matmuls on one tp rank, from the family's table:
    column-parallel ones split their outputs, row-parallel ones their inputs, replicated ones (low-rank
    down-projections) are whole on every rank."""
    first = next(p.layer for p in parameters(args) if p.layer is not None)
    out = []
    for p in parameters(args):
        if p.layer == first and p.matmul and len(p.shape) == 2 and ".attention." in p.name:
            rows, cols = p.shape  # (out, in)
            out.append((cols / tp if p.tp_dim == 1 else cols, rows / tp if p.tp_dim == 0 else rows))
    return tuple(out)


def _block_costs(ctx: Context, hw: Hardware, t: int, micro_batch: int, ep: int, ac: str, cp: int) -> BlockCosts:
    a, S = ctx.args, ctx.seq_len
    ab = _act_bytes(ctx)
    T = micro_batch * S // cp  # tokens per micro-step per rank (tp ranks share them, cp ranks split them)
    moe_layers = sum(1 for i in range(a.n_layers) if a.is_moe_layer(i))
    moe_frac = moe_layers / a.n_layers
    shape = attention_shape(a)
    # the run's matmuls against the profile's bf16 curves (fp32: 1/16 on an A100); the blocks' linear GEMMs at a
    # capability's rate where it has one (fp8's 8-bit GEMMs), the others (attention, the output head) at the compute
    # precision's
    speed = hw.speed(ctx.math(hw, ctx.precision.compute_precision))
    rates = [c.linear_gemm_rate for c in ctx.capabilities]

    def gemm(m, k, n, count=1.0, linear=True):
        f = 2.0 * m * k * n
        if f <= 0:
            return 0.0
        own = next((r for r in (rate(hw, f) for rate in rates) if r is not None), None) if linear else None
        return count * f / (own if own is not None else speed * hw.gemm_rate(f))

    # forward of one block, one micro-step
    attn = sum(gemm(T, k, n) for k, n in attention_gemms(a, t))
    # causal: about half the square is computed (q.k and p.v); under cp, in blocks of seq / cp
    sdpa_flop = 2.0 * T * S * shape.heads * (shape.qk_dim + shape.v_dim) / t / 2
    sdpa = sdpa_flop / speed / (hw.attention_rate(sdpa_flop)
                                or ATTENTION_EFFICIENCY * hw.gemm_rate(2.0 * (S // cp) ** 2 * shape.qk_dim))
    attn += sdpa
    dense_mlp = gemm(T, a.dim, a.ffn_hidden / t, 3)
    if moe_layers:
        eh, E = a.expert_hidden, a.moe_experts
        tok_per_expert = T * a.moe_top_k / E * ep  # each ep rank holds E/ep experts, tokens from ep ranks
        moe_mlp = gemm(tok_per_expert, a.dim, eh, 3 * E / ep) + gemm(T, a.dim, eh * a.moe_shared_experts / t, 3) \
            + gemm(T, a.dim, E)
    else:
        moe_mlp = 0.0
    mlp = (1 - moe_frac) * dense_mlp + moe_frac * moe_mlp
    ffn_w = a.ffn_hidden if not moe_layers else a.expert_hidden * (a.moe_top_k + a.moe_shared_experts)
    ew_values = ELEMWISE_VALUES_PER_TOKEN[0] * a.dim / (t if t > 1 else 1) + ELEMWISE_VALUES_PER_TOKEN[1] * ffn_w / t
    for capability in ctx.capabilities:  # (fp8's dynamic scaling: the casts' reads and writes)
        ew_values += capability.elementwise_values(hw, a.dim, ffn_w / t)
    mode = hw.mode_factor(ctx.mode)  # eager 1; compiled blocks fuse their element-wise kernels
    elemwise_fb = mode * T * ew_values * ab / hw.mem_bandwidth  # fwd + bwd
    op_cost = mode * hw.op_overhead_s * (TP_DISPATCH.get(hw.device, 3.0) if t > 1 else 1.0)
    block_f = attn + mlp + elemwise_fb / 3 + OPS_PER_BLOCK * op_cost
    # backward: each GEMM's input and weight gradients; a frozen base (LoRA) has no weight gradients to make
    gemm_b = 1 if ctx.lora is not None else 2
    block_b = gemm_b * (attn - sdpa + mlp) + 2 * sdpa + 2 * elemwise_fb / 3 + 2 * OPS_PER_BLOCK * op_cost
    # the output head stays in the compute precision (torchao/torchtitan leave it out of fp8)
    head = (1 + gemm_b) * gemm(T, a.dim, a.vocab_size / t, linear=False) \
        + 3 * T * a.vocab_size / t * 4 * 3 / hw.mem_bandwidth
    rec = block_f if ac.whole_blocks else (elemwise_fb / 3 + OPS_PER_BLOCK * op_cost) if ac.selective else 0.0
    scale = hw.compute_scale  # a calibrated profile's correction (1.0 for datasheets)
    return BlockCosts(block_f * scale, block_b * scale, rec * scale, head * scale, sdpa * scale)


def compute_key(ctx: Context) -> tuple:
    """What a context's compute terms read besides the candidate (`block_costs`' key): a context made with
    dataclasses.replace shares its cache."""
    return id(ctx.args), id(ctx.hw), ctx.mode, ctx.capabilities, ctx.seq_len, ctx.precision, ctx.tf32, ctx.lora


def pipeline_key(lay: Layout) -> tuple:
    """What the blocks of each pipeline rank depend on (`rank_layers`): the key of the per-shape caches."""
    return (lay.pp, lay.pp_virtual, lay.pp_schedule, lay.pp_split) if lay.pp > 1 else (1,)


@dataclass(frozen=True)
class RankBlocks:
    """The blocks of each pipeline rank for one pipeline shape (`rank_layers`), and what the cost model reads of
    them."""

    layers: list  # blocks of each pipeline rank (rank_layers)
    most: int  # blocks of the busiest rank
    busiest: int  # the first rank holding `most` blocks
    moe: tuple[int, ...]  # mixture-of-experts blocks of each rank


def rank_blocks(ctx: Context, lay: Layout) -> RankBlocks:
    """`rank_layers` of the layout's pipeline shape and its counts, once per context and shape."""
    def compute():
        layers = rank_layers(lay, ctx.args)
        busiest = max(range(len(layers)), key=lambda r: len(layers[r]))
        return RankBlocks(layers, max(len(x) for x in layers), busiest,
                          tuple(sum(map(ctx.args.is_moe_layer, b)) for b in layers))

    return cached(ctx, ("rank_blocks", id(ctx.args), pipeline_key(lay)), compute)


def rank_compute(c: Candidate, ctx: Context) -> list[tuple[float, float]]:
    """(compute, recompute) seconds of one micro-step on each pipeline rank: its blocks, and the head on the rank
    holding the last stage, each on the rank's own hardware (`Context.stage_hw`, heterogeneous clusters). Cached per
    context and shape (one GPU type; heterogeneous stages: per call)."""
    if ctx.stage_hw:
        return _rank_compute(c, ctx)
    lay = c.layout
    key = ("rank_compute", compute_key(ctx), pipeline_key(lay), c.tp, c.micro_batch, c.ep, c.ac, c.every_k, lay.cp)
    return cached(ctx, key, lambda: _rank_compute(c, ctx))


def _rank_compute(c: Candidate, ctx: Context) -> list[tuple[float, float]]:
    keys, terms_of = _rank_terms(c, ctx)
    return [terms_of[key] for key in keys]


def _rank_terms(c: Candidate, ctx: Context) -> tuple[list, dict]:
    """`rank_compute` as (a key per pipeline rank, {key: its (compute, recompute)}): with one GPU type, ranks with as
    many blocks (and the last stage or not) have the same terms, computed once; heterogeneous stages: a rank's own."""
    lay = c.layout
    last_owner = lay.stage_owner(lay.num_stages - 1) if lay.pp > 1 else 0

    def terms(bc: BlockCosts, blocks: int, last: bool) -> tuple[float, float]:
        # the side heads' blocks (models/family.SideHead), each with one more pass through the head, on the last stage
        depths = side_blocks(ctx.args) if last else 0
        n = blocks + depths
        return (n * (bc.forward + bc.backward) + (bc.head * (1 + depths) if last else 0.0),
                c.ac.recomputed_blocks(n, c.every_k) * bc.recompute)

    if ctx.stage_hw:  # each rank on its own hardware
        layers = rank_blocks(ctx, lay).layers
        return list(range(len(layers))), {
            r: terms(block_costs(ctx, ctx.rank_hw(r), c.tp, c.micro_batch, c.ep, c.ac, lay.cp), len(blocks),
                     r == last_owner) for r, blocks in enumerate(layers)}
    shape = cached(ctx, ("rank shapes", id(ctx.args), pipeline_key(lay)), lambda: [
        (len(blocks), r == last_owner) for r, blocks in enumerate(rank_blocks(ctx, lay).layers)])
    distinct = cached(ctx, ("distinct rank shapes", id(ctx.args), pipeline_key(lay)), lambda: list(dict.fromkeys(shape)))
    one = block_costs(ctx, ctx.hw, c.tp, c.micro_batch, c.ep, c.ac, lay.cp)
    return shape, {key: terms(one, *key) for key in distinct}


def _slowest(c: Candidate, ctx: Context) -> tuple[int, tuple[float, float], float]:
    """(the slowest pipeline rank, its (compute, recompute) per micro-step, the pipeline's fill and drain: the other
    ranks' work per micro-batch relative to the slowest's; p - 1 with equal stages, so the bubble is the
    (p-1)/(m+p-1)/v of Layout.predicted_bubble)."""
    def compute():
        keys, terms_of = _rank_terms(c, ctx)
        work_of = {key: sum(t) for key, t in terms_of.items()}  # (compute + recompute of a rank)
        work = list(map(work_of.__getitem__, keys))
        slowest = work.index(max(work))  # (the first of the slowest)
        fill = sum(work) / work[slowest] - 1 if c.layout.pp > 1 else 0.0
        return slowest, terms_of[keys[slowest]], fill

    if ctx.stage_hw:
        return compute()
    lay = c.layout
    key = ("slowest", compute_key(ctx), pipeline_key(lay), c.tp, c.micro_batch, c.ep, c.ac, c.every_k, lay.cp)
    return cached(ctx, key, compute)


def without_microbatches(lay: Layout) -> tuple:
    """The layout's fields but its pipeline micro-batches (a cache key)."""
    fields = dict(vars(lay))
    del fields["pp_microbatches"]
    return tuple(fields.values())


def step_lower_bound(c: Candidate, ctx: Context) -> float:
    """A floor of `predict(c, ctx).step_s` (the planner predicts layouts in its order, and only those that may rank):
    the slowest rank's compute and recompute, the exposed communication on the pipeline's critical path (tensor
    parallel, point-to-point, expert all-to-all, ring attention) and the bubble, in the floating-point operations of
    `_predict`: its pipelined time and bubble are these, and its exposed communication is a sum of terms >= 0 these
    among them, in this order. Every term it leaves out is >= 0 and rounding is monotone, so it is never above the
    prediction, bit for bit."""
    lay = c.layout
    n_micro = c.micro_steps
    _, (compute, recompute), fill = _slowest(c, ctx)
    compute_recompute = n_micro * compute + n_micro * recompute
    T = c.micro_batch * ctx.seq_len // lay.cp
    terms = list(_model_parallel_terms(c, ctx, _Links.of(c, ctx), T, n_micro, rank_blocks(ctx, lay).most,
                                       _moe_layers(ctx)).values())
    if lay.cp > 1:
        terms.append(_ring(c, ctx, T, n_micro)[1])
    pipelined = compute_recompute
    for seconds in terms:
        pipelined += seconds
    floor = compute_recompute + sum(terms)
    return floor + pipelined * fill / (n_micro * lay.pp_virtual) if c.pp > 1 else floor


def _moe_layers(ctx: Context) -> int:
    a = ctx.args
    return cached(ctx, ("moe_layers", id(a)), lambda: sum(1 for i in range(a.n_layers) if a.is_moe_layer(i)))


def _ring(c: Candidate, ctx: Context, T: int, n_micro: int) -> tuple[float, float]:
    """`ring_time` of a context-parallel candidate, cached per shape."""
    key = ("ring", compute_key(ctx), ctx.gpus_per_node, c.tp, c.layout.cp, c.micro_batch, c.ep, c.ac, c.every_k,
           n_micro, c.pp)
    return cached(ctx, key, lambda: ring_time(ctx, c, T, attention_time(ctx, c)))


MOMENTUM_ALL_REDUCE = "1-bit momentum all-reduce"  # an optimizer's own all-reduce, after the backward (exposed)


def predict(c: Candidate, ctx: Context) -> Prediction:
    """The predicted step. An optimizer that communicates itself (1-bit Adam, 0/1 Adam) has kinds of steps
    (`OptimizerEntry.phases`): each is predicted, `phases` lists them (name, step seconds, data-parallel bytes this
    rank sends), and the layout is ranked by the last, the steady state after the warm-up."""
    phases = optimizer_entry(ctx.optimizer).phases
    if not phases:
        return _predict(c, ctx)
    preds = [_predict(c, ctx, phase) for phase in phases]
    steady = preds[-1]
    steady.phases = tuple((phase.name, p.step_s, p.dp_bytes) for phase, p in zip(phases, preds))
    return steady


def _predict(c: Candidate, ctx: Context, phase: Phase | None = None) -> Prediction:
    """One kind of step (`phase`: an optimizer's own, or None): compute and recompute of the slowest pipeline rank,
    the exposed communication, the pipeline bubble, the optimizer step and gradient compression."""
    a, hw, S, lay = ctx.args, ctx.hw, ctx.seq_len, c.layout
    T = c.micro_batch * S // lay.cp  # tokens per micro-step per rank (tp ranks share them, cp ranks split them)
    n_micro = c.micro_steps
    blocks = rank_blocks(ctx, lay)
    layers = blocks.most  # the busiest pipeline rank's blocks
    moe_layers = _moe_layers(ctx)
    slowest, per_step, fill = _slowest(c, ctx)
    compute, recompute = (n_micro * x for x in per_step)
    P_stage, G_stage = _stage_params(c, ctx, moe_layers)
    optimizer = _optimizer_step_s(c, ctx, G_stage)
    comp = _StepCompression.of(c, ctx, phase)
    links = _Links.of(c, ctx)
    dp = _data_parallel(c, ctx, comp, links, P_stage, G_stage, n_micro, blocks)
    comm = dp.comm
    comm_total = dp.overlappable
    if dp.overlappable:
        hidden = min(dp.overlappable - dp.min_exposed, hw.overlap * (compute + recompute))
        comm["data-parallel"] = dp.overlappable - max(0.0, hidden)
    comm.update(_model_parallel_terms(c, ctx, links, T, n_micro, layers, moe_layers))
    if lay.cp > 1:
        ring_total, comm[RING] = _ring(c, ctx, T, n_micro)
        comm_total += ring_total - comm[RING]  # the hidden part (the exposed part is added below)
    for capability in c.switched:  # (activation offload: blocks' saved tensors to host and back)
        if capability.host_activations(layers) is not None:
            exposed, moved = host_activation_time(capability, c, ctx, layers, compute / max(n_micro, 1))
            comm[capability.copy_label] = exposed
            comm_total += moved - exposed
    for capability in c.switched:  # (the chunked loss: the head's forward once more, piece by piece)
        recompute += capability.head_recompute_s(block_costs(ctx, hw, c.tp, c.micro_batch, c.ep, c.ac, lay.cp).head,
                                                 n_micro)
    # a capability's optimizer's own work beside its updates (whole matrices orthogonalised, their redistributions)
    for seconds, exposed in optimizer_capability_terms(c, ctx, links):
        optimizer += seconds
        comm.update(exposed)
    comm_total += sum(v for k, v in comm.items() if k not in ("data-parallel",))
    exposed = sum(comm.values())

    pipelined = compute + recompute + comm.get("tensor-parallel", 0.0) + comm.get("pipeline p2p", 0.0) \
        + comm.get("expert all-to-all", 0.0) + comm.get(RING, 0.0)
    bubble = pipelined * fill / (n_micro * lay.pp_virtual) if c.pp > 1 else 0.0
    # hsdp's hook reduces every micro-step; DDP and an optimizer's own all-reduce once per step
    compress = comp.seconds
    compress *= n_micro if comp.site is CompressionSite.REPLICATE_HOOK and not comp.after_backward else 1
    step = compute + recompute + exposed + bubble + optimizer + compress
    tokens = ctx.global_seqs * S
    tok_s = tokens / step
    peaks = [h.peak(ctx.math(h)) for h in ctx.stage_hw or [hw]]  # the peak of the run's matmul rate (fp8: FP8's)
    peak = sum(peaks) / len(peaks)
    mfu = cached(ctx, ("flops_per_token", S), lambda: flops_per_token(a, S)) * tok_s / (c.world * peak)
    return Prediction(step, compute, exposed, bubble, recompute, optimizer, comm_total, tok_s, mfu, comm, compress,
                      dp.fsdp_gathers, dp.dp_bytes)


def routed_expert_params(a) -> int:
    """Parameters of one MoE layer's routed experts (w1, w2, w3 of each): sharded over ep, replicated over tp."""
    return a.moe_experts * 3 * a.dim * a.expert_hidden


def _stage_params(c: Candidate, ctx: Context, moe_layers: int) -> tuple[float, float]:
    """(parameters of this rank's stage before data-parallel sharding, those of them with gradients and optimizer
    state: every parameter, or LoRA's adapters, the base being only gathered)."""
    a, t = ctx.args, c.tp
    P = cached(ctx, "params", lambda: count_params(a))
    # routed experts are sharded over ep (and FSDP-gathered only over dp_shard / ep): count them once per ep group
    experts = moe_layers * routed_expert_params(a) if moe_layers else 0
    P_stage = (P - experts + experts / c.ep) / c.pp / t
    G_stage = P_stage if ctx.lora is None else cached(ctx, "trainable", lambda: ctx.lora.trainable_count(a)) / c.pp / t
    return P_stage, G_stage


def _optimizer_step_s(c: Candidate, ctx: Context, G_stage: float) -> float:
    """Seconds of the optimizer step on the rank's shards of what has optimizer state (CPU offload: on the host)."""
    hw = ctx.hw
    opt_params = G_stage / c.layout.optimizer_shards
    entry = optimizer_entry(ctx.optimizer)
    optimizer = (opt_params * entry.step_bytes / hw.mem_bandwidth + entry.step_kernels * hw.op_overhead_s) \
        * hw.compute_scale
    for capability in c.switched:  # (CPU offload: on the host)
        elsewhere = capability.host_optimizer_s(opt_params, entry.step_bytes, hw)
        optimizer = optimizer if elsewhere is None else elsewhere
    return optimizer


@dataclass(frozen=True)
class _StepCompression:
    """Gradient compression in one kind of step: where it acts, the fraction of the bytes it sends, its collectives
    per bucket and its compute seconds (an optimizer's phase: its own collective, none in a local step (`silent`),
    in the optimizer step when not in the backward (`after_backward`))."""

    site: CompressionSite
    wire_fraction: float = 1.0
    collectives: int = 1
    seconds: float = 0.0
    silent: bool = False
    after_backward: bool = False

    @property
    def reduce_fraction(self) -> float:
        """What FSDP's reduce-scatter sends: half in bf16 through its reduce dtype."""
        return 0.5 if self.site is CompressionSite.REDUCE_DTYPE else 1.0

    @classmethod
    def of(cls, c: Candidate, ctx: Context, phase: Phase | None) -> "_StepCompression":
        a, hw, lay = ctx.args, ctx.hw, c.layout
        comp_in = ctx.compression
        silent = after_backward = False
        if phase is not None:
            comp_in = comp_in.in_phase(optimizer_entry(ctx.optimizer), phase)
            silent, after_backward = phase.reduction is GradientReduction.LOCAL, not phase.in_backward
        site = comp_in.site(lay)
        if not site.hooked:
            return cls(site, silent=silent, after_backward=after_backward)
        shapes = [local_shape(q, lay) for q in model_params(a, ctx.lora) if q.trainable]  # (no pp or tp here)
        if site is CompressionSite.REPLICATE_HOOK:  # the FSDP shard of each parameter (dim 0 over dp_shard)
            shapes = [(math.ceil(s[0] / lay.dp_shard), *s[1:]) for s in shapes]
        cost = comp_in.cost(shapes, c.dp if site is CompressionSite.DDP_HOOK else lay.dp_replicate)
        compress = cost.seconds(hw, hw.speed(ctx.math(hw, "fp32")))  # (the gradients are fp32)
        return cls(site, cost.wire_fraction, cost.collectives, compress, silent, after_backward)


@dataclass(frozen=True)
class _Links:
    """The links of a rank's groups: tensor parallel, FSDP's shard (dp_shard x cp), data parallel, hsdp's replicas
    and the pipeline."""

    tp: Link
    shard: Link
    dp: Link
    rep: Link
    pp: Link

    @classmethod
    def of(cls, c: Candidate, ctx: Context) -> "_Links":
        lay, t = c.layout, c.tp
        shard = lay.dp_shard * lay.cp  # FSDP's group: dp_shard x cp, contiguous in the mesh
        return cls(group_link(ctx, 1, t), group_link(ctx, t, shard), group_link(ctx, t, c.dp),
                   group_link(ctx, t * shard, lay.dp_replicate), group_link(ctx, t * c.dp * lay.cp, c.pp))


@dataclass
class _DataParallel:
    """The data-parallel reduction of one step: its exposed terms by name (those it never overlaps), the seconds
    that can overlap compute and the least of them left exposed, FSDP's all-gathers per step and the bytes this rank
    sends."""

    comm: dict = field(default_factory=dict)
    overlappable: float = 0.0
    min_exposed: float = 0.0
    fsdp_gathers: int = 0
    dp_bytes: float = 0.0


def _data_parallel(c: Candidate, ctx: Context, comp: _StepCompression, links: _Links, P_stage: float,
                   G_stage: float, n_micro: int, blocks: RankBlocks) -> _DataParallel:
    """The data-parallel reduction: DDP's (and ZeRO-1's) or FSDP's (and hsdp's replicas'), none without data
    parallelism."""
    dp = _DataParallel()
    if c.layout.dp_cp > 1:
        if c.layout.uses_ddp:
            _ddp_reduction(dp, c, ctx, comp, links, G_stage)
        else:
            _fsdp_reduction(dp, c, ctx, comp, links, P_stage, G_stage, n_micro, blocks)
    return dp


def _ddp_reduction(dp: _DataParallel, c: Candidate, ctx: Context, comp: _StepCompression, links: _Links,
                   G_stage: float) -> None:
    """DDP's bucketed all-reduce of the fp32 gradients once per step (an optimizer's own: after the backward,
    exposed), and ZeRO-1's all-gather of the updated parameters."""
    g = G_stage * 4
    buckets = max(1, math.ceil(g / (ctx.ddp_bucket_mb * 2**20)))
    latency = all_reduce_time(0.0, c.dp, links.dp)  # per collective; a compressed bucket may need several
    ar = buckets * (comp.collectives * latency + all_reduce_time(g * comp.wire_fraction / buckets, c.dp, links.dp)
                    - latency)
    if comp.after_backward:
        dp.comm[MOMENTUM_ALL_REDUCE] = 0.0 if comp.silent else ar
    else:
        dp.overlappable += ar
        dp.min_exposed += ar / buckets
    dp.dp_bytes = 0.0 if comp.silent else 2 * (c.dp - 1) / c.dp * g * comp.wire_fraction
    if c.layout.zero1:
        dp.comm["zero1 param all-gather"] = all_gather_time(G_stage * 4, c.dp, links.dp)


def _fsdp_reduction(dp: _DataParallel, c: Candidate, ctx: Context, comp: _StepCompression, links: _Links,
                    P_stage: float, G_stage: float, n_micro: int, blocks: RankBlocks) -> None:
    """FSDP's all-gathers of the parameters and reduce-scatters of the gradients, group by group (CPU offload's
    copies with them), then hsdp's all-reduce over the replicas."""
    a, hw, lay = ctx.args, ctx.hw, c.layout
    shard = lay.dp_shard * lay.cp
    pbytes = ctx.precision.value_bytes
    rs_frac = comp.reduce_fraction
    # The one rule the trainer follows and the estimator uses (Layout.fsdp_all_gathers): pipelined stages gather
    # each group once per step and reduce-scatter once; otherwise per micro-step.
    groups = lay.fsdp_groups(blocks.most, blocks.moe[blocks.busiest], blocks.busiest)
    n_ag, n_rs = lay.fsdp_all_gathers(n_micro, groups), lay.fsdp_reduce_scatters(n_micro, groups)
    # (pipelined: each group once per step, whatever the micro-batches: one entry for all of them)
    key = (("gathers", id(a), lay, n_micro) if not lay.pipelined
           else ("gathers", id(a), *without_microbatches(lay)))
    dp.fsdp_gathers = cached(ctx, key, lambda: fsdp_gathers_per_step(lay, a, n_micro, blocks.layers, blocks.moe))
    group = FSDP_GROUP_OPS * hw.op_overhead_s
    ag = n_ag * (all_gather_time(P_stage * pbytes / groups, shard, links.shard) + group)
    rs = n_rs * (reduce_scatter_time(G_stage * 4 * rs_frac / groups, shard, links.shard) + group)
    dp.overlappable += ag + rs
    dp.min_exposed += ag / n_ag + rs / n_rs  # one group's worth stays exposed
    dp.dp_bytes = (shard - 1) / shard * G_stage * 4 * rs_frac * n_rs / groups
    for capability in c.switched:  # (CPU offload: each group's fp32 shards in and its gradients out)
        dp.overlappable += capability.fsdp_copy_s(n_ag + n_rs, P_stage * 4 / shard / groups, hw)
    if lay.hybrid:
        _replicate_reduction(dp, c, comp, links, G_stage, n_rs, groups, group)


def _replicate_reduction(dp: _DataParallel, c: Candidate, comp: _StepCompression, links: _Links, G_stage: float,
                         n_rs: int, groups: int, group: float) -> None:
    """hsdp's all-reduce of the gradient shards over its replicas: with each reduce-scatter, or once per step over
    the whole shard (an optimizer's own, after the backward)."""
    lay = c.layout
    shard = lay.dp_shard * lay.cp
    frac = comp.reduce_fraction if comp.site is CompressionSite.REDUCE_DTYPE else comp.wire_fraction
    r = lay.dp_replicate
    latency = all_reduce_time(0.0, r, links.rep)
    if comp.after_backward:  # once per step, over the whole shard
        dp.comm[MOMENTUM_ALL_REDUCE] = 0.0 if comp.silent else (
            all_reduce_time(G_stage * 4 * frac / shard, r, links.rep) + (comp.collectives - 1) * latency)
        dp.dp_bytes += 0.0 if comp.silent else 2 * (r - 1) / r * G_stage * 4 * frac / shard
    else:
        hr = n_rs * (all_reduce_time(G_stage * 4 * frac / shard / groups, r, links.rep)
                     + (comp.collectives - 1) * latency + group)
        dp.overlappable += hr
        dp.min_exposed += hr / n_rs
        dp.dp_bytes += 2 * (r - 1) / r * G_stage * 4 * frac / shard * n_rs / groups


def _model_parallel_terms(c: Candidate, ctx: Context, links: _Links, T: int, n_micro: int, layers: int,
                          moe_layers: int) -> dict[str, float]:
    """The exposed communication of tensor parallelism (sequence parallel), the pipeline's point-to-point sends and
    expert parallelism's all-to-all, by kind, in that order."""
    a, t, ab = ctx.args, c.tp, _act_bytes(ctx)
    comm = {}
    if t > 1:
        comm["tensor-parallel"] = tensor_parallel_s(c, ctx, links.tp, T, n_micro, layers)
    if c.pp > 1:
        act = T * a.dim * ab / (t if t > 1 else 1)
        comm["pipeline p2p"] = 2 * c.layout.pp_virtual * n_micro * links.pp.p2p_time(act)
    if c.ep > 1 and moe_layers:
        ep_link = group_link(ctx, t, c.ep)  # an ep group is ep consecutive dp_shard ranks
        a2a = all_to_all_time(T * a.moe_top_k * a.dim * ab, c.ep, ep_link) + all_to_all_time(64, c.ep, ep_link)
        comm["expert all-to-all"] = n_micro * math.ceil(moe_layers / c.pp) * 4 * a2a
    return comm


def tensor_parallel_s(c: Candidate, ctx: Context, link: Link, T: int, n_micro: int, layers: int) -> float:
    """The exposed tensor-parallel communication of a step (tp > 1): the busiest rank's `layers` blocks and the
    embedding and head, `T` tokens per micro-step, sequence parallel (the planner's layouts always use it)."""
    t, act = c.tp, T * ctx.args.dim * _act_bytes(ctx)
    per_block_f = 2 * all_gather_time(act, t, link) + 2 * reduce_scatter_time(act, t, link)
    extra = c.ac.forward_repeats(c.every_k)
    emb = 4 * all_reduce_time(T * 4, t, link) + 2 * all_gather_time(act, t, link)
    return n_micro * (layers * per_block_f * (2 + extra) + emb)


@dataclass(frozen=True)
class OptimizerStep:
    """What a capability's optimizer-step term (`Capability.optimizer_step_s`) is priced with: a candidate on the
    context's model and hardware, and the cost model's prices of matmuls and collectives (torch-free)."""

    candidate: Candidate
    ctx: Context
    links: _Links

    @property
    def params(self) -> tuple:
        """The model's parameter table (paratrain/models/family.py's Params)."""
        return model_params(self.ctx.args)

    @property
    def precision(self) -> str:
        return self.ctx.precision

    def cached(self, key: str, compute):
        """`compute()` once per context and model (a term of the model alone, not of the candidate)."""
        return cached(self.ctx, (key, id(self.ctx.args)), compute)

    def matmul_s(self, flops: float, per_matrix: float, precision: str) -> float:
        """Seconds of `flops` of matmuls in `precision`, each of `per_matrix` FLOPs, on the context's hardware."""
        hw = self.ctx.hw
        speed = hw.speed(self.ctx.math(hw, precision))
        return flops / (speed * hw.gemm_rate(per_matrix)) * hw.compute_scale

    def all_gather_s(self, nbytes: float, ranks: int) -> float:
        """An all-gather of `nbytes` (the output) over the data-parallel group's link."""
        return all_gather_time(nbytes, ranks, self.links.dp)

    def all_to_all_s(self, nbytes: float, ranks: int) -> float:
        """An all-to-all of `nbytes` per rank over FSDP's shard group's link."""
        return all_to_all_time(nbytes, ranks, self.links.shard)


def optimizer_capability_terms(c: Candidate, ctx: Context, links: _Links) -> list[tuple[float, dict[str, float]]]:
    """The optimizer step's own terms of the capabilities the context's optimizer implies, with their defaults (the
    planner costs an optimizer's default settings): (seconds, {exposed communication: seconds}) each."""
    implied = cached(ctx, ("optimizer capabilities", ctx.precision, ctx.optimizer),
                     lambda: implied_by_settings(ctx.precision, ctx.optimizer))
    if not implied:
        return []
    step = OptimizerStep(c, ctx, links)
    return [t for t in (capability.optimizer_step_s(step) for capability in implied) if t is not None]


def host_activation_time(capability, c: Candidate, ctx: Context, blocks: int,
                         compute_s: float) -> tuple[float, float]:
    """(exposed, total) seconds per step of the copies of a capability that keeps blocks' saved activations in host
    memory (`Capability.host_activation_s`: activation offload) on the busiest rank, holding `blocks` blocks: a
    moved block's saved tensors as without checkpointing."""
    lay, hw = c.layout, ctx.hw
    d = A.act_dims(ctx.args, lay, ctx.precision, "paratrain", c.micro_batch, ctx.seq_len, hw.device)
    mode = c.ac if c.ac.uniform else CheckpointMode.NONE
    n = len(capability.host_activations(blocks)[0])
    return capability.host_activation_s(A.offloaded(d, mode), n, blocks, c.micro_steps, compute_s, hw)


def attention_time(ctx: Context, c: Candidate) -> float:
    """Forward seconds of one block's fused attention on one rank and micro-step (see the module doc)."""
    return block_costs(ctx, ctx.hw, c.tp, c.micro_batch, c.ep, c.ac, c.layout.cp).attention


def ring_time(ctx: Context, c: Candidate, tokens: int, attention_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of ring attention's point-to-point traffic per optimizer step (see the module doc):
    `tokens` per rank and micro-step, `attention_s` the forward attention time of one block and micro-step."""
    a, hw, lay = ctx.args, ctx.hw, c.layout
    cp = lay.cp
    link = group_link(ctx, c.tp, cp)  # the cp axis sits just outside tp
    shape = attention_shape(a)
    kv = tokens * shape.kv_heads * (shape.qk_dim + shape.v_dim) / c.tp * _act_bytes(ctx)  # one K/V block
    step_kv, step_dkv = link.p2p_time(kv), link.p2p_time(kv / _act_bytes(ctx) * 4)  # dK/dV travel in fp32
    hide_f, hide_b = hw.overlap * attention_s / cp, hw.overlap * 2 * attention_s / cp  # per ring step
    fwd, fwd_exposed = (cp - 1) * step_kv, (cp - 1) * max(0.0, step_kv - hide_f)
    bwd = (cp - 1) * step_kv + cp * step_dkv
    bwd_exposed = (cp - 1) * max(0.0, step_kv + step_dkv - hide_b) + step_dkv  # the last hop home is not hidden
    repeat = c.ac.forward_repeats(c.every_k)
    blocks = c.micro_steps * math.ceil(a.n_layers / c.pp)
    return blocks * (fwd * (1 + repeat) + bwd), blocks * (fwd_exposed * (1 + repeat) + bwd_exposed)
