"""8-bit optimizer states (`optimizer.name = "adamw8bit"`, docs/memory-tiers.md): torchao's AdamW8bit keeps both
moments in 8 bits with an fp32 scale per block of 256 values, about a quarter of AdamW's state. Here: its
optimizer-table entry (what it keeps and what one step reads and writes: the estimator's and the planner's terms) and
its check that torchao is there, before any process starts. Its builder is training/optim.py's `eight_bit_adamw`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError
from paratrain.optimizers import OptimizerEntry, no_zero1

ENTRY = OptimizerEntry(
    "adamw8bit", "torchao's AdamW8bit: both moments in 8 bits with an fp32 scale per 256 values (pip install "
    "torchao)", param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",),
    step_tensors=3, step_kernels=4, refuses=no_zero1, element_bytes=1 + 4 / 256)
MISSING = f"optimizer.name={ENTRY.name} needs torchao, which is not installed (pip install torchao)"


@dataclass(frozen=True)
class EightBitAdam(Capability):
    """On when optimizer.name = "adamw8bit" (`implied_by`); AdamW's `[optimizer]` keys are its settings."""

    name = ENTRY.name
    optimizers = (ENTRY,)

    @classmethod
    def implied_by(cls, recipe) -> bool:
        return recipe.optimizer == ENTRY.name

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.optimizer.name == ENTRY.name and importlib.util.find_spec("torchao") is None:
            raise ConfigError(MISSING)
