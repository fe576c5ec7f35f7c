"""The DeepSeek family's module (table, names and shape: models/deepseek_params.py): Llama's decoder (models/llama.py,
with models/moe.py's mixture of experts) with multi-head latent attention, computed as transformers'
DeepseekV3Attention does. Nothing here knows about parallelism: the heads are read from tensor shapes, so tensor
parallelism splits q_b/kv_b by heads (their roles tell distributed/tensor_parallel.py), and attention goes through
the `sequence` seam of llama.Attention (context parallelism's ring attention)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.args import ModelArgs
from paratrain.models.llama import WHOLE_SEQUENCE, Attention, Documents, RMSNorm, Transformer, apply_rope, attend

# The latents' RMSNorm epsilon: transformers' and DeepSeek's reference code leave it at its default, whatever
# rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over interleaved pairs (x[2i], x[2i+1]) of x (B, T, H, D), DeepSeek's layout (transformers'
    rope_interleave=True), laid out after as (evens, odds): apply_rope's split halves of the de-interleaved x."""
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2/V3). An `Attention` for its `sequence` seam (context parallelism
    finds attentions by that class); its projections are its own, named as transformers names them."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not Attention's projections
        C, H = args.dim, args.n_heads
        self.nope, self.rope, self.v_dim = args.mla_qk_nope_head_dim, args.mla_qk_rope_head_dim, args.mla_v_head_dim
        self.qk_dim, self.kv_rank = self.nope + self.rope, args.mla_kv_lora_rank
        if args.mla_q_lora_rank:
            self.q_a_proj = nn.Linear(C, args.mla_q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.mla_q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.mla_q_lora_rank, H * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(C, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, C, bias=False)
        self.sequence = WHOLE_SEQUENCE

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_rope = self.query(x).view(B, T, -1, self.qk_dim).split([self.nope, self.rope], -1)  # (B, T, H, *)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], -1)  # (B, T, r), (B, T, rope)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)  # (B, T, H, nope), (B, T, H, v)
        if documents is None and cache is None:
            cos, sin = self.sequence.rope(cos, sin, T)
        q = torch.cat((q_nope, rope_interleaved(q_rope, cos, sin)), -1)  # (B, T, H, qk)
        k_rope = rope_interleaved(k_rope[:, :, None], cos, sin).expand(-1, -1, q.shape[2], -1)  # one for all heads
        k = torch.cat((k_nope, k_rope), -1)
        # v padded with zeros to the q/k width: the fused kernels (flash, the ring's K/V buffer) take one head width;
        # the padded columns of the output are zeros, cut off below. The scale is 1/sqrt(qk) (SDPA's default).
        v = F.pad(v, (0, self.qk_dim - self.v_dim))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, qk)
        y = attend(self, q, k, v, documents, cache)[..., :self.v_dim]  # (B, H, T, v); a cache keeps k, v expanded
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class DeepSeek(Transformer):
    attention_class = LatentAttention

    def param_init_std(self, name: str) -> float | None:
        if name.endswith("o_proj.weight"):  # the attention's residual projection, as Llama's wo
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return super().param_init_std(name)
