"""The DeepSeek family (models/deepseek.py): Llama's decoder with multi-head latent attention (MLA, DeepSeek-V2/V3),
its parameter table, attention shape, Hugging Face names and config.json architecture. Torch-free.

MLA: the query through a rank-`mla_q_lora_rank` latent (q_a_proj, an RMSNorm, q_b_proj; rank 0: q_proj), the keys and
values through one rank-`mla_kv_lora_rank` latent (kv_a_proj_with_mqa, an RMSNorm, kv_b_proj), each head's query and
key a `mla_qk_nope_head_dim` part without rotary and a `mla_qk_rope_head_dim` rotary part, the key's rotary part one
for all heads (the tail of kv_a_proj_with_mqa's output), each head's value `mla_v_head_dim` wide. Names and layout are
transformers' DeepseekV3Attention, so checkpoints map by name. `head_dim` is the rotary width (as in transformers'
DeepseekV3Config), which sizes the model's rotary tables.
"""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.models.args import ModelArgs
from paratrain.models.family import AttentionShape, HFArch, HFNames, ModelFamily, Param
from paratrain.models.llama_params import LLAMA_HF, decoder_params, decoder_sublayers

MLA_KEYS = ("mla_kv_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim", "mla_v_head_dim")


def check_mla(args: ModelArgs) -> None:
    """One-line errors for MLA dimensions the model cannot have."""
    missing = next((k for k in MLA_KEYS if getattr(args, k) < 1), None)
    if missing:
        raise ConfigError(f"model.family=deepseek needs model.{missing} >= 1 (multi-head latent attention's widths)")
    if args.mla_qk_rope_head_dim % 2:
        raise ConfigError(f"model.mla_qk_rope_head_dim={args.mla_qk_rope_head_dim} must be even (rotary pairs)")
    if args.head_dim != args.mla_qk_rope_head_dim:
        raise ConfigError(f"model.family=deepseek: model.head_dim={args.head_dim} must equal "
                          f"model.mla_qk_rope_head_dim={args.mla_qk_rope_head_dim} (it sizes the rotary tables)")
    if args.n_kv_heads != args.n_heads:
        raise ConfigError(f"model.family=deepseek: model.n_kv_heads={args.n_kv_heads} must equal model.n_heads="
                          f"{args.n_heads} (every head has its own key and value from the latent)")


def mla_params(args: ModelArgs, i: int) -> list[Param]:
    """Block i's latent attention in `named_parameters()` order. Tensor parallelism splits the up-projections by heads
    (column-parallel) and o_proj's input (row-parallel); the down-projections and their norms are replicated, the kv
    one as "shared_key": the rotary key at its output's tail is read by every head, so its gradient is summed over
    the tp ranks' heads."""
    C, H, p = args.dim, args.n_heads, f"layers.{i}.attention."
    qk = args.mla_qk_nope_head_dim + args.mla_qk_rope_head_dim
    q, kv = args.mla_q_lora_rank, args.mla_kv_lora_rank
    if q:
        out = [Param(p + "q_a_proj.weight", (q, C), "replicated", i, matmul=True),
               Param(p + "q_a_layernorm.weight", (q,), "replicated", i),
               Param(p + "q_b_proj.weight", (H * qk, q), "colwise", i, matmul=True)]
    else:
        out = [Param(p + "q_proj.weight", (H * qk, C), "colwise", i, matmul=True)]
    return out + [
        Param(p + "kv_a_proj_with_mqa.weight", (kv + args.mla_qk_rope_head_dim, C), "shared_key", i, matmul=True),
        Param(p + "kv_a_layernorm.weight", (kv,), "replicated", i),
        Param(p + "kv_b_proj.weight", (H * (args.mla_qk_nope_head_dim + args.mla_v_head_dim), kv), "colwise", i,
              matmul=True),
        Param(p + "o_proj.weight", (C, H * args.mla_v_head_dim), "rowwise", i, matmul=True)]


def deepseek_params(args: ModelArgs) -> list[Param]:
    check_mla(args)
    return decoder_params(args, mla_params)


def mla_shape(args: ModelArgs) -> AttentionShape:
    """What the estimator reads of MLA: every head has its own key and value (expanded from the latent); the value is
    padded to the query/key width for the fused kernels (models/deepseek.py), the two latents are normalised."""
    qk = args.mla_qk_nope_head_dim + args.mla_qk_rope_head_dim
    return AttentionShape(heads=args.n_heads, kv_heads=args.n_heads, qk_dim=qk, v_dim=qk,
                          out_dim=args.mla_v_head_dim, rope_dim=args.mla_qk_rope_head_dim,
                          latents=tuple(r for r in (args.mla_q_lora_rank, args.mla_kv_lora_rank) if r),
                          score_width=args.n_heads * (qk + args.mla_v_head_dim) // 2,
                          shared_key=args.mla_qk_rope_head_dim)


_ATTENTION = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
# transformers' DeepseekV3ForCausalLM names: Llama's embedding, norms and MLP, MLA's projections by their own names,
# the router as mlp.gate, the shared experts as mlp.shared_experts.
DEEPSEEK_HF = HFNames(
    top=LLAMA_HF.top,
    block={**{k: v for k, v in LLAMA_HF.block.items() if not k.startswith(("attention.", "feed_forward.router"))},
           **{f"attention.{m}.weight": f"self_attn.{m}.weight" for m in _ATTENTION},
           "feed_forward.router.weight": "mlp.gate.weight",
           "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",  # a buffer (models/moe.py)
           **{f"feed_forward.shared.{w}.weight": f"mlp.shared_experts.{h}.weight"
              for w, h in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}},
    expert="mlp.experts.{e}.{w}.weight",
    expert_weights={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
)

# transformers' DeepseekV3Config defaults for fields a config.json may leave out; router_aux_loss_coef is no field of
# it: the DeepSeek-V3 paper's sequence-wise balance factor (0.0001).
_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
             "tie_word_embeddings": False, "attention_bias": False, "rope_interleave": True, "n_routed_experts": 256,
             "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8,
             "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
             "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "router_aux_loss_coef": 0.0001}
# DeepseekV3ForCausalLM: sigmoid top-k within the best groups, chosen with the per-expert bias, gates renormalised and
# scaled; ungated shared experts; dense first blocks; the rotary part's pairs interleaved (DeepSeek's checkpoints,
# which models/deepseek.py computes). Multi-token prediction's modules are not exported (transformers ignores them).
DEEPSEEK_ARCHS = (
    HFArch("DeepseekV3ForCausalLM", "deepseek_v3", moe=True, fixed={"attention_bias": False, "rope_interleave": True},
           defaults=_DEFAULTS, written={"num_nextn_predict_layers": 0, "output_router_logits": False},
           experts_keys=("n_routed_experts", "num_local_experts"), expert_hidden_key="moe_intermediate_size",
           norm_topk_key="norm_topk_prob", shared_count_key="n_shared_experts",
           first_dense_key="first_k_dense_replace", score_func="sigmoid", expert_bias=True,
           dims={"n_group": ("moe_n_group",), "topk_group": ("moe_topk_group",),
                 "routed_scaling_factor": ("moe_routed_scaling_factor",), "q_lora_rank": ("mla_q_lora_rank",),
                 "kv_lora_rank": ("mla_kv_lora_rank",), "qk_nope_head_dim": ("mla_qk_nope_head_dim",),
                 "qk_rope_head_dim": ("mla_qk_rope_head_dim", "head_dim"), "v_head_dim": ("mla_v_head_dim",)}),
)

MLA = "model.preset=tiny-mla"  # DeepSeek-V3's attention at width 64, a dense block then an MoE one
DENSE = "model.moe_experts=0"  # (context parallelism does not take mixtures of experts)
# `paratrain verify`'s rows of multi-head latent attention, against one process.
VERIFY_ROWS = {
    "mla-fsdp2": (2, "fsdp", MLA),
    "mla-tp2": (2, "nodp,tp=2,sp=off", MLA),
    "mla-tp2+sp": (2, "nodp,tp=2", MLA),
    "mla-ep2xtp2": (4, "fsdp,tp=2,ep=2", MLA),
    "mla-pp2-1f1b": (2, "nodp,pp=2,sched=1f1b", MLA, DENSE),
    "mla-moe-pp2-1f1b": (2, "nodp,pp=2,sched=1f1b", MLA),
    "mla-cp2": (2, "fsdp,cp=2", MLA, DENSE),
}

FAMILY = ModelFamily(
    name="deepseek", module="paratrain.models.deepseek:DeepSeek", params=deepseek_params,
    sublayers=decoder_sublayers, hf=DEEPSEEK_HF, attention=mla_shape, hf_archs=DEEPSEEK_ARCHS, verify_rows=VERIFY_ROWS,
    description="DeepSeek-V2/V3: Llama's decoder with multi-head latent attention (low-rank q and kv, decoupled "
                "rotary key)")
