"""Activation bytes per block, derived from the tensors our model code saves for backward.

Read with paratrain/models/llama.py open. N = micro_batch x seq_len tokens; C = dim; Hq, Hkv heads of
D = C / Hq; F = ffn_hidden; V = vocab. Three precision regimes give each saved tensor its dtype:

- "single": fp32 training, everything fp32.
- "autocast" (bf16/fp16 without FSDP: one process, ddp, zero1, tensor parallel only): parameters are fp32,
  `torch.autocast` runs matmuls and attention in bf16. The embedding and RMSNorm are not autocast ops, so the
  residual stream and the norm outputs stay fp32, and every linear casts its input to bf16 separately: q, k, v
  each save their own bf16 copy of the normed input (3 copies), w1 and w3 two.
- "pure" (bf16/fp16 with FSDP2's MixedPrecisionPolicy, LoRA's base stored in bf16, and the classic Megatron-style
  accounting): bf16 parameters are all-gathered and everything computes in bf16 except where the code says
  `.float()`.

One dense block saves ("none" checkpointing), in forward order:

  attention_norm   x.float() (the fp32 block input, N C 4 B), rsqrt (N 4 B), x*rsqrt (N C R; the `* weight`
                   saves it), the normed output (the q/k/v input: see above)
  q/k norms        (families with per-head norms: Qwen3) each the projection's output in fp32 (N H D 4 B; a copy
                   unless fp32), rsqrt (N H 4 B) and x*rsqrt (N H D L) for q's and k's heads
  apply_rope       its fp32 math saves nothing; q after rope (N Hq D L) is saved by attention
  GQA              k, v after repeat_interleave: N Hq D L each (N Hkv D L when Hkv = Hq)
  SDPA (flash)     output N Hq D L and logsumexp N Hq 4 B (the wo input is a view of the output)
  ffn_norm         as attention_norm, on h = x + attention
  SwiGLU           w1 x, silu(w1 x), w3 x, and their product (the w2 input): 4 N F L

Context parallelism (cp ranks share each sequence) makes N this rank's tokens, micro_batch x seq_len / cp, for
every tensor above and the logits. Its ring attention (distributed/context_parallel.py) saves q, k and v without
the GQA repetition (N Hkv D L each for k and v), the merged output and logsumexp, and each block's attention
gathers the rotary angles of the rank's positions (2 x N/b x D/2 in the tables' dtype), which rope saves.

R is the residual dtype (4 B, or 2 B in "pure"), L the compute dtype (4 B fp32, else 2 B). Tensor parallel
divides the head and hidden dimensions by tp; sequence parallel also divides the norm and residual tensors
(the q/k/v and w1/w3 inputs are all-gathered, so those stay whole). FSDP's mixed precision casts each block's
forward inputs, which adds bf16 copies of the rotary tables (2 x T x D/2 x 2 B per block, T the whole sequence), kept by
rope's views of them or by an activation checkpoint.

Checkpointing (parallelize.apply_activation_checkpointing): "full" keeps only each block's input (N C R/sp);
"every_k" does that for blocks 0, k, 2k, ...; "selective" keeps the outputs of matmuls and attention
(`_SAVE_OPS`): wq, wk, wv, wo, w1, w3, w2 outputs and SDPA's output and logsumexp, plus the block input;
wo and w2 outputs are partial sums before tensor parallel's reduction, so they are N C L whole. "segments" keeps
each segment's input (its first block's, as "full") and nothing of its other blocks; the backward of the segment's
last block recomputes the whole segment, so every block of it holds its saved tensors (as without checkpointing) until
its own backward frees them. The recomputed blocks share the checkpoint's inputs: the first block's norm its fp32
input (outside "pure"), every block FSDP's cast rotary tables.

The numbers were checked byte for byte against measurement (bench/memory_accuracy.py,
tests/test_estimate.py); the MoE layer's formula follows paratrain/models/moe.py but is not yet measured.
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass

from paratrain import capabilities
from paratrain.layout import Layout
from paratrain.memory import MIN_OFFLOAD_BYTES
from paratrain.models.args import ModelArgs
from paratrain.models.registry import attention_shape, roles
from paratrain.modes import Precision

FP32, INT64 = 4, 8

# Extra bytes per token of torch's loss_parallel cross-entropy backward (target, masks, gathered values):
# measured on torch 2.13 (bench/memory_accuracy.py), beside 3 x N x V/tp x 4 B of logits-sized buffers.
LOSS_PARALLEL_BYTES_PER_TOKEN = 33


@dataclass(frozen=True)
class ActDims:
    b: int  # micro-batch (sequences)
    s: int  # sequence length
    C: int
    Hq: int  # local query heads (after tp)
    Hkv: int  # local kv heads
    D: int
    F: int  # local ffn hidden
    V: int  # vocabulary seen by the loss on this rank (V / tp with loss parallel)
    tp: int
    sp: bool
    regime: str  # single | autocast | pure
    fsdp: bool  # FSDP mixed precision casts block inputs (rotary tables)
    gqa: bool  # k, v repeated to Hq heads
    loss_parallel: bool
    cuda: bool = True  # CUDA kernels (vs CPU): only changes how autocast treats the MoE experts' grouped matmul
    cp: int = 1  # context parallel: s is this rank's share of the sequence; ring attention
    max_seq: int = 0  # the whole sequence's length: the rows of the rotary tables the model hands each block
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (the family's "head_norm" parameters: Qwen3)
    chunks: int = 1  # the chunked loss's pieces of the N tokens the output projection and the loss run over
    # The family's attention shape (models/family.AttentionShape) beyond D: v's width as the kernel reads it, the
    # output projection's input width per head, the rotary width, the normalised latents before the up-projections
    # (replicated under tp) and the projections reading the normed input (`input_linears`; q/k/v: 3).
    Dv: int = 0
    Do: int = 0
    rope_D: int = 0
    latents: tuple[int, ...] = ()
    input_linears: int = 3

    @property
    def N(self) -> int:
        return self.b * self.s

    @property
    def R(self) -> int:  # residual stream
        return 2 if self.regime == "pure" else 4

    @property
    def L(self) -> int:  # matmul / attention outputs
        return 4 if self.regime == "single" else 2

    @property
    def seq_div(self) -> int:  # sequence-parallel division of norm/residual tensors
        return self.tp if self.sp else 1

    @property
    def _rope_cast(self) -> bool:
        """FSDP's mixed precision casts each block's inputs, the rotary tables among them, to bf16."""
        return self.regime == "pure" and self.fsdp and self.L == 2

    @property
    def rope_tables(self) -> int:
        """Bytes of a block's bf16 copies of the two (T x D/2) rotary tables, when FSDP casts them;
        an activation checkpoint holds them with the block's inputs."""
        return 2 * self.max_seq * (self.rope_D // 2) * 2 if self._rope_cast else 0

    @property
    def rope_copies(self) -> int:
        """The cast tables a block keeps without checkpointing: rope's saved views of them (context parallelism saves
        the rows it gathers instead)."""
        return self.rope_tables if self.cp == 1 else 0

    @property
    def rope_gathered(self) -> int:
        """Rotary angles gathered at this rank's positions per block (context parallel; else views of the tables)."""
        if self.cp == 1:
            return 0
        return 2 * self.s * (self.rope_D // 2) * (2 if self._rope_cast else FP32)

    @property
    def kv_heads_saved(self) -> int:
        """K/V heads attention saves: SDPA saves them repeated to the query heads, ring attention does not."""
        return self.Hq if (self.gqa and self.cp == 1) else self.Hkv


def act_dims(args: ModelArgs, layout: Layout, precision: str, accounting: str, micro_batch: int, seq_len: int,
             device: str = "cuda", frozen_base: bool = False, loss_pieces: int = 1) -> ActDims:
    """`frozen_base`: LoRA's base is stored in the compute dtype, so everything computes in it ("pure");
    `loss_pieces`: the chunked loss's, resolved (capabilities.loss_pieces)."""
    if not Precision(precision).low_precision:
        regime = "single"
    elif accounting == "classic" or layout.uses_fsdp or frozen_base:
        regime = "pure"
    else:
        regime = "autocast"
    t = layout.tp
    shape = attention_shape(args)
    lp = layout.uses_loss_parallel  # pipelines compute whole logits on the last stage
    return ActDims(micro_batch, seq_len // layout.cp, args.dim, shape.heads // t, shape.kv_heads // t, shape.qk_dim,
                   args.ffn_hidden // t, args.vocab_size // t if lp else args.vocab_size, t, layout.sp, regime,
                   layout.uses_fsdp and accounting != "classic", shape.kv_heads != shape.heads, lp, device == "cuda",
                   layout.cp, seq_len, "head_norm" in roles(args), loss_pieces, shape.v_dim, shape.out_dim,
                   shape.rope_dim, shape.latents, 3 if not shape.latents else 1 + len(shape.latents))


def _norm(d: ActDims) -> list[tuple[str, int]]:
    """RMSNorm's saved tensors (without the matmul input it feeds)."""
    n = d.N // d.seq_div
    return [("norm input (fp32)", n * d.C * FP32), ("rsqrt", n * FP32), ("x*rsqrt", n * d.C * d.R)]


def _matmul_inputs(d: ActDims, n_linears: int) -> int:
    """Bytes of the normed input saved by the `n_linears` projections reading it (whole sequence under sp)."""
    if d.regime == "autocast":
        return n_linears * d.N * d.C * 2  # each linear casts its own bf16 copy
    return d.N * d.C * d.L


def head_norms_saved(d: ActDims) -> list[tuple[str, int]]:
    """Per-head q and k norms (Qwen3): each saves its input in fp32 (the projection's output itself in fp32, else a
    copy), the rsqrt per head, and the normed heads in the projection's dtype (the gain's input)."""
    if not d.qk_norm:
        return []
    heads = d.N * (d.Hq + d.Hkv)
    return [("q/k norm inputs (fp32)", heads * d.D * FP32), ("q/k norm rsqrt", heads * FP32),
            ("q/k norm x*rsqrt", heads * d.D * d.L)]


def latents_saved(d: ActDims) -> list[tuple[str, int]]:
    """Low-rank latents (`AttentionShape.latents`, whole on every tp rank): each RMSNorm saves its input in fp32, the
    rsqrt and x*rsqrt, and the up-projection its input (its own bf16 copy under autocast). Not yet measured."""
    out = []
    for r in d.latents:
        up_input = d.N * r * (2 if d.regime == "autocast" else d.L)
        out += [(f"latent {r} norm input (fp32), rsqrt, x*rsqrt", d.N * r * FP32 + d.N * FP32 + d.N * r * d.L),
                (f"latent {r} up-projection input", up_input)]
    return out


def attention_saved(d: ActDims) -> list[tuple[str, int]]:
    N, L = d.N, d.L
    kv_heads = d.kv_heads_saved
    repeated = kv_heads != d.Hkv
    Dv, Do = d.Dv or d.D, d.Do or d.Dv or d.D
    out = _norm(d) + [("q/k/v input", _matmul_inputs(d, d.input_linears)), *head_norms_saved(d), *latents_saved(d),
                      ("q (rope)", N * d.Hq * d.D * L),
                      ("k (rope, repeated)" if repeated else "k (rope)", N * kv_heads * d.D * L),
                      ("v (repeated)" if repeated else "v", N * kv_heads * Dv * L),
                      ("attention output", N * d.Hq * Dv * L),
                      ("logsumexp", N * d.Hq * FP32)]
    if Do != Dv:  # the output projection's input: the kernel's output cut to the value width, a copy
        out.append(("output projection input", N * d.Hq * Do * L))
    if d.rope_copies:
        out.append(("rope tables (bf16, FSDP input cast)", d.rope_copies))
    if d.rope_gathered:
        out.append(("rope angles at this rank's positions", d.rope_gathered))
    return out


def dense_ffn_saved(d: ActDims) -> list[tuple[str, int]]:
    return _norm(d) + [("w1/w3 input", _matmul_inputs(d, 2)), ("SwiGLU (w1x, silu, w3x, product)", 4 * d.N * d.F * d.L)]


@dataclass(frozen=True)
class MoEDims:
    E: int
    k: int
    H: int  # expert hidden
    shared: int  # shared width (local, after tp)
    E_local: int
    routed: int  # assignments this rank's experts compute (expected, times the imbalance factor)


def moe_dims(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, imbalance: float) -> MoEDims:
    E, k = args.moe_experts, args.moe_top_k
    N = micro_batch * seq_len
    assignments = N * k
    if args.moe_capacity_factor > 0:
        cap = max(1, math.ceil(args.moe_capacity_factor * seq_len * k / E))
        assignments = min(assignments, micro_batch * cap * E)
        imbalance = min(imbalance, args.moe_capacity_factor)
    routed = int(math.ceil(assignments * max(imbalance, 1.0))) if layout.ep > 1 else assignments
    H = args.expert_hidden
    return MoEDims(E, k, H, H * args.moe_shared_experts // layout.tp, E // layout.ep, routed)


def moe_ffn_saved(d: ActDims, m: MoEDims) -> list[tuple[str, int]]:
    """paratrain/models/moe.py: every tp rank routes all of its tokens (whole sequences under sp).

    The router runs in fp32 (x.float(): a copy unless the normed input is already fp32), saves its softmax
    scores, the sorted values and sort indices (int64), and the top-k sum; tokens are gathered per expert
    (int64 indices), the experts are SwiGLUs over the routed rows (grouped matmul), outputs are gathered back and
    weighted by the gates. Autocast does not cover `torch._grouped_mm`: on CPU the experts then run in fp32; on
    CUDA (bf16 only) the per-expert matmul fallback is autocast, which saves bf16 copies of each expert's rows
    and weights (not cached: `w[e]` is not a leaf).
    """
    N = d.N
    casts = []
    if d.regime == "autocast" and d.cuda:
        Le, routed = 2, 0
        casts = [("expert inputs (bf16 copies)", 2 * m.routed * d.C * 2),
                 ("expert weights (bf16 copies per forward)", 3 * m.E_local * d.C * m.H * 2)]
    else:
        Le = 2 if d.regime == "pure" else 4  # grouped matmul in the inputs' dtype
        routed = m.routed * d.C * Le
    out = _norm(d) + [("router input (fp32)", N * d.C * FP32),
                      ("router scores, sorted values, top-k sum (fp32)", 2 * N * m.E * FP32 + N * FP32),
                      ("sort indices (int64)", N * m.E * INT64),
                      ("gather/scatter indices (int64)", 2 * N * m.k * INT64),
                      ("routed tokens", routed), *casts,
                      ("experts SwiGLU (w1x, silu, w3x, product)", 4 * m.routed * m.H * Le),
                      ("expert outputs + gates", N * m.k * (d.C * Le + FP32))]
    if d.regime == "pure":
        out.append(("router weight (fp32 copy)", m.E * d.C * FP32))
    if m.shared:
        out += [("shared expert input", 0 if d.regime == "single" else _matmul_inputs(d, 2)),
                ("shared SwiGLU", 4 * N * m.shared * d.L)]
    return out


def _experts_use_mm(d: ActDims) -> bool:
    """Whether the experts' matmuls reach the dispatcher as `aten.mm` (saved by selective checkpointing): the CUDA
    autocast fallback loop, and CPU, where `torch._grouped_mm` runs one mm per expert; on CUDA bf16 it is one
    grouped kernel, which `_SAVE_OPS` does not list."""
    return d.regime == "autocast" or not d.cuda


@functools.lru_cache(maxsize=8192)
def block_saved(d: ActDims, moe: MoEDims | None = None) -> list[tuple[str, int]]:
    """All tensors one block saves with no checkpointing."""
    return attention_saved(d) + (moe_ffn_saved(d, moe) if moe else dense_ffn_saved(d))


def block_input(d: ActDims) -> int:
    """The block's input, kept by activation checkpointing (and the final residual, kept by the head)."""
    return d.N // d.seq_div * d.C * d.R


def sac_saved(d: ActDims, moe: MoEDims | None = None) -> list[tuple[str, int]]:
    """Selective checkpointing (parallelize._SAVE_OPS): matmul and attention outputs, plus the block input."""
    N, L = d.N, d.L
    out = [("block input", block_input(d)), ("wq output", N * d.Hq * d.D * L), ("wk, wv outputs", 2 * N * d.Hkv * d.D * L),
           ("attention output + logsumexp", N * d.Hq * d.D * L + N * d.Hq * FP32),
           ("wo output (partial sum)", N * d.C * L)]
    if moe:
        out.append(("router logits (fp32)", N * moe.E * FP32))
        if _experts_use_mm(d):  # torch._grouped_mm is not in _SAVE_OPS; the per-expert matmul fallback is
            out += [("experts w1, w3 outputs", 2 * moe.routed * moe.H * L), ("experts w2 output", moe.routed * d.C * L)]
        if moe.shared:
            out += [("shared w1, w3 outputs", 2 * N * moe.shared * L), ("shared w2 output", N * d.C * L)]
    else:
        out += [("w1, w3 outputs", 2 * N * d.F * L), ("w2 output (partial sum)", N * d.C * L)]
    if d.rope_tables:
        out.append(("rope tables (bf16, FSDP input cast)", d.rope_tables))
    return out


@functools.lru_cache(maxsize=8192)
def offloaded(d: ActDims, mode: str, moe: MoEDims | None = None) -> int:
    """Bytes of what a block stores (`block_stored`) that activation offloading moves to host memory
    (distributed/offload.py): every saved tensor of at least MIN_OFFLOAD_BYTES; under selective checkpointing only
    the checkpoint's inputs (its cache of matmul outputs is not saved tensors and stays)."""
    if mode.selective:
        return block_input(d) + d.rope_tables
    if mode.every_block_whole:
        return block_stored(d, mode, moe)
    return sum(b for _, b in block_saved(d, moe) if b >= MIN_OFFLOAD_BYTES)


@functools.lru_cache(maxsize=8192)
def block_stored(d: ActDims, mode: str, moe: MoEDims | None = None) -> int:
    """Bytes a block keeps from its forward to its backward under checkpointing `mode` (segments: the first block of a
    segment; the others keep nothing, `stored_by_block`)."""
    if not mode.recomputes:
        return sum(b for _, b in block_saved(d, moe))
    if mode.whole_blocks:
        return block_input(d) + d.rope_tables
    if mode.selective:
        return sum(b for _, b in sac_saved(d, moe))
    raise ValueError(mode)


def stored_by_block(d: ActDims, modes: list[str], stages: list[list[int]], moe_of: dict,
                    present: tuple = ()) -> dict[int, int]:
    """Bytes each block of these stages (lists of block indices) keeps from its forward to its backward: its mode's
    `block_stored`, except inside a checkpoint of several blocks (`present`, the run's capabilities: a checkpointing
    mode's `checkpoint_units`, segments), where only the first block keeps anything (the unit's input)."""
    out = {}
    stored = {}  # (mode, MoEDims' id) -> block_stored: once per call, not per block (the cache's key hashes d)
    for blocks in stages:
        for unit in capabilities.checkpoint_units(present, blocks, len(modes)):
            first = unit[0]
            moe = moe_of.get(first)
            key = (modes[first], id(moe))
            kept = stored.get(key)
            if kept is None:
                kept = stored[key] = block_stored(d, modes[first], moe)
            out[first] = kept
            out.update(dict.fromkeys(unit[1:], 0))
    return out


@functools.lru_cache(maxsize=8192)
def segment_recomputed(d: ActDims, first: bool, moe: MoEDims | None = None) -> int:
    """Bytes a block of a segment holds from the segment's recomputation to its own backward, beyond the checkpoint's
    inputs: what it saves without checkpointing, less what it shares with them (the first block's fp32 norm input is
    the segment input outside "pure"; every block's rope views are of the checkpoint's cast tables)."""
    saved = sum(b for _, b in block_saved(d, moe))
    if first:
        return saved + (block_input(d) if d.regime == "pure" else 0) - block_input(d) - d.rope_tables
    return saved - d.rope_copies


def _swiglu_backward(d: ActDims, moe: MoEDims | None) -> tuple[int, int]:
    """(two live gradients of the SwiGLU's width, its product) for the first SwiGLU a block's backward meets: the
    dense MLP, or in an MoE layer the shared expert (computed last), else the routed experts."""
    if moe is None:
        width = d.N * d.F * d.L
    elif moe.shared:
        width = d.N * moe.shared * d.L
    else:
        width = moe.routed * moe.H * d.L
    return 2 * width, width


@functools.lru_cache(maxsize=8192)
def block_backward_live(d: ActDims, mode: str, moe: MoEDims | None = None, first: bool = True) -> tuple[int, int]:
    """(activations, temporaries) of one block at the peak of its own backward, beyond the other blocks' bytes.

    At the start of the SwiGLU backward everything the block saved (recomputed, when checkpointed) is live,
    plus the incoming gradient (N C R/sp), and w2's backward and the product's backward leave two N F L
    gradients alive at once. A checkpointed block's recomputation counts as temporaries, except what the
    checkpoint itself still holds: its input, and with selective checkpointing the cached attention and w1/w3
    outputs the recomputed graph reuses, and the w2 output, which stays in the cache because recomputation
    stops early, before the last matmul would read it. In "pure" precision the recomputed norm makes a new
    fp32 copy of the stored bf16 input. Under segments the first block of a segment is as under "full"; the others
    (`first` False) hold only their recomputed tensors (the segment's input is its first block's).
    """
    saved = sum(b for _, b in block_saved(d, moe))
    width, product = _swiglu_backward(d, moe)
    grads = width + block_input(d)  # the incoming gradient has the block input's size and dtype
    if not mode.recomputes:
        return saved - product, grads + product  # the product (w2's saved input) is freed by w2's backward
    if not first:  # (a later block of a segment)
        return 0, segment_recomputed(d, False, moe) + grads
    pure_extra = block_input(d) if d.regime == "pure" else 0
    if mode.whole_blocks:
        kept = block_input(d) + d.rope_tables
        return kept, saved + grads + pure_extra - kept
    N, L = d.N, d.L
    if moe:
        mm = _experts_use_mm(d)
        leftover = N * d.C * L if moe.shared else (moe.routed * d.C * L if mm else 0)  # the block's last matmul
        reused = (2 * moe.routed * moe.H * L if mm else 0) + (2 * N * moe.shared * L if moe.shared else 0)
    else:
        leftover = N * d.C * L
        reused = 2 * N * d.F * L
    kept = (block_input(d) + N * d.Hq * d.D * L + N * d.Hq * FP32 + reused + leftover + d.rope_tables
            + (0 if d.gqa else N * d.Hkv * d.D * L))
    return kept, saved + grads + leftover + pure_extra - kept


@functools.lru_cache(maxsize=8192)
def recompute_end(d: ActDims, mode: str, moe: MoEDims | None = None, first: bool = True) -> tuple[int, int]:
    """(activations, temporaries) of a checkpointed block when its recomputation stops, before the SwiGLU backward:
    the recomputed forward's frame still holds the last norm's output (and under sequence parallelism its
    all-gathered copy, which autocast does not save), and the incoming gradient is live (all-gathered too under
    sequence parallelism, by the backward of the w2 reduce-scatter). Under segments: the segment's last block (`first`:
    whether it is also its first), the other blocks' recomputed tensors apart."""
    acts, temps = block_backward_live(d, mode, moe, first)
    temps -= _swiglu_backward(d, moe)[0]
    normed = 0 if (not d.sp and d.regime != "autocast") else d.N // d.seq_div * d.C * (2 if d.regime == "pure" else 4)
    gathered = d.N * d.C * FP32 if (d.sp and d.regime == "autocast") else 0
    grad_gathered = d.N * d.C * d.L if d.sp else 0
    return acts, temps + normed + gathered + grad_gathered


def ring_backward_block(d: ActDims, mode: str) -> int:
    """Bytes of a block's tensors alive when its ring attention's backward runs (its MLP's are freed by then): the
    attention's saved tensors (recomputed under checkpointing: then the checkpoint also holds the block input, in
    "pure" precision beside the fp32 copy its norm makes, and the cast rotary tables). Selective checkpointing's
    cache has handed out its entries by then, except v, the attention output and logsumexp (saved by the ring's
    backward, counted with the attention) and the w2 output, which the early-stopping recomputation never read."""
    attn = sum(b for _, b in attention_saved(d))
    if not mode.recomputes:
        return attn
    extra_input = block_input(d) if d.regime == "pure" else 0  # in fp32 the norm's input is the block input
    leftover = d.N * d.C * d.L if mode.selective else 0
    return attn + extra_input + d.rope_tables + leftover


def ring_backward_temps(d: ActDims) -> int:
    """Transient bytes of ring attention's backward (distributed/context_parallel.ring_backward) at its peak, in a
    step after the first: the fp32 dQ accumulator; two K/V buffers (the block in hand and the next one arriving, or at
    the last step the previous one, still held by its send); the late chunk's copies of dout, q, out (L) and lse;
    three fp32 dK/dV buffers (this block's, the previous block's still being sent, the accumulator received); and one
    block's kernel backward: GQA's repeated K/V inputs, its outputs (L) with their fp32 copies (L = 2 B; under GQA
    dk's copy is folded and freed before dv's is made) and the dK/dV folded back onto the KV heads. The worst step type counts: rank 0's (the late half of the queries against
    a whole K/V block) or the last rank's (all queries against half a block)."""
    N, L, D = d.N, d.L, d.D
    q_elems, kv_elems = N * d.Hq * D, 2 * N * d.Hkv * D
    gqa = d.Hq != d.Hkv

    def kernel(nq: int, nk: int) -> int:  # one block's backward: nq queries, nk keys (tokens)
        repeated = 2 * nk * d.Hq * D * L if gqa else 0
        outputs = (nq + 2 * nk) * d.Hq * D
        if L == FP32:
            copies = 0
        else:  # GQA folds dk's fp32 copy before dv's is made
            copies = (nq + (nk if gqa else 2 * nk)) * d.Hq * D * FP32
        folded = 2 * nk * d.Hkv * D * FP32 if gqa else 0
        return repeated + outputs * L + copies + folded

    common = q_elems * FP32 + 2 * kv_elems * L + 3 * (q_elems // 2) * L + (N // 2) * d.Hq * FP32
    later = common + 3 * kv_elems * FP32 + max(kernel(N // 2, N), kernel(N, N // 2))
    first = common + kv_elems * FP32 + kernel(N, N)
    return max(later, first)


def head_saved(d: ActDims) -> list[tuple[str, int]]:
    """Final norm, output projection and loss, saved at the end of forward (one micro-batch). A chunked loss keeps
    only the normed hidden states (its checkpointed pieces' input: the norm's output itself, fp32 under autocast);
    backward recomputes each piece's logits."""
    n = d.N // d.seq_div
    out = []
    if d.regime == "pure":
        out.append(("final norm input (fp32 copy)", n * d.C * FP32))
    out += [("final norm rsqrt", n * FP32), ("final norm x*rsqrt", n * d.C * d.R)]
    if d.chunks > 1:
        return out + [("normed hidden states (chunked loss input)", d.N * d.C * (FP32 if d.regime == "autocast"
                                                                                 else d.L))]
    return out + [("output input (normed, whole sequence)", d.N * d.C * d.L),
                  ("log_softmax output (fp32)", d.N * d.V * FP32)]


def final_residual(d: ActDims) -> int:
    """The last block's output, kept by the final norm in fp32/autocast (in "pure" the norm keeps its fp32 copy,
    counted in head_saved)."""
    return 0 if d.regime == "pure" else d.N // d.seq_div * d.C * FP32


# The final norm's backward, in units of its N/sp x C fp32 values: the incoming gradient times the gain, times rsqrt,
# the mean's and the square's gradients (measured: bench/memory_accuracy.py, the chunked-loss rows, where it is the
# peak once the logits are small).
FINAL_NORM_BACKWARD_VALUES = 5


def final_norm_backward(d: ActDims) -> int:
    """Transient bytes of the final norm's backward (its fp32 arithmetic; in "pure" precision beside the fp32 copy of
    its bf16 input, which it saved)."""
    n = d.N // d.seq_div * d.C * FP32
    return FINAL_NORM_BACKWARD_VALUES * n + (n if d.regime == "pure" else 0)


def loss_backward_extra(d: ActDims, head_grad: int = 0) -> int:
    """Transient bytes at the loss's backward: cross_entropy's gradient and log_softmax's gradient, both fp32
    N x V (torch's loss_parallel needs one more such buffer and a few bytes per token).

    Chunked (`d.chunks` pieces of n tokens, models/llama.chunked_cross_entropy): one piece at a time, its recomputed
    log_softmax beside those two gradients (n x V each), while the pieces done so far hold their input gradients
    (n x C each; fp32 under autocast, whose pieces read the fp32 norm output) and the output weight's gradient summed so
    far (`head_grad` bytes: autograd adds each piece's out of
    place, so at the last piece the old sum, the piece's and the new sum are live at once)."""
    extra = LOSS_PARALLEL_BYTES_PER_TOKEN if d.loss_parallel else 0
    if d.chunks <= 1:
        return (3 if d.loss_parallel else 2) * d.N * d.V * FP32 + extra * d.N
    n = -(-d.N // d.chunks)
    logits = (4 if d.loss_parallel else 3) * n * d.V * FP32 + extra * n
    autocast = d.regime == "autocast"  # the pieces' input is the fp32 normed output; the head casts its own copy
    done = (d.N - n) * d.C * (FP32 if autocast else d.L)  # the other pieces' input gradients
    cast = n * d.C * 2 if autocast else 0
    return max(logits + cast + head_grad + done, 3 * head_grad + done)


def inputs_bytes(d: ActDims) -> int:
    """Token ids and targets (int64)."""
    return 2 * d.N * INT64
