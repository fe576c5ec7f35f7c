"""How a mixture-of-experts model keeps its experts evenly loaded (`[moe]`).

- "aux_free" (DeepSeek-V3, Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"): each MoE layer's routing bias
  (`model.moe_expert_bias`: a persistent buffer the top-k choice adds to the scores, never the gates) moves after each
  optimizer step by `bias_update_rate * sign(mean load - load_e)`: an overloaded expert is chosen less next step.
  The loads are the step's top-k assignments counted over every micro-batch and data-parallel rank (expert-parallel
  ranks included; tensor-parallel ranks route the same tokens and count once; a pipeline stage its own layers): the
  expert-load statistics the metrics report (distributed/expert_parallel.py's MoEMeter), from the same all-reduce.
  The counts are integers, so every rank and every layout computes the same bias; it is a buffer of the model, so
  checkpoints save it and a resume, on any layout, goes on from it. The sequence-wise balance loss stays on beside it
  with `model.moe_aux_loss_coef` (DeepSeek-V3 keeps a tiny one; 0 turns it off).
- "aux_loss": the sequence-wise balance loss alone (models/moe.py); a bias the model has is left as it is.
- "none": neither (the balance loss's coefficient is 0).
- "auto" (default): "aux_free" on a model with the routing bias, else "aux_loss".

Asking for "aux_free" on a model without the bias is a one-line error telling to set model.moe_expert_bias=true: the
bias is part of the model (its checkpoints and Hugging Face exports carry it), so the model's settings say it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.capabilities.base import MOE_PRESET, Capability
from paratrain.errors import ConfigError
from paratrain.models.args import ModelArgs
from paratrain.models.presets import PRESETS

DEFAULTS = {"moe_expert_bias": ModelArgs.moe_expert_bias}

MODES = ("auto", "aux_loss", "aux_free", "none")
NEEDS_BIAS = "moe.balancing=aux_free needs the routing bias: set model.moe_expert_bias=true"
# verify: the tiny MoE with the bias, moved fast enough to change the routing within the verify's few steps
ROW = (MOE_PRESET, "model.moe_expert_bias=true", "moe.balancing=aux_free", "moe.bias_update_rate=0.02")


@dataclass
class MoEBalancingConfig:
    # how the experts' load is balanced: "aux_free" (DeepSeek-V3: a per-expert routing bias moved after each step
    # toward the mean load; needs model.moe_expert_bias, keeps the sequence-wise loss of model.moe_aux_loss_coef),
    # "aux_loss" (the sequence-wise balance loss alone), "none", or "auto": aux_free on a model with the bias, else
    # aux_loss
    balancing: Literal["auto", "aux_loss", "aux_free", "none"] = "auto"
    # aux_free: the bias's step, bias_update_rate x sign(mean load - expert load) per optimizer step (DeepSeek-V3:
    # 1e-3)
    bias_update_rate: float = 1e-3


def balancing_problem(section) -> str | None:
    """What is wrong with a `[moe]` section, naming the key, or None."""
    if section.balancing not in MODES:
        return f"moe.balancing must be one of {', '.join(MODES)}, got {section.balancing!r}"
    rate = section.bias_update_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        return f"moe.bias_update_rate must be a number in (0, 1], got {rate!r}"
    return None


def _model_value(model, key: str):
    """A `[model]` key's value for a preset (its override, else the preset's, else ModelArgs' default), or None: an
    imported model's (known once it is read)."""
    if model.init_from or model.preset not in PRESETS:
        return None
    value = getattr(model, key)
    return value if value is not None else PRESETS[model.preset].get(key, DEFAULTS[key])


@dataclass(frozen=True)
class MoEBalancing(Capability):
    balancing: str = "auto"
    bias_update_rate: float = 1e-3

    name = "moe"
    section = MoEBalancingConfig
    section_after = "model"
    verify_rows = {"aux_free-fsdp2": (2, "fsdp", *ROW), "aux_free-ep2": (2, "fsdp,ep=2", *ROW),
                   "aux_free-ep2xtp2": (4, "fsdp,tp=2,ep=2", *ROW)}
    # the bias resumed on a layout that shards it differently
    resumed_rows = {"resume-ep2:fsdp2": ("aux_free-ep2", (2, "fsdp")),
                    "resume-ep2xtp2:pp2": ("aux_free-ep2xtp2", (2, "nodp,pp=2,sched=1f1b"))}
    reference_keys = ("moe.",)

    @classmethod
    def from_config(cls, cfg) -> "MoEBalancing | None":
        """The run's balancing; None where the section's defaults change nothing (a preset without the routing bias:
        "auto" is the balance loss alone, the model's own)."""
        m = cfg.moe
        if (m.balancing, m.bias_update_rate) == ("auto", 1e-3) and _model_value(cfg.model, "moe_expert_bias") is False:
            return None
        return cls(m.balancing, float(m.bias_update_rate))

    @classmethod
    def check(cls, cfg) -> None:
        why = balancing_problem(cfg.moe)
        if why:
            raise ConfigError(why)
        if cfg.moe.balancing == "aux_free" and _model_value(cfg.model, "moe_expert_bias") is False:
            raise ConfigError(NEEDS_BIAS)

    @classmethod
    def section_problem(cls, section) -> str | None:
        return balancing_problem(section)

    @classmethod
    def uses(cls, overrides: list[str]) -> bool:
        return any(o.startswith("moe.") for o in overrides)

    def config_values(self) -> dict:
        return {"moe.balancing": self.balancing, "moe.bias_update_rate": self.bias_update_rate}

    # -- the training step (torch objects; imports inside) --
    def before_parallelize(self, model, where) -> dict:
        """The model as this balancing trains it: no balance loss under "none"; "aux_free" needs the bias (an
        imported model's settings are known only here)."""
        # lazy: the config checks and the estimator import capabilities without torch
        from paratrain.models.moe import moe_modules

        for moe in moe_modules(model):
            if self.balancing == "aux_free" and moe.expert_bias is None:
                raise ConfigError(NEEDS_BIAS)
            if self.balancing == "none":
                moe.aux_loss_coef = 0.0
        return {}

    def after_expert_loads(self, model, loads, finite) -> None:
        """bias_e += rate x sign(mean load - load_e) per MoE layer ("aux_free", or "auto" on a model with the bias);
        no move on a skipped step."""
        if self.balancing not in ("aux_free", "auto"):
            return
        # lazy: the config checks and the estimator import capabilities without torch
        import torch

        from paratrain.models.moe import moe_modules

        with torch.no_grad():
            for moe, load in zip(moe_modules(model), loads):  # load (E,) fp64: exact integer counts
                if moe.expert_bias is None:
                    continue
                step = torch.sign(load.mean() - load).to(moe.expert_bias) * self.bias_update_rate  # (E,)
                if finite is not True:  # (a device bool: no host read)
                    step = step * (finite.to(step) if torch.is_tensor(finite) else float(finite))
                moe.expert_bias.add_(step)
