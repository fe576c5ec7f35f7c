"""Which Hugging Face tensor holds which part of which paratrain parameter, from the model family's parameter table
and Hugging Face names (`paratrain.models.family.HFNames`).

Dense parameters map one to one by name (the rotary layout is the same, so q and k need no permutation).
paratrain stacks the experts of an MoE layer: experts.w1 and w3 are (E, dim, hidden) and w2 (E, hidden, dim),
used as x @ w[e]; Mixtral stores each expert as nn.Linear weights, `block_sparse_moe.experts.{e}.w1.weight`
(hidden, dim), i.e. w[e] transposed (Qwen3-MoE the same as `mlp.experts.{e}.gate_proj.weight`). A `Piece` is one Hugging Face tensor: a parameter, or one expert of a
stacked parameter, transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.models.family import HFNames, Param
from paratrain.models.llama_params import moe_buffers
from paratrain.models.registry import family_of, parameters

# Tensors some Hugging Face checkpoints carry that are derived, not learned; ignored on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Piece:
    hf: str  # Hugging Face tensor name
    param: str  # paratrain parameter name
    shape: tuple  # Hugging Face shape
    expert: int | None = None  # index along dim 0 of a stacked expert parameter; the tensor is w[expert].T
    vocab: bool = False  # rows are token ids (the embedding and output): trimmed to the tokenizer's vocabulary


def hf_names(args: ModelArgs) -> HFNames:
    """The family's Hugging Face names, or a one-line UserError for a family without a Hugging Face counterpart."""
    family = family_of(args)
    if family.hf is None:
        raise UserError(f"model family '{family.name}' has no Hugging Face counterpart")
    return family.hf


def param_shapes(args: ModelArgs) -> dict[str, tuple]:
    """paratrain parameter name -> shape, in named_parameters() order (a tied output weight is not listed): the
    family's parameter table; then the persistent buffers a Hugging Face checkpoint holds too (`hf_buffers`)."""
    return {p.name: p.shape for p in [*parameters(args), *hf_buffers(args)]}


def hf_buffers(args: ModelArgs) -> list[Param]:
    """The model's learned buffers that its family's Hugging Face names map (DeepSeek-V3's routing bias,
    `feed_forward.expert_bias`), as replicated table entries outside the parameter table (no gradient, no optimizer
    state): checkpoints and exports carry them like parameters."""
    names = family_of(args).hf
    return [b for b in moe_buffers(args) if names is not None and b.name.split(".", 2)[2] in names.block]


def hf_name(names: HFNames, param: str, expert: int | None = None) -> str:
    if param in names.top:
        return names.top[param]
    _, index, rest = param.split(".", 2)  # layers.{i}.rest
    prefix = f"model.layers.{index}."
    if expert is not None:
        w = rest.rsplit(".", 1)[1]
        return prefix + names.expert.format(e=expert, w=names.expert_weights.get(w, w))
    if rest in names.block:
        return prefix + names.block[rest]
    raise KeyError(param)


def pieces(args: ModelArgs, vocab_size: int | None = None) -> list[Piece]:
    """Every Hugging Face tensor of the model in checkpoint order; `vocab_size` trims the vocabulary rows
    (paratrain pads its vocabulary; the exported model has exactly the tokenizer's ids)."""
    vocab_size = vocab_size or args.vocab_size
    names = hf_names(args)
    out = []
    for p in [*parameters(args), *hf_buffers(args)]:
        if not p.exported:  # training only (a side head's modules)
            continue
        if p.expert:
            E, _, _ = p.shape
            out += [Piece(hf_name(names, p.name, e), p.name, (p.shape[2], p.shape[1]), e) for e in range(E)]
        else:
            vocab = p.role in ("embedding", "output")
            shape = (vocab_size, *p.shape[1:]) if vocab else p.shape
            out.append(Piece(hf_name(names, p.name), p.name, tuple(shape), vocab=vocab))
    return out


def pieces_by_param(args: ModelArgs) -> dict[str, list[Piece]]:
    grouped: dict[str, list[Piece]] = {}
    for piece in pieces(args):
        grouped.setdefault(piece.param, []).append(piece)
    return grouped
