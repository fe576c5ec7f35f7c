"""The optimizer registry: `optimizer.name` selects an `OptimizerEntry`, the one description of an optimizer.

An entry says how the trainer builds it (`builder`: an import path "module:function", loaded lazily so that this
table stays torch-free; the estimator and the planner read it), what it keeps per parameter (the estimator's
optimizer states, and the template a ZeRO-1 checkpoint is loaded into), what one step reads and writes (the
planner's optimizer-step cost) and the layouts it refuses (one line each). `paratrain/training/optim.py` builds any
entry on any layout: plain and FSDP2 (DTensor) parameters directly, ZeRO-1 by handing the entry's class to torch's
ZeroRedundancyOptimizer.

Adding an optimizer is one entry in `OPTIMIZERS` and its builder, a function (OptimizerConfig, torch.device) ->
(optimizer class, keyword arguments) that the class is constructed with (after the parameter groups).
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Callable

from paratrain.errors import ConfigError
from paratrain.layout import Layout

FP32 = 4


def any_layout(layout: Layout) -> str | None:
    return None


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    summary: str  # one line, for --help and the README
    builder: str  # "module:function" -> (optimizer class, kwargs), see the module docstring
    param_state: tuple[str, ...]  # fp32 state tensors shaped like the parameter (ZeRO-1's checkpoint template)
    scalar_state: tuple[str, ...] = ()  # fp32 0-dim state tensors per parameter (step counters)
    step_tensors: int = 0  # parameter-sized fp32 tensors one update reads and writes (parameter, gradient, state)
    step_kernels: int = 0  # kernel launches of one update (foreach sweeps over the two parameter groups)
    foreach_temporary: bool = False  # its foreach implementation allocates one parameter group's size
    refuses: Callable[[Layout], str | None] = any_layout  # why it cannot run on a layout (None: it can)
    element_bytes: float = FP32  # bytes per element of each param_state tensor (low-memory states: bf16, 8-bit)

    @property
    def state_bytes(self) -> float:
        """Bytes kept per parameter element between steps."""
        return self.element_bytes * len(self.param_state)

    @property
    def tensor_state_bytes(self) -> int:
        """Bytes kept per parameter tensor (step counters)."""
        return FP32 * len(self.scalar_state)

    @property
    def step_bytes(self) -> int:
        """Bytes one update reads and writes per parameter element (the planner's optimizer step)."""
        return 2 * FP32 * self.step_tensors

    def check_layout(self, layout: Layout) -> None:
        reason = self.refuses(layout)
        if reason:
            raise ConfigError(f"optimizer.name={self.name} {reason}")

    def load_builder(self) -> Callable:
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(
        "adamw", "AdamW (torch.optim.AdamW): decoupled weight decay on matrices, fused / foreach / for",
        "paratrain.training.optim:adamw", param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",),
        step_tensors=4, step_kernels=20, foreach_temporary=True),
    "sgd": OptimizerEntry(
        "sgd", "SGD with momentum optimizer.beta1 (torch.optim.SGD): weight decay as an L2 term on matrices",
        "paratrain.training.optim:sgd", param_state=("momentum_buffer",), step_tensors=3, step_kernels=8,
        foreach_temporary=True),
}


def _no_zero1(layout: Layout) -> str | None:
    return ("keeps low-precision states that ZeRO-1's fp32 partitions cannot hold: use dp_mode zero2 or fsdp (the "
            "state is sharded there too)" if layout.zero1 else None)


# Low-memory optimizer states (README "Memory tiers"): the same AdamW update from moments kept in fewer bits.
OPTIMIZERS["adamw-bf16"] = OptimizerEntry(
    "adamw-bf16", "AdamW with both moments kept in bf16 (paratrain.training.optim.BF16AdamW): half AdamW's state",
    "paratrain.training.optim:adamw_bf16", param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",),
    step_tensors=3, step_kernels=8, refuses=_no_zero1, element_bytes=2)
OPTIMIZERS["adamw8bit"] = OptimizerEntry(
    "adamw8bit", "torchao's AdamW8bit: both moments in 8 bits with an fp32 scale per 256 values (pip install "
    "torchao)", "paratrain.training.optim:adamw8bit", param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",),
    step_tensors=3, step_kernels=4, refuses=_no_zero1, element_bytes=1 + 4 / 256)
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer_entry(name: str) -> OptimizerEntry:
    """The registered optimizer `name`, or a one-line ConfigError naming the known ones."""
    entry = OPTIMIZERS.get(name)
    if entry is None:
        close = difflib.get_close_matches(str(name), OPTIMIZER_NAMES, n=1)
        raise ConfigError(f"optimizer.name: '{name}' is not one of {', '.join(OPTIMIZER_NAMES)}"
                          + (f" (did you mean '{close[0]}'?)" if close else ""))
    return entry
