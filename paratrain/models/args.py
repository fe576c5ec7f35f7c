"""Model dimensions: a torch-free frozen dataclass, so the layout, estimator and planner can reason about a model
without importing torch or building it. It is hashable: derived tables (the family's parameter table, block costs)
are cached on it with `functools.cache`. `config.ModelConfig` is derived from its fields (`[model]` overrides)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

RopeScaling = Literal["none", "llama3"]
ScoreFunc = Literal["softmax", "sigmoid"]  # MoE router scores
ROPE_SCALINGS = get_args(RopeScaling)
SCORE_FUNCS = get_args(ScoreFunc)
DEFAULT_FAMILY = "llama"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None  # None: dim // n_heads (resolved on construction)
    # Rotary scaling for long context: "none", or "llama3" (Llama 3.1/3.2: low frequencies divided by
    # `rope_scaling_factor`, high ones kept, a smooth blend between; Hugging Face's rope_type "llama3").
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # Mixture of experts (0 experts = dense everywhere). The MoE block replaces the dense MLP in
    # every layer from `moe_first_dense_layers` on; `moe_ffn_hidden` is each expert's hidden size.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_ffn_hidden: int | None = None
    moe_first_dense_layers: int = 0
    moe_score_func: ScoreFunc = "softmax"
    moe_aux_loss_coef: float = 0.01
    moe_capacity_factor: float = 0.0  # 0: no capacity limit (no token dropping)
    # The model family (`paratrain.models.family`): which module is built and which parameter table, TP plan and
    # Hugging Face names describe it. The fields above are its dimensions.
    family: str = DEFAULT_FAMILY

    def __post_init__(self):
        # Resolved once so that saved dimensions (trainer.pt) carry it; dataclasses.replace(dim=...) keeps the
        # resolved value, pass head_dim=None with it to derive it again.
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_experts > 0 and index >= self.moe_first_dense_layers
