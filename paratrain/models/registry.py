"""The model-family registry: family name (`ModelArgs.family`) -> `ModelFamily`, and what is derived from a family's
parameter table (cached on the frozen ModelArgs). Torch-free; `build_model` imports the family's module."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os

from paratrain.errors import UserError
from paratrain.models import deepseek_params, llama_params, mtp_params, qwen_params
from paratrain.models.args import ModelArgs
from paratrain.models.family import AttentionShape, ModelFamily, Param, SideHead

# The families shipped with paratrain, one line each.
FAMILIES: dict[str, ModelFamily] = {
    "llama": llama_params.FAMILY,  # Llama 3 / Mistral, and with moe_experts > 0 Mixtral / DeepSeekMoE
    "qwen2": qwen_params.QWEN2,  # Qwen2 / Qwen2.5: q/k/v biases
    "qwen3": qwen_params.QWEN3,  # Qwen3: per-head q/k norms, and with moe_experts > 0 Qwen3-MoE
    "qwen3-bias": qwen_params.QWEN3_BIAS,  # Qwen3 with attention_bias: q/k norms and q/k/v/o biases
    "deepseek": deepseek_params.FAMILY,  # DeepSeek-V2/V3: multi-head latent attention, with moe_experts > 0 V3's MoE
}
BUILTIN = tuple(FAMILIES)
# The side heads any family's model may have (`SideHead`), one line each, in the order they follow the head.
SIDE_HEADS: tuple[SideHead, ...] = (
    mtp_params.SIDE_HEAD,  # multi-token prediction (DeepSeek-V3): model.mtp_depth
)
FAMILY_MODULES_ENV = "PARATRAIN_FAMILY_MODULES"  # modules that register families, for spawned ranks to import


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` known by its name (again: replaced). The module of its nn.Module is recorded in the environment,
    so that ranks started from this process (which inherit it) import it and know the family too; that module must
    register the family when imported."""
    if FAMILIES.get(family.name, family) != family:
        for cache in (parameters, side_params, block_numels, roles):
            cache.cache_clear()
    FAMILIES[family.name] = family
    origin = family.module.partition(":")[0]
    if family.name not in BUILTIN and origin != "__main__":
        known = [m for m in os.environ.get(FAMILY_MODULES_ENV, "").split(",") if m]
        if origin not in known:
            os.environ[FAMILY_MODULES_ENV] = ",".join([*known, origin])
    return family


def get_family(name: str) -> ModelFamily:
    """The registered family `name`, or a one-line UserError naming the known ones."""
    if name not in FAMILIES:
        for module in os.environ.get(FAMILY_MODULES_ENV, "").split(","):
            if module:
                importlib.import_module(module)
    if name not in FAMILIES:
        raise UserError(f"unknown model family '{name}' (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]


def family_of(args: ModelArgs) -> ModelFamily:
    return get_family(args.family)


@functools.lru_cache(maxsize=256)
def parameters(args: ModelArgs) -> tuple[Param, ...]:
    """The family's parameter table for these dimensions, then its side heads' (cached: ModelArgs is frozen)."""
    return tuple(family_of(args).params(args)) + side_params(args)


def side_heads(args: ModelArgs) -> tuple[SideHead, ...]:
    """The side heads the model has (`SideHead.blocks` > 0)."""
    return tuple(head for head in SIDE_HEADS if head.blocks(args))


def side_blocks(args: ModelArgs) -> int:
    """The blocks the side heads run on the last pipeline stage, each with one more pass through the output head."""
    return sum(head.blocks(args) for head in SIDE_HEADS)


@functools.lru_cache(maxsize=256)
def side_params(args: ModelArgs) -> tuple[Param, ...]:
    """The side heads' parameter table (their blocks are the family's blocks of the indices after the model's)."""
    heads = side_heads(args)
    if not heads:
        return ()
    family = family_of(args)

    def block(i: int) -> list[Param]:
        return [p for p in family.params(dataclasses.replace(args, n_layers=i + 1)) if p.layer == i]

    return tuple(p for head in heads for p in head.params(args, block))


def layout_problem(layout, args: ModelArgs) -> str | None:
    """Why a side head of the model cannot run on `layout` (a paratrain.layout.Layout), or None."""
    return next((why for why in (head.layout_problem(layout, args) for head in SIDE_HEADS) if why), None)


@functools.lru_cache(maxsize=256)
def block_numels(args: ModelArgs) -> tuple[tuple[int, int], ...]:
    """(parameters, parameters one token uses) of each block. A token uses top_k of a layer's routed experts."""
    out = [[0, 0] for _ in range(args.n_layers)]
    for p in parameters(args):
        if p.layer is not None:
            out[p.layer][0] += p.numel
            out[p.layer][1] += used_numel(args, p)
    return tuple(map(tuple, out))


def used_numel(args: ModelArgs, p: Param) -> int:
    """Elements of `p` one token uses: top_k of a routed-expert weight's experts, all of any other parameter's."""
    return p.numel * args.moe_top_k // p.shape[0] if p.expert else p.numel


@functools.lru_cache(maxsize=256)
def roles(args: ModelArgs) -> frozenset[str]:
    """The tensor-parallel roles of the family's parameters (e.g. whether its attention has per-head norms)."""
    return frozenset(p.role for p in parameters(args))


@functools.lru_cache(maxsize=256)
def attention_shape(args: ModelArgs) -> AttentionShape:
    """The family's attention as the estimator sees it (widths per head, latents)."""
    return family_of(args).attention(args)


def verify_rows() -> dict[str, tuple]:
    """The `paratrain verify` rows of every registered family and side head (`verify_rows` of each)."""
    return {name: row for owner in (*FAMILIES.values(), *SIDE_HEADS) for name, row in owner.verify_rows.items()}


def build_model(args: ModelArgs):
    """The family's nn.Module for `args` (on the current default device), with its side heads after its head
    (`Transformer.attach_side_head`)."""
    model = family_of(args).model_class()(args)
    for head in side_heads(args):
        model.attach_side_head(head.name, head.module_class()(args, model.attention_class))
    return model

