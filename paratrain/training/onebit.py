"""1-bit Adam and 0/1 Adam (registry entries `onebit_adam`, `zero_one_adam`): Adam whose data-parallel communication
after a warm-up is the error-compensated 1-bit all-reduce of the momentum, not the gradients' fp32 all-reduce.

When a step communicates what is `paratrain.capabilities.onebit.MomentumSchedule` (torch-free, the planner reads it
too). The run's `GradComm` (paratrain/distributed/compression.py) carries it out: its gradient hook takes the fp32
mean, the 1-bit mean or nothing (each rank keeps its own gradient), and `momentum_mean_` averages momenta with
sign_ef's compressor (signs and scales, worker and server residuals).

The update is AdamW's (bias-corrected moments, decoupled weight decay on matrices; torch's foreach arithmetic), with:
- the variance updated only on the schedule's variance steps, from all-reduced gradients; its bias correction counts
  those updates (`variance_steps`), so after the freeze the denominator stays what it was;
- 1-bit Adam after the freeze: m <- b1 m + (1 - b1) g with this rank's own g, then m <- the 1-bit mean of every
  rank's m, then p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps). Every rank decompresses the same bytes, so m
  and p stay the same on every rank;
- 0/1 Adam after the freeze: each rank steps with its own momentum (a local step) and adds lr m_hat to its
  `accumulator`; on a sync step the window's local steps are undone (p += accumulator / denominator), the
  accumulators are averaged by the 1-bit all-reduce and applied (p -= mean / denominator), and the momentum becomes
  their learning-rate-weighted mean (m_hat = mean / the window's summed lr): DeepSpeed's ZeroOneAdam, in AdamW's form.

State: exp_avg, exp_avg_sq (0/1 Adam: and the accumulator) per parameter, and the counts `step`, `variance_steps`
(0/1 Adam: `window_lr`, the learning rates since the last sync) as CPU scalars, in the optimizer state that DCP saves
name-keyed like AdamW's; made when the optimizer is built, so a checkpoint loads into existing state. What differs
between ranks goes into the checkpoint per rank beside the residuals (`rank_state`): 0/1 Adam's momentum,
accumulator and parameters while a window of local steps is open.
"""

from __future__ import annotations

import math

import torch

from paratrain.distributed.tensors import local_tensor
from paratrain.errors import UserError

SCALARS = ("step", "variance_steps", "window_lr")


class OneBitAdam(torch.optim.Optimizer):
    """Both optimizers; `schedule.zero_one` picks 0/1 Adam. Param groups carry `weight_decay`."""

    RANK_KINDS = ("exp_avg", "accumulator", "param")  # per-rank checkpoint entries (GradComm.attach_optimizer)

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, schedule, comm):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.schedule, self.comm = schedule, comm
        names = comm.parameter_names()
        self.names = {p: names[id(p)] for group in self.param_groups for p in group["params"]}
        for p in self.names:
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq") + (("accumulator",) if schedule.zero_one else ()):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in SCALARS[:3 if schedule.zero_one else 2]:
                state[key] = torch.zeros((), dtype=torch.float32)
        comm.attach_optimizer(self)

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch moves 0-dim state other than "step" to the parameter's device
            for key in SCALARS:
                if key in state:
                    state[key] = state[key].cpu()

    def _group(self, group, *keys):
        """(parameters with a gradient, their local tensors, the gradients', and each state key's)."""
        params = [p for p in group["params"] if p.grad is not None]
        return (params, [local_tensor(p) for p in params], [local_tensor(p.grad) for p in params],
                *([local_tensor(self.state[p][k]) for p in params] for k in keys))

    def _denominators(self, group, params):
        """sqrt(v / (1 - b2^n)) + eps per parameter, n its variance updates (torch's foreach AdamW arithmetic)."""
        b2 = group["betas"][1]
        v = [local_tensor(self.state[p]["exp_avg_sq"]) for p in params]
        out = torch._foreach_sqrt(v)
        torch._foreach_div_(out, [math.sqrt(1 - b2 ** float(self.state[p]["variance_steps"])) for p in params])
        torch._foreach_add_(out, group["eps"])
        return out

    def _bias1(self, group, params) -> list[float]:
        return [1 - group["betas"][0] ** float(self.state[p]["step"]) for p in params]

    @torch.no_grad()
    def step(self, closure=None):
        sched, t = self.schedule, self.comm.step
        variance, frozen = sched.variance_step(t), sched.frozen(t)
        for group in self.param_groups:  # the moments, from this step's gradients (all-reduced or this rank's)
            b1, b2 = group["betas"]
            params, _, g, m, v = self._group(group, "exp_avg", "exp_avg_sq")
            for p in params:
                self.state[p]["step"] += 1
                if variance:
                    self.state[p]["variance_steps"] += 1
            torch._foreach_lerp_(m, g, 1 - b1)
            if variance:
                torch._foreach_mul_(v, b2)
                torch._foreach_addcmul_(v, g, g, 1 - b2)
        if frozen and sched.zero_one:
            return self._local_step(sched.sync(t))
        if frozen:  # 1-bit Adam: every rank's momentum, averaged
            named = []
            for group in self.param_groups:
                params, _, _, m = self._group(group, "exp_avg")
                named += [(self.names[p], t) for p, t in zip(params, m)]
            self.comm.momentum_mean_(named)
        for group in self.param_groups:
            params, x, _, m = self._group(group, "exp_avg")
            if group["weight_decay"]:
                torch._foreach_mul_(x, 1 - group["lr"] * group["weight_decay"])
            denom = self._denominators(group, params)
            torch._foreach_addcdiv_(x, m, denom, [-group["lr"] / b for b in self._bias1(group, params)])

    def _local_step(self, sync: bool) -> None:
        """0/1 Adam after the freeze: a local step, or (sync) the window's accumulated updates averaged."""
        named = []
        for group in self.param_groups:
            lr = group["lr"]
            params, x, _, m, acc = self._group(group, "exp_avg", "accumulator")
            if group["weight_decay"]:
                torch._foreach_mul_(x, 1 - lr * group["weight_decay"])
            denom = self._denominators(group, params)
            part = torch._foreach_mul(m, [lr / b for b in self._bias1(group, params)])  # this step's lr m_hat
            if not sync:
                torch._foreach_addcdiv_(x, part, denom, -1.0)
            elif params and float(self.state[params[0]]["window_lr"]) > 0:
                torch._foreach_addcdiv_(x, acc, denom, 1.0)  # undo the window's local steps
            torch._foreach_add_(acc, part)
            for p in params:
                self.state[p]["window_lr"] += lr
            named += [(self.names[p], a) for p, a in zip(params, acc)]
        if not sync:
            self.comm.silent_round(sum(a.numel() for _, a in named))
            return
        self.comm.momentum_mean_(named)
        for group in self.param_groups:
            params, x, _, m, acc = self._group(group, "exp_avg", "accumulator")
            torch._foreach_addcdiv_(x, acc, self._denominators(group, params), -1.0)
            # the momentum: the mean of m_hat over the window (lr-weighted) and the ranks, biased again
            torch._foreach_mul_(acc, [b / float(self.state[p]["window_lr"])
                                      for p, b in zip(params, self._bias1(group, params))])
            torch._foreach_copy_(m, acc)
            torch._foreach_zero_(acc)
            for p in params:
                self.state[p]["window_lr"].zero_()

    # -- per-rank state (GradComm checkpoints it with the residuals) ------------------------------------------------
    def _window_open(self) -> bool:
        return self.schedule.zero_one and any(float(self.state[p]["window_lr"]) > 0 for p in self.names)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What differs between ranks: 0/1 Adam's momentum, accumulator and parameters inside a window of local
        steps (nothing otherwise: then every rank holds the same)."""
        if not self._window_open():
            return {}
        out = {}
        for p, name in self.names.items():
            out[f"{name}|exp_avg"] = local_tensor(self.state[p]["exp_avg"])
            out[f"{name}|accumulator"] = local_tensor(self.state[p]["accumulator"])
            out[f"{name}|param"] = local_tensor(p.detach())
        return out

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's entries of a checkpoint (`rank_state`'s keys), each checked against this run's tensors."""
        by_name = {name: p for p, name in self.names.items()}
        for key, value in state.items():
            name, kind = key.rsplit("|", 1)
            p = by_name.get(name)
            target = None if p is None else local_tensor(p if kind == "param" else self.state[p][kind])
            if target is None or target.shape != value.shape:
                raise UserError(f"checkpoint entry {key} ({tuple(value.shape)}) matches no tensor of this run")
            target.copy_(value)


def build(cfg, device: torch.device, comm, **_):
    """The registry's builder for both entries (the schedule is the GradComm's, made from the same config)."""
    if comm is None or comm.schedule is None:
        raise ValueError(f"optimizer.name={cfg.name} needs the run's GradComm on a data-parallel layout")
    return OneBitAdam, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, schedule=comm.schedule, comm=comm)
