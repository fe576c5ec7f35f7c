from paratrain.models.llama import ModelArgs, Transformer
from paratrain.models.presets import PRESETS, count_active_params, count_params, flops_per_token, preset_args

__all__ = ["ModelArgs", "Transformer", "PRESETS", "count_params", "count_active_params", "flops_per_token", "preset_args"]
