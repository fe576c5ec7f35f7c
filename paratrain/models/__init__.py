"""The model: plain nn.Modules with no parallel code (llama.py, moe.py), its torch-free dimensions (args.py)
and named sizes with exact parameter and FLOP counts (presets.py).

`Transformer` is imported lazily so that `from paratrain.models import ModelArgs, preset_args` does not
load torch (the layout, estimator and planner reason about models without it)."""

from paratrain.models.args import ModelArgs
from paratrain.models.presets import PRESETS, count_active_params, count_params, flops_per_token, format_params, preset_args

__all__ = ["ModelArgs", "Transformer", "PRESETS", "count_params", "count_active_params", "flops_per_token", "format_params", "preset_args"]


def __getattr__(name: str):
    if name == "Transformer":
        from paratrain.models.llama import Transformer

        return Transformer
    raise AttributeError(name)
