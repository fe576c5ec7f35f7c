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
    # Mixture of experts (0 experts = dense everywhere). The MoE block replaces the dense MLP in every layer from
    # `moe_first_dense_layers` on but `moe_dense_layers`; `moe_ffn_hidden` is each expert's hidden size.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_ffn_hidden: int | None = None
    moe_first_dense_layers: int = 0
    # More blocks that keep the dense MLP, by index (Qwen-MoE's mlp_only_layers and decoder_sparse_step).
    moe_dense_layers: tuple[int, ...] = ()
    moe_score_func: ScoreFunc = "softmax"
    # Renormalise the top-k gates to sum to 1 (when top_k > 1); false keeps the router's probabilities
    # (Qwen-MoE's norm_topk_prob=false).
    moe_norm_topk: bool = True
    moe_aux_loss_coef: float = 0.01
    moe_capacity_factor: float = 0.0  # 0: no capacity limit (no token dropping)
    # DeepSeek-V3's group-limited routing: the experts form `moe_n_group` equal groups and a token's top-k are chosen
    # only among its `moe_topk_group` best groups (a group scores the sum of its two best experts); 1 group: no limit.
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling_factor: float = 1.0  # the routed experts' gates are multiplied by it (DeepSeek-V3: 2.5)
    moe_shared_gate: bool = False  # Qwen2-MoE: the shared experts' output times sigmoid(a learned dim -> 1 linear)
    # A per-expert bias added to the routing scores for the top-k choice only, the gates keep the unbiased scores
    # (DeepSeek-V3's e_score_correction_bias); `[moe] balancing = "aux_free"` updates it after each optimizer step.
    moe_expert_bias: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3; the "deepseek" family): queries through a rank-`mla_q_lora_rank`
    # compression (0: projected directly), keys and values through one rank-`mla_kv_lora_rank` latent; each head's
    # query and key are a `mla_qk_nope_head_dim` part without rotary and a `mla_qk_rope_head_dim` rotary part (the key's
    # shared by every head), its value `mla_v_head_dim` wide.
    mla_q_lora_rank: int = 0
    mla_kv_lora_rank: int = 0
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_v_head_dim: int = 0
    # Multi-token prediction (DeepSeek-V3): `mtp_depth` sequential modules after the last block, module d predicting
    # the token d + 1 places after the next one, their mean loss weighted by `mtp_loss_weight` (0 modules: none).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # The model family (`paratrain.models.family`): which module is built and which parameter table, TP plan and
    # Hugging Face names describe it. The fields above are its dimensions.
    family: str = DEFAULT_FAMILY

    def __post_init__(self):
        # Resolved once so that saved dimensions (trainer.pt) carry it; dataclasses.replace(dim=...) keeps the
        # resolved value, pass head_dim=None with it to derive it again.
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        # A list from a TOML file or trainer.pt: a tuple, so the dimensions stay hashable.
        object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_experts > 0 and index >= self.moe_first_dense_layers and index not in self.moe_dense_layers


# Model dimensions that decide the parameters' shapes: a checkpoint loads only into a model that agrees on them
# (training/checkpoint.py).
ARCHITECTURE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                     "tie_embeddings", "moe_experts", "moe_shared_experts", "moe_ffn_hidden", "moe_first_dense_layers",
                     "moe_dense_layers", "family", "moe_shared_gate", "moe_expert_bias", "mla_q_lora_rank",
                     "mla_kv_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim", "mla_v_head_dim", "mtp_depth")


# -- checking dimensions that come from a file (a checkpoint's trainer.pt) --------------------------------------
# Upper bounds far beyond any published model: a value above one is a typo or a hostile file, and would make
# paratrain allocate without bound.
MAX_DIMENSION = 1 << 22  # dim, ffn_hidden, moe_ffn_hidden
MAX_COUNT = 1 << 16  # layers, heads, head_dim, experts
MAX_VOCAB = (1 << 31) - 1
MAX_POSITIONS = 1 << 26
_INT_RANGES = {
    "vocab_size": (1, MAX_VOCAB), "dim": (1, MAX_DIMENSION), "n_layers": (1, MAX_COUNT), "n_heads": (1, MAX_COUNT),
    "n_kv_heads": (1, MAX_COUNT), "ffn_hidden": (1, MAX_DIMENSION), "max_seq_len": (1, MAX_POSITIONS),
    "head_dim": (2, MAX_COUNT), "rope_original_max_seq_len": (1, MAX_POSITIONS), "moe_experts": (0, MAX_COUNT),
    "moe_top_k": (1, MAX_COUNT), "moe_shared_experts": (0, MAX_COUNT), "moe_ffn_hidden": (1, MAX_DIMENSION),
    "moe_first_dense_layers": (0, MAX_COUNT), "moe_n_group": (1, MAX_COUNT), "moe_topk_group": (1, MAX_COUNT),
    "mla_q_lora_rank": (0, MAX_DIMENSION), "mla_kv_lora_rank": (0, MAX_DIMENSION),
    "mla_qk_nope_head_dim": (0, MAX_COUNT), "mla_qk_rope_head_dim": (0, MAX_COUNT), "mla_v_head_dim": (0, MAX_COUNT),
    "mtp_depth": (0, MAX_COUNT),
}
_OPTIONAL = ("head_dim", "moe_ffn_hidden")
_POSITIVE = ("rope_theta", "norm_eps", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "moe_routed_scaling_factor")
_NON_NEGATIVE = ("moe_aux_loss_coef", "moe_capacity_factor", "mtp_loss_weight")
_BOOLEAN = ("tie_embeddings", "moe_norm_topk", "moe_shared_gate", "moe_expert_bias")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and value == value \
        and abs(value) != float("inf")


def fields_problem(fields, prefix: str = "") -> str | None:
    """What is wrong with saved ModelArgs fields (a dict from a file), naming the field as `prefix` + its name, or
    None: unknown or missing fields, wrong types, values out of range, heads that do not divide."""
    from dataclasses import MISSING, fields as dataclass_fields

    if not isinstance(fields, dict):
        return f"{prefix.rstrip('.') or 'the model dimensions'} is a {type(fields).__name__}, not a table"
    known = {f.name: f for f in dataclass_fields(ModelArgs)}
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        return f"{prefix.rstrip('.')} has an unknown field {unknown[0]!r}"
    missing = [n for n, f in known.items() if f.default is MISSING and n not in fields]
    if missing:
        return f"{prefix.rstrip('.')} lacks {missing[0]}"
    for name, value in fields.items():
        if name in _INT_RANGES:
            lo, hi = _INT_RANGES[name]
            if value is None and name in _OPTIONAL:
                continue
            if not is_int(value) or not lo <= value <= hi:
                return f"{prefix}{name} must be an integer from {lo} to {hi}, got {value!r}"
        elif name in _POSITIVE and not (is_number(value) and value > 0):
            return f"{prefix}{name} must be a positive number, got {value!r}"
        elif name in _NON_NEGATIVE and not (is_number(value) and value >= 0):
            return f"{prefix}{name} must be a number >= 0, got {value!r}"
        elif name == "moe_dense_layers" and not (isinstance(value, (list, tuple))
                                                 and all(is_int(i) and 0 <= i < MAX_COUNT for i in value)):
            return f"{prefix}{name} must be a list of layer indices, got {value!r}"
        elif name in _BOOLEAN and not isinstance(value, bool):
            return f"{prefix}{name} must be true or false, got {value!r}"
        elif name in ("rope_scaling", "moe_score_func") and not isinstance(value, str):
            return f"{prefix}{name} must be a string, got {value!r}"
    heads, kv = fields["n_heads"], fields.get("n_kv_heads", fields["n_heads"])
    if heads % kv:
        return f"{prefix}n_heads={heads} is not a multiple of {prefix}n_kv_heads={kv}"
    if fields.get("head_dim") is None and fields["dim"] % heads:
        return f"{prefix}dim={fields['dim']} is not a multiple of {prefix}n_heads={heads}"
    return None
