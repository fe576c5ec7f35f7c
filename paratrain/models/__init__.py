"""The model: plain nn.Modules with no parallel code (llama.py, moe.py, qwen.py), its torch-free dimensions
(args.py), the model families (family.py: what a family gives, its module, parameter table with tensor-parallel roles
and Hugging Face names; registry.py: the families by name; llama_params.py: the Llama family; qwen_params.py: Qwen2,
Qwen3 and Qwen3-MoE) and named sizes with exact parameter and FLOP counts (presets.py).

`Transformer` and `build_model`'s modules are imported lazily so that `from paratrain.models import ModelArgs,
preset_args` does not load torch (the layout, estimator and planner reason about models without it)."""

from paratrain.models.args import ModelArgs
from paratrain.models.family import HFNames, ModelFamily, Param
from paratrain.models.presets import PRESETS, count_active_params, count_params, flops_per_token, format_params, preset_args
from paratrain.models.registry import FAMILIES, build_model, family_of, get_family, parameters, register_family

__all__ = ["ModelArgs", "Transformer", "PRESETS", "count_params", "count_active_params", "flops_per_token", "format_params",
           "preset_args", "ModelFamily", "HFNames", "Param", "register_family", "get_family", "family_of", "FAMILIES",
           "parameters", "build_model"]


def __getattr__(name: str):
    if name == "Transformer":
        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        from paratrain.models.llama import Transformer

        return Transformer
    raise AttributeError(name)
