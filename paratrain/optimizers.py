"""The optimizer table's entries: `optimizer.name` selects an `OptimizerEntry`, the one description of an optimizer.

An entry says what the optimizer keeps per parameter (the estimator's
optimizer states, and the template a ZeRO-1 checkpoint is loaded into), what one step reads and writes (the
planner's optimizer-step cost) and the layouts it refuses (one line each). `paratrain/training/optim.py` builds any
entry on any layout: plain and FSDP2 (DTensor) parameters directly, ZeRO-1 by handing the entry's class to torch's
ZeroRedundancyOptimizer.

`BUILT_IN` holds the entries shipped here; a capability brings its optimizer's own (`Capability.optimizers`), and
`paratrain.capabilities.OPTIMIZERS` is the whole table (`optimizer_entry` looks a name up there). The table is
torch-free (the estimator and the planner read it); the builders live on the torch side, in
`paratrain/training/optim.py`'s `BUILDERS` (imported there, by name of the entry). Adding an optimizer is one entry
and its builder there, a function (OptimizerConfig, torch.device, comm, **context) -> (optimizer class, keyword
arguments) that the class is constructed with (after the parameter groups); `context` holds the run's precision, the
replica mesh and AdamW's keyword arguments (for an optimizer that steps some parameters with AdamW; the others ignore
them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from paratrain.errors import ConfigError
from paratrain.layout import Layout

FP32 = 4
HIDDEN_STATE = "hidden_state"  # the parameter-group key of the hidden matrices' group (OptimizerEntry.hidden_state)


class GradientReduction(enum.Enum):
    """What a step of 1-bit Adam or 0/1 Adam does with the data-parallel ranks' gradients or momenta."""

    MEAN = "fp32 all-reduce"
    ONE_BIT = "1-bit all-reduce with error feedback"
    LOCAL = "nothing: each rank keeps its own"


@dataclass(frozen=True)
class Phase:
    """One kind of step of an optimizer that communicates itself, for the planner: its data-parallel reduction, run
    by a gradient hook during the backward (`in_backward`) or by the optimizer step after it (exposed)."""

    name: str
    reduction: GradientReduction
    in_backward: bool


def any_layout(layout: Layout) -> str | None:
    return None


def any_compression(method: str, key: str) -> str | None:
    return None


@dataclass(frozen=True)
class OptimizerEntry:
    name: str  # its key in the table (and in training/optim.py's BUILDERS)
    summary: str  # one line, for --help and docs/configuration.md
    param_state: tuple[str, ...]  # fp32 state tensors shaped like the parameter (ZeRO-1's checkpoint template)
    scalar_state: tuple[str, ...] = ()  # fp32 0-dim state tensors per parameter (step counters)
    step_tensors: int = 0  # parameter-sized fp32 tensors one update reads and writes (parameter, gradient, state)
    step_kernels: int = 0  # kernel launches of one update (foreach sweeps over the two parameter groups)
    foreach_temporary: bool = False  # its foreach implementation allocates one parameter group's size
    refuses: Callable[[Layout], str | None] = any_layout  # why it cannot run on a layout (None: it can)
    # The compressed all-reduce the optimizer runs itself (a gradient compression method, capabilities/: sign_ef, 1-bit
    # Adam's, of the momentum), with its `schedule` saying when; "none": the gradients' reduction is `[parallel]`'s.
    compression: str = "none"
    phases: tuple[Phase, ...] = ()  # its kinds of steps (the planner ranks layouts by the last: the steady state)
    element_bytes: float = FP32  # bytes per element of each param_state tensor (low-memory states: bf16, 8-bit)
    # An optimizer that updates the blocks' hidden matrices (Param.hidden_matrix) on their own: the state they keep
    # (their parameter group is marked HIDDEN_STATE), the others keeping param_state and scalar_state (AdamW's; None:
    # every parameter keeps param_state)
    hidden_state: tuple[str, ...] | None = None
    hidden_step_tensors: int = 0  # parameter-sized tensors one update of a hidden matrix reads and writes
    # why it cannot take a gradient compression method (the method, the key that set it) -> one line (None: it can)
    refuses_compression: Callable[[str, str], str | None] = any_compression
    # An optimizer that communicates itself: (OptimizerConfig, the run's optimizer steps) -> its schedule (a
    # capability's, e.g. 1-bit Adam's MomentumSchedule), which the run's GradComm follows step by step (`gradient`:
    # a GradientReduction, `resets_residuals`); gradient compression's `gradient_reduction` hook makes it for the trainer.
    schedule: Callable[[object, int], object] | None = None

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

    @property
    def communicates(self) -> bool:
        """It runs its own compressed all-reduce on its schedule (and the gradients' compression must stay none:
        `Compression.check_optimizer`, paratrain/capabilities)."""
        return self.schedule is not None

    def hidden_state_bytes(self) -> float:
        """Bytes kept per element of a hidden matrix between steps (`state_bytes` where it has no hidden_state)."""
        return self.state_bytes if self.hidden_state is None else self.element_bytes * len(self.hidden_state)

    def hidden_tensor_state_bytes(self) -> int:
        return self.tensor_state_bytes if self.hidden_state is None else 0



BUILT_IN: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(
        "adamw", "AdamW (torch.optim.AdamW): decoupled weight decay on matrices, fused / foreach / for",
        param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",), step_tensors=4, step_kernels=20,
        foreach_temporary=True),
    "sgd": OptimizerEntry(
        "sgd", "SGD with momentum optimizer.beta1 (torch.optim.SGD): weight decay as an L2 term on matrices",
        param_state=("momentum_buffer",), step_tensors=3, step_kernels=8, foreach_temporary=True),
}


def no_zero1(layout: Layout) -> str | None:
    return ("keeps low-precision states that ZeRO-1's fp32 partitions cannot hold: use dp_mode zero2 or fsdp (the "
            "state is sharded there too)" if layout.zero1 else None)


# Low-memory optimizer states (docs/memory-tiers.md): the same AdamW update from moments kept in fewer bits (8 bits:
# torchao's, a capability module in paratrain/capabilities/).
BUILT_IN["adamw-bf16"] = OptimizerEntry(
    "adamw-bf16", "AdamW with both moments kept in bf16 (paratrain.training.optim.BF16AdamW): half AdamW's state",
    param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",),
    step_tensors=3, step_kernels=8, refuses=no_zero1, element_bytes=2)
