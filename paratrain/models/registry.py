"""The model-family registry: family name (`ModelArgs.family`) -> `ModelFamily`, and what is derived from a family's
parameter table (cached on the frozen ModelArgs). Torch-free; `build_model` imports the family's module."""

from __future__ import annotations

import functools
import importlib
import os

from paratrain.errors import UserError
from paratrain.models import deepseek_params, llama_params, qwen_params
from paratrain.models.args import ModelArgs
from paratrain.models.family import AttentionShape, ModelFamily, Param

# The families shipped with paratrain, one line each.
FAMILIES: dict[str, ModelFamily] = {
    "llama": llama_params.FAMILY,  # Llama 3 / Mistral, and with moe_experts > 0 Mixtral / DeepSeekMoE
    "qwen2": qwen_params.QWEN2,  # Qwen2 / Qwen2.5: q/k/v biases
    "qwen3": qwen_params.QWEN3,  # Qwen3: per-head q/k norms, and with moe_experts > 0 Qwen3-MoE
    "qwen3-bias": qwen_params.QWEN3_BIAS,  # Qwen3 with attention_bias: q/k norms and q/k/v/o biases
    "deepseek": deepseek_params.FAMILY,  # DeepSeek-V2/V3: multi-head latent attention, with moe_experts > 0 V3's MoE
}
BUILTIN = tuple(FAMILIES)
FAMILY_MODULES_ENV = "PARATRAIN_FAMILY_MODULES"  # modules that register families, for spawned ranks to import


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` known by its name (again: replaced). The module of its nn.Module is recorded in the environment,
    so that ranks started from this process (which inherit it) import it and know the family too; that module must
    register the family when imported."""
    if FAMILIES.get(family.name, family) != family:
        for cache in (parameters, block_numels, roles):
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
    """The family's parameter table for these dimensions (cached: ModelArgs is frozen)."""
    return tuple(family_of(args).params(args))


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
    """The `paratrain verify` rows of every registered family (`ModelFamily.verify_rows`)."""
    return {name: row for family in FAMILIES.values() for name, row in family.verify_rows.items()}


def build_model(args: ModelArgs):
    """The family's nn.Module for `args` (on the current default device), with multi-token prediction's modules
    (models/mtp.py) after its head when args.mtp_depth > 0."""
    model = family_of(args).model_class()(args)
    if args.mtp_depth:
        from paratrain.models.mtp import MultiTokenPrediction  # lazy: torch (the registry is torch-free)

        model.mtp = MultiTokenPrediction(args, model.attention_class)
    return model

