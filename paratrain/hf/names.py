"""Which Hugging Face tensor holds which part of which paratrain parameter.

Dense parameters map one to one by name (the rotary layout is the same, so q and k need no permutation).
paratrain stacks the experts of an MoE layer: experts.w1 and w3 are (E, dim, hidden) and w2 (E, hidden, dim),
used as x @ w[e]; Mixtral stores each expert as nn.Linear weights, `block_sparse_moe.experts.{e}.w1.weight`
(hidden, dim), i.e. w[e] transposed. A `Piece` is one Hugging Face tensor: a parameter, or one expert of a
stacked parameter, transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.llama import ModelArgs

LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
MOE_ROUTER = {"feed_forward.router.weight": "block_sparse_moe.gate.weight"}
MOE_EXPERTS = ("w1", "w2", "w3")  # feed_forward.experts.{w} <-> block_sparse_moe.experts.{e}.{w}.weight
VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")  # rows are token ids
# Tensors some Hugging Face checkpoints carry that are derived, not learned; ignored on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Piece:
    hf: str  # Hugging Face tensor name
    param: str  # paratrain parameter name
    shape: tuple  # Hugging Face shape
    expert: int | None = None  # index along dim 0 of a stacked expert parameter; the tensor is w[expert].T


def param_shapes(args: ModelArgs) -> dict[str, tuple]:
    """paratrain parameter name -> shape, in named_parameters() order (a tied output weight is not listed)."""
    C, hd, V = args.dim, args.head_dim, args.vocab_size
    shapes = {"tok_embeddings.weight": (V, C)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attention_norm.weight": (C,), p + "attention.wq.weight": (args.n_heads * hd, C),
                       p + "attention.wk.weight": (args.n_kv_heads * hd, C),
                       p + "attention.wv.weight": (args.n_kv_heads * hd, C),
                       p + "attention.wo.weight": (C, args.n_heads * hd), p + "ffn_norm.weight": (C,)})
        if args.is_moe_layer(i):
            E, H = args.moe_experts, args.expert_hidden
            shapes.update({p + "feed_forward.router.weight": (E, C), p + "feed_forward.experts.w1": (E, C, H),
                           p + "feed_forward.experts.w2": (E, H, C), p + "feed_forward.experts.w3": (E, C, H)})
        else:
            F = args.ffn_hidden
            shapes.update({p + "feed_forward.w1.weight": (F, C), p + "feed_forward.w2.weight": (C, F),
                           p + "feed_forward.w3.weight": (F, C)})
    shapes["norm.weight"] = (C,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (V, C)
    return shapes


def hf_name(param: str, expert: int | None = None) -> str:
    if param == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if param == "norm.weight":
        return "model.norm.weight"
    if param == "output.weight":
        return "lm_head.weight"
    _, index, rest = param.split(".", 2)  # layers.{i}.rest
    prefix = f"model.layers.{index}."
    if rest.startswith("feed_forward.experts."):
        return f"{prefix}block_sparse_moe.experts.{expert}.{rest.rsplit('.', 1)[1]}.weight"
    for table in (LAYER, DENSE_MLP, MOE_ROUTER):
        if rest in table:
            return prefix + table[rest]
    raise KeyError(param)


def pieces(args: ModelArgs, vocab_size: int | None = None) -> list[Piece]:
    """Every Hugging Face tensor of the model in checkpoint order; `vocab_size` trims the vocabulary rows
    (paratrain pads its vocabulary; the exported model has exactly the tokenizer's ids)."""
    vocab_size = vocab_size or args.vocab_size
    out = []
    for param, shape in param_shapes(args).items():
        if param.endswith(tuple(f"experts.{w}" for w in MOE_EXPERTS)):
            out += [Piece(hf_name(param, e), param, (shape[2], shape[1]), e) for e in range(shape[0])]
        else:
            if param in VOCAB_PARAMS:
                shape = (vocab_size, *shape[1:])
            out.append(Piece(hf_name(param), param, tuple(shape)))
    return out


def pieces_by_param(args: ModelArgs) -> dict[str, list[Piece]]:
    grouped: dict[str, list[Piece]] = {}
    for piece in pieces(args):
        grouped.setdefault(piece.param, []).append(piece)
    return grouped
