"""The Qwen families' modules (tables and names: models/qwen_params.py): Llama's decoder (models/llama.py) with
another attention. Nothing here knows about parallelism: tensor parallelism splits q and k by heads and the q/k norms
act on each head alone, so they need nothing of it (their role "head_norm" tells distributed/tensor_parallel.py)."""

from __future__ import annotations

from functools import partial

import torch

from paratrain.models.args import ModelArgs
from paratrain.models.llama import Attention, RMSNorm, Transformer


class QKNormAttention(Attention):
    """Qwen3's attention: an RMSNorm over each head of q and of k (one head_dim gain each, eps norm_eps) before
    rotary; `bias` is Qwen3's attention_bias (biases on q, k, v and o)."""

    def __init__(self, args: ModelArgs, bias: bool = False):
        super().__init__(args, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen2(Transformer):
    attention_class = partial(Attention, qkv_bias=True)


class Qwen3(Transformer):
    attention_class = QKNormAttention


class Qwen3Bias(Transformer):
    attention_class = partial(QKNormAttention, bias=True)
