"""1-bit Adam and 0/1 Adam (docs/optimizers.md; DeepSpeed's names; the optimizers: paratrain/training/onebit.py):
AdamW warm-up steps with fp32 gradients, then momenta (and 0/1 Adam's gradients) averaged by the error-compensated
1-bit all-reduce. Here: their `[optimizer]` keys and the checks of them. Their registry entries (states, phases, the
layouts they refuse) are in paratrain/optimizers.py; their communication schedule is `optimizers.MomentumSchedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError
from paratrain.optimizers import BUILT_IN, freeze_step


@dataclass
class OneBitKeys:
    # -- onebit_adam, zero_one_adam (docs/optimizers.md; DeepSpeed's names) --
    # onebit_adam: steps of plain AdamW (fp32 all-reduce) before the variance freezes and the momenta go 1-bit
    # (0: 6.5% of training.steps, which kept the loss within 2% of AdamW's at 90% fewer bytes);
    # zero_one_adam: the last step that may update the variance (0: optimizer.warmup_steps, the learning-rate warm-up)
    freeze_step: int = 0
    var_update_scaler: int = 16  # zero_one_adam: variance updates at each interval before it doubles (kappa)
    local_step_scaler: int = 32678  # zero_one_adam: steps after the freeze before the local-step interval doubles
    local_step_clipper: int = 16  # zero_one_adam: the largest local-step interval (H)


@dataclass(frozen=True)
class OneBitAdam(Capability):
    """On for an optimizer that communicates itself (onebit_adam, zero_one_adam: `OptimizerEntry.communicates`;
    `implied_by`)."""

    name = "onebit_adam"
    adds_to = ("optimizer", OneBitKeys)

    @classmethod
    def implied_by(cls, recipe) -> bool:
        return cls.communicating(recipe.optimizer)

    @staticmethod
    def communicating(name: str) -> bool:
        """`name` is an optimizer that communicates itself (built in: paratrain/optimizers.py). An unknown name is
        refused by whoever reads it, in its words (config.validate)."""
        entry = BUILT_IN.get(name)
        return entry is not None and entry.communicates

    @classmethod
    def check(cls, cfg) -> None:
        o = cfg.optimizer
        if o.freeze_step < 0:
            raise ConfigError("optimizer.freeze_step must be >= 0 (0: the default warm-up)")
        if cls.communicating(o.name) and freeze_step(o, cfg.training.steps) <= 0:
            raise ConfigError(f"optimizer.name={o.name} needs a warm-up of plain Adam steps: set optimizer.freeze_step "
                              "(or optimizer.warmup_steps) > 0")
        if min(o.var_update_scaler, o.local_step_scaler, o.local_step_clipper) < 1:
            raise ConfigError("optimizer.var_update_scaler, local_step_scaler and local_step_clipper must be >= 1")
