"""A Llama-style decoder as a plain nn.Module.

It knows nothing about parallelism: head counts are read from tensor shapes
(`view(B, T, -1, head_dim)`), so tensor-parallel sharding of the projections
just works, and the blocks live in a ModuleDict keyed by layer index so a
pipeline stage can drop the blocks it does not own without renaming the rest.
With `moe_experts > 0` the blocks from `moe_first_dense_layers` on (but `moe_dense_layers`) use the
mixture-of-experts feed-forward (models/moe.py) in place of the dense SwiGLU.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.data.batch import NOT_A_TARGET
from paratrain.models.args import ModelArgs
from paratrain.models.lora_params import adapter_init_std, is_adapter
from paratrain.models.moe import MoE, moe_modules, moe_options


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy in fp32: logits (..., V) against targets (...); targets NOT_A_TARGET count nothing (the
    mean is over the others)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction,
                           ignore_index=NOT_A_TARGET)


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits, targets, "sum")


def _piece_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, piece_loss) -> torch.Tensor:
    return piece_loss(head(hidden), targets)


def chunked_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int = 1,
                          reduction: str = "mean", piece_loss=summed_cross_entropy) -> torch.Tensor:
    """Cross-entropy of `head(hidden)` (B, T, C) -> (B, T, V) against targets (B, T), over `chunks` pieces of the
    B x T tokens: each piece's logits are made, reduced to the piece's summed loss and dropped, and backward recomputes
    them piece by piece (activation checkpointing), so the logits of the whole batch never exist at once; the price is
    the head's forward once more in backward. The mean is the sum over pieces / tokens: the same loss up to the order
    of the fp32 additions. reduction="sum": the summed loss (a loss mask's, divided by the caller);
    reduction="none": the per-token losses, flat (evaluation, without gradients). `piece_loss(logits, targets)`: a
    piece's summed loss (the trainer's adds the capabilities' loss terms to the cross-entropy)."""
    if chunks <= 1:
        return cross_entropy(head(hidden), targets, reduction)
    pieces = zip(hidden.flatten(0, 1).tensor_split(chunks), targets.flatten().tensor_split(chunks))
    if reduction == "none":
        return torch.cat([cross_entropy(head(h), y, "none") for h, y in pieces])
    total = None
    for h, y in pieces:
        piece = checkpoint(_piece_loss, head, h, y, piece_loss, use_reentrant=False)
        total = piece if total is None else total + piece
    # "mean" is asked for batches without a loss mask only (every target counts): a host integer keeps the loss
    # parallel DTensor's division plain
    return total if reduction == "sum" else total / targets.numel()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision otherwise.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1's rotary frequency scaling (Meta's `apply_scaling`, Hugging Face's rope_type "llama3"):
    wavelengths longer than original_max_seq_len / low_freq_factor are stretched by `factor`, shorter than
    original_max_seq_len / high_freq_factor kept, and the band between interpolated smoothly."""
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None,
                args: ModelArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim // 2), in fp32; `args` supplies rotary scaling."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if args is not None and args.rope_scaling == "llama3":
        inv_freq = llama3_scaled(inv_freq, args.rope_scaling_factor, args.rope_low_freq_factor,
                                 args.rope_high_freq_factor, args.rope_original_max_seq_len)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x (B, T, H, D) by the position angle of frequency i.

    The "split halves" layout of Hugging Face's Llama (`rotate_half`), so q/k projections map to and from
    transformers by name, without permuting rows. (Meta's reference code rotates interleaved pairs
    (x[2i], x[2i+1]); its checkpoints differ from these by a fixed permutation of the q and k rows.)
    """
    xf = x.float()
    half = xf.shape[-1] // 2
    if cos.dim() == 4:  # whole-width tables (B or 1, T, 1, D) (`whole_width_tables`): generation's, see there
        return (xf * cos + xf.roll(half, dims=-1) * sin).type_as(x)
    x1, x2 = xf[..., :half], xf[..., half:]
    # (T, D/2) tables -> (1, T, 1, D/2); per-token angles of packed documents (B, T, D/2) -> (B, T, 1, D/2)
    cos, sin = (t.unsqueeze(-2) if t.dim() == 3 else t[None, :, None, :] for t in (cos, sin))
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


def whole_width_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope's (..., D/2) tables as whole-width ones, (..., D) each: (cos, cos) and (-sin, sin). With them (as
    (B or 1, T, 1, D)) apply_rope computes x cos + (x2, x1) (-sin, sin), bitwise its (x1 cos - x2 sin, x2 cos + x1 sin)
    (negation is exact, a + (-b) is a - b), in 4 ops instead of ~20 (slices, broadcasting views, cat): what a
    generated token pays per attention (paratrain/generate.py `KVCache.angles`)."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class WholeSequence:
    """What an `Attention` holds of each sequence, and how it attends over it: here all of it, positions 0..T-1,
    causal fused attention. This is the model's seam for context parallelism (like MoE's `dispatcher`):
    paratrain/distributed/context_parallel.py swaps in an object holding a slice of every sequence, which gives
    that slice's global positions and runs ring attention over the other slices."""

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary angles of this process's `length` tokens from the full (max_seq_len, D/2) tables."""
        return cos[:length], sin[:length]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, Hq, T, D) over k, v (B, Hkv, T, D) -> (B, Hq, T, D)."""
        return F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), is_causal=True)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each KV head serves Hq/Hkv query heads."""
    if k.shape[1] == q.shape[1]:
        return k, v
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


WHOLE_SEQUENCE = WholeSequence()


class Documents:
    """Windows packed with whole documents (`positions` (B, T): each token's position in its document, 0 where one
    starts): a token attends to the earlier tokens of its own document only, through an explicit block-diagonal
    causal mask (B, 1, T, T) built once per forward and shared by every block."""

    def __init__(self, positions: torch.Tensor):
        document = torch.cumsum(positions == 0, dim=1)  # (B, T): which document of its window a token is in
        self.document = document
        T = positions.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
        self.mask = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), attn_mask=self.mask)


def attend(attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None,
           cache) -> torch.Tensor:
    """An attention's q (B, Hq, T, D) over k, v (B, Hkv, T, D): through its sequence seam, packed documents' mask, or
    generation's cache (which keeps this attention's keys and values)."""
    if cache is not None:
        return cache.attend(attention, q, k, v)
    return (attention.sequence if documents is None else documents).attend(q, k, v)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings; `qkv_bias`/`o_bias` put biases on the q/k/v and o projections
    (a family's choice: Qwen2's q/k/v, Qwen3's attention_bias all four)."""

    def __init__(self, args: ModelArgs, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=o_bias)
        self.sequence = WHOLE_SEQUENCE  # seam: positions and attention over the sequence (see WholeSequence)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, Hq, D), k and v (B, T, Hkv, D) before rotary; Hq and Hkv are local under TP (a subclass may
        transform the heads here: models/qwen.py normalises q and k)."""
        B, T, _ = x.shape
        return tuple(w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None, cache=None) -> torch.Tensor:
        """`documents`: packed windows (cos and sin are then each token's own angles, (B, T, D/2)). `cache`:
        generation's KV cache (paratrain/generate.py `KVCache`): cos and sin are then the new tokens' angles, and
        they attend over the cached keys and values too."""
        B, T, _ = x.shape
        q, k, v = self.heads(x)
        if documents is None and cache is None:
            cos, sin = self.sequence.rope(cos, sin, T)  # the angles of these tokens' positions
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = attend(self, q, k, v, documents, cache)  # (B, Hq, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_block(args: ModelArgs) -> MoE:
    # n shared experts of width h are one SwiGLU of width n * h (the sum of their outputs).
    shared = FeedForward(args.dim, args.expert_hidden * args.moe_shared_experts) if args.moe_shared_experts else None
    return MoE(args.dim, args.moe_experts, args.moe_top_k, args.expert_hidden, shared=shared, **moe_options(args))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0, attention=Attention):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture of experts in place of the dense MLP in the layers `args.is_moe_layer` names.
        self.feed_forward = moe_block(args) if args.is_moe_layer(index) else FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None, cache=None) -> torch.Tensor:
        # `documents` and `cache` by keyword: tensor parallelism prepares the attention's positional inputs (x, cos,
        # sin) only
        extra = {} if cache is None else {"cache": cache}
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents, **extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    # The blocks' attention: called with the model's args (a family's module sets its own: models/qwen.py).
    attention_class = Attention

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i, self.attention_class)
                                     for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The side heads (models/family.SideHead) `build_model` attaches after the head (`attach_side_head`): name ->
        # their module's class, which makes their inputs beside the embedding on any pipeline stage (`side_inputs`)
        self.side_heads: dict[str, type] = {}
        self.side_losses: dict[str, list] = {}  # the last training forward's, by side head (`side_targets`)
        # Rotary tables are derived, not learned: non-persistent, rebuilt by reset_buffers().
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args=args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def attach_side_head(self, name: str, module: nn.Module) -> None:
        """`module` (a SideHead's) becomes the model's attribute `name`, after the head in the parameters' order. Its
        class gives `carried(args)`, the widths of `dim` it reads beside the hidden states, and `carry(args, embedding,
        tokens)` -> (B, T, carried x C), made where the embedding is; its forward takes (the last block's output,
        those inputs, the targets, the output head, cos, sin, documents, the loss's pieces) and returns its loss terms,
        (summed loss, target count) each, averaged by the trainer."""
        setattr(self, name, module)
        self.side_heads[name] = type(module)

    def side_inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the hidden states, {side head: its inputs (B, T, k C)}): made from the embedding, or on a later pipeline
        stage split off the hidden states, where the first stage sent them as more channels."""
        if self.tok_embeddings is not None:
            return h, {name: cls.carry(self.args, self.tok_embeddings, tokens) for name, cls in self.side_heads.items()}
        widths = [cls.carried(self.args) * self.args.dim for cls in self.side_heads.values()]
        h, *parts = h.split([self.args.dim, *widths], dim=-1)
        return h, dict(zip(self.side_heads, parts))

    def extra_blocks(self) -> dict[str, tuple[int, nn.Module]]:
        """Blocks outside `layers` (the side heads' that this model or stage holds), laid out like the model's:
        {their parameters' prefix: (the block index of their kind, the block)}."""
        out = {}
        for name in self.side_heads:
            side = getattr(self, name)
            out.update(side.extra_blocks(f"{name}.") if side is not None else {})
        return out

    def _apply(self, fn, recurse=True):
        # Moving or materialising (to, to_empty) replaces each module's Parameter separately; re-tie after.
        module = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return module

    def reset_buffers(self) -> None:
        """Recompute the rotary tables on the current device (after materialising from meta)."""
        a = self.args
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device=self.rope_cos.device, args=a)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for moe in moe_modules(self):  # their learned buffers' starting values
            moe.reset_buffers()

    def param_init_std(self, name: str) -> float | None:
        """Std of the normal init for a parameter by name; None means 'ones' (norm gains).

        GPT-2 style: 0.02 everywhere, residual projections scaled by 1/sqrt(2 * n_layers)
        so the residual stream's variance does not grow with depth.
        """
        if is_adapter(name):
            return adapter_init_std(name)
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def forward(self, tokens: torch.Tensor, seq_len: int | None = None, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, loss_chunks: int = 1, reduction: str = "mean",
                piece_loss=summed_cross_entropy, side_targets: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab); with `targets` (B, T) the cross-entropy loss instead, its
        output projection and loss computed over `loss_chunks` pieces of the tokens (`chunked_cross_entropy`, each
        piece's summed loss by `piece_loss`).

        A pipeline stage is this model with pieces removed (set to None): without `tok_embeddings` the input
        is already the hidden states, without `output` the hidden states are returned. `seq_len` is the length of
        the sequences the input belongs to, when the input holds only part of each (default: its own length).
        `positions` (B, T): windows packed with whole documents, each token's position in its document (rotary
        angles restart and attention stays inside each document; see `Documents`). `cache`: generation's KV cache
        (paratrain/generate.py `KVCache`): the tokens follow those it holds (their positions, and attention over its
        keys too), and each attention adds its keys to it. `side_targets` (B, T): the targets of a training forward,
        for the side heads (`attach_side_head`), which then run and leave their loss terms in `side_losses`; without
        it (evaluation, generation) they do not run. Under a pipeline every stage gets it: the first sends the side
        heads' inputs beside its output."""
        T = seq_len or tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, C)
        carried = {}
        if side_targets is not None and self.side_heads:
            h, carried = self.side_inputs(tokens, h)
        documents = None
        if cache is not None:  # the angles of the positions after the cached tokens
            cos, sin = cache.angles(self.rope_cos, self.rope_sin, T)
        elif positions is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D/2): rotary angles of positions 0..T-1
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, D/2): each token's own
            documents = Documents(positions)
        extra = {} if cache is None else {"cache": cache}
        for layer in self.layers.values():
            h = layer(h, cos, sin, **extra) if documents is None else layer(h, cos, sin, documents=documents)
        if self.output is None:  # to the next stage: (B, T, C), or with the side heads' inputs (B, T, (1 + k) C)
            return torch.cat([h, *carried.values()], dim=-1) if carried else h
        for name, inputs in carried.items():  # from the last block's output, before the final norm
            self.side_losses[name] = getattr(self, name)(h, inputs, side_targets, self.output, cos, sin, documents,
                                                         loss_chunks)
        if targets is not None:
            return chunked_cross_entropy(self.norm(h), targets, self.output, loss_chunks, reduction, piece_loss)
        if cache is not None and cache.last_only:  # generation reads the last position's logits alone
            h = h[:, -1:]  # (B, 1, C)
        return self.output(self.norm(h))  # (B, T, V)
