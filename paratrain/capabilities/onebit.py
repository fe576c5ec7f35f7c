"""1-bit Adam and 0/1 Adam (docs/optimizers.md; DeepSpeed's names; the optimizers: paratrain/training/onebit.py):
AdamW warm-up steps with fp32 gradients, then momenta (and 0/1 Adam's gradients) averaged by the error-compensated
1-bit all-reduce. Here: their `[optimizer]` keys and the checks of them, their optimizer-table entries (states,
phases, the layouts they refuse; `Capability.optimizers`, placed after sgd in the table by paratrain/capabilities), and
their communication schedule, `MomentumSchedule` (torch-free: the planner reads the entries' phases; the run's GradComm
gets the schedule from the entry's `schedule` factory, through the `gradient_reduction` hook the trainer asks, and never
imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError
from paratrain.layout import Layout
from paratrain.optimizers import GradientReduction, OptimizerEntry, Phase


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


# Their optimizer-table entries: AdamW's moments (0/1 Adam: and its accumulator) and step counts; the phases the
# planner predicts (the last ranks the layouts: the steady state); the schedule their GradComm follows.
ONEBIT_ADAM = OptimizerEntry(
    "onebit_adam", "1-bit Adam: AdamW for optimizer.freeze_step steps, then the variance frozen and the momenta "
    "averaged by the error-compensated 1-bit all-reduce",
    param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step", "variance_steps"), step_tensors=6,
    step_kernels=24, refuses=momentum_layouts, compression="sign_ef",
    phases=(Phase("warm-up: fp32 gradients", GradientReduction.MEAN, True),
            Phase("1-bit momenta", GradientReduction.ONE_BIT, False)),
    schedule=MomentumSchedule.from_config)
ZERO_ONE_ADAM = OptimizerEntry(
    "zero_one_adam", "0/1 Adam: the variance updated on exponentially rarer steps until optimizer.freeze_step, "
    "1-bit gradients between them, then local steps and 1-bit averaged momenta",
    param_state=("exp_avg", "exp_avg_sq", "accumulator"), scalar_state=("step", "variance_steps", "window_lr"),
    step_tensors=7, step_kernels=30, refuses=momentum_layouts, compression="sign_ef",
    phases=(Phase("variance step: fp32 gradients", GradientReduction.MEAN, True),
            Phase("1-bit gradients", GradientReduction.ONE_BIT, True),
            Phase("local step", GradientReduction.LOCAL, False),
            Phase("1-bit momentum sync", GradientReduction.ONE_BIT, False)),
    schedule=MomentumSchedule.from_config)


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
    optimizers = (ONEBIT_ADAM, ZERO_ONE_ADAM)

    @classmethod
    def implied_by(cls, recipe) -> bool:
        return cls.communicating(recipe.optimizer)

    @staticmethod
    def communicating(name: str) -> bool:
        """`name` is an optimizer that communicates itself (this capability's). An unknown name is refused by whoever
        reads it, in its words (config.validate)."""
        return any(e.name == name and e.communicates for e in OneBitAdam.optimizers)

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
