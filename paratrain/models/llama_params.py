"""The Llama family (models/llama.py, with models/moe.py's mixture of experts when moe_experts > 0): its parameter
table, sublayers and Hugging Face names. Torch-free; the one description the estimator, presets, tensor-parallel
plan and Hugging Face interop read."""

from __future__ import annotations

from paratrain.models.args import ModelArgs
from paratrain.models.family import HFArch, HFNames, ModelFamily, Param


def attention_params(args: ModelArgs, i: int, bias: bool = False) -> list[Param]:
    """The grouped-query attention's projections of block i (q/k/v column-parallel, o row-parallel); `bias`: q/k/v
    carry biases (split with their weights; under autocast a linear casts its bias too, hence `matmul`)."""
    C, hd, p = args.dim, args.head_dim, f"layers.{i}.attention."
    out = []
    for w, rows in (("wq", args.n_heads * hd), ("wk", args.n_kv_heads * hd), ("wv", args.n_kv_heads * hd)):
        out.append(Param(p + w + ".weight", (rows, C), "colwise", i, matmul=True))
        if bias:
            out.append(Param(p + w + ".bias", (rows,), "colwise", i, matmul=True))
    return out + [Param(p + "wo.weight", (C, args.n_heads * hd), "rowwise", i, matmul=True)]


def swiglu_params(prefix: str, dim: int, hidden: int, i: int) -> list[Param]:
    return [Param(prefix + "w1.weight", (hidden, dim), "colwise", i, matmul=True),
            Param(prefix + "w2.weight", (dim, hidden), "rowwise", i, matmul=True),
            Param(prefix + "w3.weight", (hidden, dim), "colwise", i, matmul=True)]


def feed_forward_params(args: ModelArgs, i: int) -> list[Param]:
    """Block i's dense SwiGLU, or its mixture of experts (router, stacked routed experts, shared experts)."""
    C, p = args.dim, f"layers.{i}.feed_forward."
    if not args.is_moe_layer(i):
        return swiglu_params(p, C, args.ffn_hidden, i)
    E, H = args.moe_experts, args.expert_hidden
    out = [Param(p + "router.weight", (E, C), "replicated", i),
           Param(p + "experts.w1", (E, C, H), "expert", i, matmul=True),
           Param(p + "experts.w2", (E, H, C), "expert", i, matmul=True),
           Param(p + "experts.w3", (E, C, H), "expert", i, matmul=True)]
    if args.moe_shared_experts:
        out += swiglu_params(p + "shared.", C, H * args.moe_shared_experts, i)
        if args.moe_shared_gate:  # Qwen2-MoE's sigmoid gate on the shared output, replicated like the router
            out.append(Param(p + "shared_gate.weight", (1, C), "replicated", i))
    return out


def moe_buffers(args: ModelArgs) -> list[Param]:
    """The mixture of experts' learned buffers, by block: the routing bias (`model.moe_expert_bias`, models/moe.py),
    updated outside the optimizer (by a capability's hook) and saved with the weights."""
    return [Param(f"layers.{i}.feed_forward.expert_bias", (args.moe_experts,), "replicated", i, trainable=False)
            for i in range(args.n_layers) if args.moe_expert_bias and args.is_moe_layer(i)]


def decoder_params(args: ModelArgs, attention=attention_params) -> list[Param]:
    """Embedding, blocks (norm, attention, norm, feed-forward), final norm and untied output, in
    `named_parameters()` order; `attention(args, i)` gives a block's attention parameters."""
    C, V = args.dim, args.vocab_size
    out = [Param("tok_embeddings.weight", (V, C), "embedding")]
    for i in range(args.n_layers):
        out += block_params(args, i, attention)
    out.append(Param("norm.weight", (C,), "norm"))
    if not args.tie_embeddings:
        out.append(Param("output.weight", (V, C), "output", matmul=True))
    return out


def block_params(args: ModelArgs, i: int, attention=attention_params) -> list[Param]:
    """Block i: norm, attention, norm, feed-forward."""
    C = args.dim
    return [Param(f"layers.{i}.attention_norm.weight", (C,), "norm", i), *attention(args, i),
            Param(f"layers.{i}.ffn_norm.weight", (C,), "norm", i), *feed_forward_params(args, i)]


def decoder_sublayers(args: ModelArgs, i: int) -> dict[str, str]:
    return {"attention": "attention", "feed_forward": "moe" if args.is_moe_layer(i) else "mlp"}


# transformers' LlamaForCausalLM / MixtralForCausalLM names.
LLAMA_HF = HFNames(
    top={"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"},
    block={"attention_norm.weight": "input_layernorm.weight",
           "attention.wq.weight": "self_attn.q_proj.weight",
           "attention.wk.weight": "self_attn.k_proj.weight",
           "attention.wv.weight": "self_attn.v_proj.weight",
           "attention.wo.weight": "self_attn.o_proj.weight",
           "ffn_norm.weight": "post_attention_layernorm.weight",
           "feed_forward.w1.weight": "mlp.gate_proj.weight",
           "feed_forward.w2.weight": "mlp.down_proj.weight",
           "feed_forward.w3.weight": "mlp.up_proj.weight",
           "feed_forward.router.weight": "block_sparse_moe.gate.weight"},
    expert="block_sparse_moe.experts.{e}.{w}.weight",
)

# transformers' config defaults for fields a config.json may leave out (LlamaConfig, MistralConfig, MixtralConfig).
_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
LLAMA_ARCHS = (
    HFArch("LlamaForCausalLM", "llama", fixed={"attention_bias": False, "mlp_bias": False}, defaults=_DEFAULTS,
           written={"pretraining_tp": 1}),
    # Llama's layout with an optional sliding window (refused when it is shorter than the context).
    HFArch("MistralForCausalLM", "mistral", exported=False, defaults=_DEFAULTS),
    # Softmax top-k >= 2 renormalised gates over routed experts only, every block.
    HFArch("MixtralForCausalLM", "mixtral", moe=True,
           defaults={**_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
           written={"output_router_logits": False, "sliding_window": None, "router_jitter_noise": 0.0}),
)

FAMILY = ModelFamily(
    name="llama", module="paratrain.models.llama:Transformer", params=decoder_params, sublayers=decoder_sublayers,
    hf=LLAMA_HF, description="Llama-style decoder (RMSNorm, GQA with rotary embeddings, SwiGLU or mixture of experts)",
    hf_archs=LLAMA_ARCHS,
)
