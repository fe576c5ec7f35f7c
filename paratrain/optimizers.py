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

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable

from paratrain.errors import ConfigError
from paratrain.layout import Layout
from paratrain.modes import Compression, GradCompression

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


def momentum_layouts(layout: Layout) -> str | None:
    """Where 1-bit Adam and 0/1 Adam run: every rank holds whole momenta of what it all-reduces (ddp; hsdp's
    dp_replicate dimension, over each rank's FSDP shard)."""
    if layout.dp == 1:
        return (f"averages momenta over data-parallel ranks, but {layout.describe()} has no data parallelism; use it "
                "with dp_mode=ddp (or hsdp) over several ranks")
    if layout.zero1:
        return ("keeps every parameter's momentum on every rank (each rank's comes from its own gradient), but "
                "dp_mode=zero1 keeps a parameter's optimizer state on one rank only: use dp_mode=ddp")
    if layout.uses_fsdp and not layout.hybrid:
        return (f"all-reduces momenta (ddp, or hsdp's dp_replicate dimension); dp_mode={layout.dp_mode} shards every "
                "momentum over the ranks that would average it: use dp_mode=ddp, or hsdp with dp_replicate > 1")
    if layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.cp > 1:
        return "supports no tp, pp, ep or cp (its all-reduce needs one data-parallel group of dense replicas)"
    return None


# 1-bit Adam's default warm-up, a share of the run: 6.5% met the goal (>= 90% fewer bytes than AdamW, val loss
# within 2%) at 2000 and at 6000 steps, where the learning-rate warm-up's 5% ended above it (bench/RESULTS.md
# 2026-12-01; each fp32 step costs ~32 compressed ones, so the bytes goal allows ~6.8% at most).
ONEBIT_WARMUP_SHARE = 0.065


def freeze_step(cfg, steps: int) -> int:
    """F, the last warm-up step (from 1) of 1-bit Adam or 0/1 Adam for an OptimizerConfig in a run of `steps`
    optimizer steps: optimizer.freeze_step, or when 0, 6.5% of `steps` for onebit_adam (at least 1) and the
    learning-rate warm-up for zero_one_adam (DeepSpeed's advice for its variance freeze)."""
    if cfg.freeze_step:
        return cfg.freeze_step
    if cfg.name == "onebit_adam":
        return max(1, round(ONEBIT_WARMUP_SHARE * steps))
    return cfg.warmup_steps


@dataclass(frozen=True)
class MomentumSchedule:
    """What 1-bit Adam and 0/1 Adam communicate at each optimizer step (`step` 0-based, the run's count; s = step + 1
    below, as the papers and DeepSpeed count). F = `freeze`.

    1-bit Adam (Tang et al. 2021): steps s <= F are AdamW with the gradients' fp32 all-reduce ("mean"); after them
    the variance is frozen, gradients stay on their rank ("local"), and each rank's momentum (updated from its own
    gradient) is averaged by the error-compensated 1-bit all-reduce every step.

    0/1 Adam (Lu et al. 2022, arXiv 2202.06009; DeepSpeed's ZeroOneAdam): up to F the variance is updated only on
    the steps of T_v, which thin out exponentially: every step for the first `var_update_scaler` (kappa) updates,
    then every 2nd step for kappa more, every 4th, ... (s a multiple of the interval). Those steps all-reduce the
    gradients in fp32; the others 1-bit all-reduce them (error feedback) and update only the momentum. After F the
    variance is frozen and the ranks take local steps: each updates its momentum from its own gradient and its
    parameters by it, and only every `local_interval` steps are the accumulated updates averaged by the 1-bit
    all-reduce (T_u). The interval starts at 1 and doubles every `local_step_scaler` steps after F, up to
    `local_step_clipper` (H)."""

    zero_one: bool
    freeze: int
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16

    @classmethod
    def from_config(cls, cfg, steps: int) -> "MomentumSchedule":
        """For an OptimizerConfig in a run of `steps` optimizer steps (`freeze_step`)."""
        return cls(cfg.name == "zero_one_adam", freeze_step(cfg, steps), cfg.var_update_scaler,
                   cfg.local_step_scaler, cfg.local_step_clipper)

    def frozen(self, step: int) -> bool:
        return step + 1 > self.freeze

    def variance_step(self, step: int) -> bool:
        """Whether this step updates the variance (from all-reduced fp32 gradients)."""
        s = step + 1
        if s > self.freeze:
            return False
        if not self.zero_one:
            return True
        end, interval = 0, 1  # T_v: blocks of kappa multiples of 1, 2, 4, ... each after the last one's end
        while True:
            first = (end // interval + 1) * interval
            last = first + (self.var_update_scaler - 1) * interval
            if s <= last:
                return s >= first and s % interval == 0
            end, interval = last, 2 * interval

    def gradient(self, step: int) -> GradientReduction:
        """What the gradient hook does this step (LOCAL after the freeze: the optimizer communicates the momenta)."""
        if self.frozen(step):
            return GradientReduction.LOCAL
        return GradientReduction.MEAN if self.variance_step(step) else GradientReduction.ONE_BIT

    def local_interval(self, step: int) -> int:
        k = step + 1 - self.freeze  # steps since the freeze, from 1
        return min(self.local_step_clipper, 1 << min(30, (k - 1) // self.local_step_scaler))

    def sync(self, step: int) -> bool:
        """Whether this step averages the momenta (the accumulated updates) by the 1-bit all-reduce."""
        if not self.frozen(step):
            return False
        return not self.zero_one or (step + 1) % self.local_interval(step) == 0

    def resets_residuals(self, step: int) -> bool:
        """0/1 Adam's first step after the freeze: the error feedback of the gradients' 1-bit all-reduce does not
        carry over to the momenta's."""
        return self.zero_one and step + 1 == self.freeze + 1


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
    # The compressed all-reduce the optimizer runs itself (sign_ef: 1-bit Adam's, of the momentum), with a
    # MomentumSchedule saying when; "none": the gradients' reduction is parallel.grad_compression's.
    compression: GradCompression = "none"
    phases: tuple[Phase, ...] = ()  # its kinds of steps (the planner ranks layouts by the last: the steady state)
    element_bytes: float = FP32  # bytes per element of each param_state tensor (low-memory states: bf16, 8-bit)
    # An optimizer that updates the blocks' hidden matrices (Param.hidden_matrix) on their own: the state they keep
    # (their parameter group is marked HIDDEN_STATE), the others keeping param_state and scalar_state (AdamW's; None:
    # every parameter keeps param_state)
    hidden_state: tuple[str, ...] | None = None
    hidden_step_tensors: int = 0  # parameter-sized tensors one update of a hidden matrix reads and writes
    # why it cannot take a parallel.grad_compression method (the method, the key that set it) -> one line (None: it can)
    refuses_compression: Callable[[str, str], str | None] = any_compression

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
        """It runs its own compressed all-reduce (and parallel.grad_compression must stay none)."""
        return Compression(self.compression).enabled

    def run_compression(self, comp: Compression) -> Compression:
        """The compressed collective a run holds state for: `comp` (parallel.grad_compression and its settings), or
        this optimizer's own with comp's settings (sign_ef_block)."""
        return dataclasses.replace(comp, method=self.compression) if self.communicates else comp

    def phase_compression(self, phase: Phase, comp: Compression) -> Compression:
        """What one of its phases' reductions sends: its 1-bit all-reduce, else the uncompressed one."""
        own = phase.reduction is GradientReduction.ONE_BIT
        return self.run_compression(comp) if own else dataclasses.replace(comp, method=Compression().method)

    def check_compression(self, grad_compression: str, key: str = "parallel.grad_compression") -> None:
        if self.communicates and Compression(grad_compression).enabled:
            raise ConfigError(f"optimizer.name={self.name} compresses its own communication (the momentum's 1-bit "
                              f"all-reduce): {key} must be none, got {grad_compression}")
        reason = self.refuses_compression(grad_compression, key)
        if reason:
            raise ConfigError(f"optimizer.name={self.name} {reason}")

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
    "onebit_adam": OptimizerEntry(
        "onebit_adam", "1-bit Adam: AdamW for optimizer.freeze_step steps, then the variance frozen and the momenta "
        "averaged by the error-compensated 1-bit all-reduce",
        param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step", "variance_steps"), step_tensors=6,
        step_kernels=24, refuses=momentum_layouts, compression="sign_ef",
        phases=(Phase("warm-up: fp32 gradients", GradientReduction.MEAN, True), Phase("1-bit momenta", GradientReduction.ONE_BIT, False))),
    "zero_one_adam": OptimizerEntry(
        "zero_one_adam", "0/1 Adam: the variance updated on exponentially rarer steps until optimizer.freeze_step, "
        "1-bit gradients between them, then local steps and 1-bit averaged momenta",
        param_state=("exp_avg", "exp_avg_sq", "accumulator"), scalar_state=("step", "variance_steps", "window_lr"),
        step_tensors=7, step_kernels=30, refuses=momentum_layouts, compression="sign_ef",
        phases=(Phase("variance step: fp32 gradients", GradientReduction.MEAN, True), Phase("1-bit gradients", GradientReduction.ONE_BIT, True),
                Phase("local step", GradientReduction.LOCAL, False), Phase("1-bit momentum sync", GradientReduction.ONE_BIT, False))),
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
