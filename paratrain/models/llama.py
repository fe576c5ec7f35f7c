"""A Llama-style decoder as a plain nn.Module.

It knows nothing about parallelism: head counts are read from tensor shapes
(`view(B, T, -1, head_dim)`), so tensor-parallel sharding of the projections
just works, and the blocks live in a ModuleDict keyed by layer index so a
pipeline stage can drop the blocks it does not own without renaming the rest.
With `moe_experts > 0` the blocks from `moe_first_dense_layers` on use the mixture-of-experts
feed-forward (models/moe.py) in place of the dense SwiGLU.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.args import ModelArgs
from paratrain.models.moe import MoE


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


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim // 2), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, H, D) by the position angle (Llama's interleaved layout)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, Hq, D); Hq is local under TP
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])  # positions 0..T-1
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if k.shape[1] != q.shape[1]:
            # Grouped-query attention: each KV head serves Hq/Hkv query heads.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hq, T, D)
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
    return MoE(args.dim, args.moe_experts, args.moe_top_k, args.expert_hidden, shared=shared,
               score_func=args.moe_score_func, aux_loss_coef=args.moe_aux_loss_coef,
               capacity_factor=args.moe_capacity_factor)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture of experts in place of the dense MLP from layer `moe_first_dense_layers` on.
        self.feed_forward = moe_block(args) if args.is_moe_layer(index) else FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived, not learned: non-persistent, rebuilt by reset_buffers().
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # Moving or materialising (to, to_empty) replaces each module's Parameter separately; re-tie after.
        module = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return module

    def reset_buffers(self) -> None:
        """Recompute the rotary tables on the current device (after materialising from meta)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def param_init_std(self, name: str) -> float | None:
        """Std of the normal init for a parameter by name; None means 'ones' (norm gains).

        GPT-2 style: 0.02 everywhere, residual projections scaled by 1/sqrt(2 * n_layers)
        so the residual stream's variance does not grow with depth.
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab).

        A pipeline stage is this model with pieces removed (set to None): without `tok_embeddings` the input
        is already the hidden states, without `output` the hidden states are returned. Each attention takes
        the rotary angles of its own sequence length from the full tables."""
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.args.max_seq_len:
                raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len {self.args.max_seq_len}")
            h = self.tok_embeddings(tokens)  # (B, T, C)
        else:
            h = tokens  # (B, T, C) from the previous stage
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h  # (B, T, C) to the next stage
        return self.output(self.norm(h))  # (B, T, V)
