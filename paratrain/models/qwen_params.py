"""The Qwen families (models/qwen.py): Llama's decoder with Qwen's attention, their parameter tables, Hugging Face
names and config.json architectures. Torch-free, like llama_params.py.

- `qwen2`: biases on the q/k/v projections (Qwen2, Qwen2.5: `Qwen2ForCausalLM`).
  With moe_experts > 0 `Qwen2MoeForCausalLM`: Qwen3-MoE's routing plus one shared expert (paratrain's
  moe_shared_experts experts of the routed width) whose output is gated by sigmoid(a learned dim -> 1 linear).
- `qwen3`: RMSNorm over each head of q and k before rotary, with a head_dim of its own (Qwen3: `Qwen3ForCausalLM`,
  and with moe_experts > 0 `Qwen3MoeForCausalLM`: softmax top-k routing over routed experts only, gates renormalised
  by norm_topk_prob, dense MLPs where mlp_only_layers / decoder_sparse_step say).
- `qwen3-bias`: `qwen3` with Qwen3's attention_bias=true (biases on q, k, v and o); `paratrain verify`'s tiny
  Qwen3-shaped model uses it, so one model covers both features.
"""

from __future__ import annotations

from paratrain.models.args import ModelArgs
from paratrain.models.family import HFArch, HFNames, ModelFamily, Param
from paratrain.models.llama_params import LLAMA_HF, attention_params, decoder_params, decoder_sublayers


def qwen_attention_params(args: ModelArgs, i: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> list[Param]:
    """Block i's attention in `named_parameters()` order: the projections (with their biases), then the per-head q
    and k norm gains (one head_dim vector each, shared by every head)."""
    out = attention_params(args, i, bias=qkv_bias)
    p = f"layers.{i}.attention."
    if o_bias:  # row-parallel: replicated, added once after the reduction
        out.append(Param(p + "wo.bias", (args.dim,), "rowwise", i, matmul=True))
    if qk_norm:
        out += [Param(p + "q_norm.weight", (args.head_dim,), "head_norm", i),
                Param(p + "k_norm.weight", (args.head_dim,), "head_norm", i)]
    return out


def qwen2_params(args: ModelArgs) -> list[Param]:
    return decoder_params(args, lambda a, i: qwen_attention_params(a, i, qkv_bias=True, o_bias=False, qk_norm=False))


def qwen3_params(args: ModelArgs) -> list[Param]:
    return decoder_params(args, lambda a, i: qwen_attention_params(a, i, qkv_bias=False, o_bias=False, qk_norm=True))


def qwen3_bias_params(args: ModelArgs) -> list[Param]:
    return decoder_params(args, lambda a, i: qwen_attention_params(a, i, qkv_bias=True, o_bias=True, qk_norm=True))


# transformers' Qwen2 / Qwen3 / Qwen3-MoE names: Llama's, plus the biases and q/k norms, and Qwen-MoE's mixture.
QWEN_HF = HFNames(
    top=LLAMA_HF.top,
    block={**{k: v for k, v in LLAMA_HF.block.items() if not k.startswith("feed_forward.router")},
           **{f"attention.{w}.bias": f"self_attn.{h}_proj.bias" for w, h in (("wq", "q"), ("wk", "k"), ("wv", "v"),
                                                                             ("wo", "o"))},
           "attention.q_norm.weight": "self_attn.q_norm.weight",
           "attention.k_norm.weight": "self_attn.k_norm.weight",
           "feed_forward.router.weight": "mlp.gate.weight",
           **{f"feed_forward.shared.{w}.weight": f"mlp.shared_expert.{h}.weight"
              for w, h in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))},
           "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight"},
    expert="mlp.experts.{e}.{w}.weight",
    expert_weights={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
)

# transformers' config defaults (Qwen2Config, Qwen3Config, Qwen3MoeConfig) for fields a config.json may leave out.
_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
             "tie_word_embeddings": False, "attention_bias": False}
_MOE_DEFAULTS = {**_DEFAULTS, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}
_FULL_ATTENTION = {"use_sliding_window": False, "sliding_window": None}  # written on export
# Qwen2MoeConfig's defaults (Qwen1.5-MoE-A2.7B's sizes).
_QWEN2_MOE_DEFAULTS = {**_MOE_DEFAULTS, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                       "shared_expert_intermediate_size": 5632, "qkv_bias": True}


def _qwen3_archs(attention_bias: bool) -> tuple[HFArch, ...]:
    fixed = {"attention_bias": attention_bias}
    return (HFArch("Qwen3ForCausalLM", "qwen3", fixed=fixed, defaults=_DEFAULTS, written=_FULL_ATTENTION,
                   window_flag="use_sliding_window"),
            # transformers 5 saves the experts' count as num_local_experts, the official checkpoints as num_experts.
            HFArch("Qwen3MoeForCausalLM", "qwen3_moe", moe=True, fixed=fixed, defaults=_MOE_DEFAULTS,
                   written={**_FULL_ATTENTION, "output_router_logits": False},
                   experts_keys=("num_experts", "num_local_experts"), expert_hidden_key="moe_intermediate_size",
                   sparse_layers=True, norm_topk_key="norm_topk_prob", window_flag="use_sliding_window"))


def _family(name: str, cls: str, params, archs, description: str) -> ModelFamily:
    return ModelFamily(name=name, module=f"paratrain.models.qwen:{cls}", params=params, sublayers=decoder_sublayers,
                       hf=QWEN_HF, description=description, hf_archs=archs)


QWEN2 = _family("qwen2", "Qwen2", qwen2_params,
                (HFArch("Qwen2ForCausalLM", "qwen2", defaults=_DEFAULTS, written=_FULL_ATTENTION,
                        window_flag="use_sliding_window"),
                 HFArch("Qwen2MoeForCausalLM", "qwen2_moe", moe=True, fixed={"qkv_bias": True},
                        defaults=_QWEN2_MOE_DEFAULTS, written={**_FULL_ATTENTION, "output_router_logits": False},
                        experts_keys=("num_experts", "num_local_experts"), expert_hidden_key="moe_intermediate_size",
                        sparse_layers=True, norm_topk_key="norm_topk_prob", window_flag="use_sliding_window",
                        shared_expert_key="shared_expert_intermediate_size")),
                "Qwen2 / Qwen2.5 / Qwen2-MoE: Llama's decoder with biases on the q/k/v projections")
QWEN3 = _family("qwen3", "Qwen3", qwen3_params, _qwen3_archs(False),
                "Qwen3 / Qwen3-MoE: per-head RMSNorm on q and k before rotary")
QWEN3_BIAS = _family("qwen3-bias", "Qwen3Bias", qwen3_bias_params, _qwen3_archs(True),
                     "Qwen3 with attention_bias: q/k norm and biases on q, k, v and o")
