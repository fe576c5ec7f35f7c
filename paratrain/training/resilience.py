"""Keeping a run alive: preemption notices, out-of-memory adaptation, the activation-memory budget, and the
guard the training loop consults once per step (`ResilienceGuard`)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from paratrain.distributed.tensors import local_tensor
from paratrain.errors import UserError
from paratrain.faults import InjectedOOM
from paratrain.training.preemption import PreemptionWatch, watching

PREEMPTED_MARKER = "PREEMPTED"
MAX_FRUITLESS_ROLLBACKS = 2  # rollbacks in a row after which not one step was finite: the weights are the problem
# fp16's scaler skips a step whose gradients overflow and halves its scale: 16 skips in a row take its initial scale
# (2^16) to 1, past which skipping cannot help. Such skips count toward a bad streak, with this many allowed.
SCALER_SKIPS = 16


class OutOfMemory(UserError):
    """Out of memory even at micro-batch 1: deterministic, so a restart would fail the same way."""


class MemoryBudgetExceeded(RuntimeError):
    pass


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (InjectedOOM, MemoryBudgetExceeded)):
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


class MemoryBudget:
    """Counts the bytes autograd saves for backward during a forward (each storage once).

    A micro-step whose saved activations exceed the budget is treated as out-of-memory, which makes the
    adaptive-batch path deterministic and testable without a GPU. The check runs after backward, when every
    rank has finished the step's collectives, so all ranks (same shapes, same bytes) react together.
    """

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.saved = 0

    @contextlib.contextmanager
    def track(self):
        seen: set[int] = set()
        self.saved = 0

        def pack(t: torch.Tensor):
            local = local_tensor(t)
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self.saved += local.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def check(self) -> None:
        if self.saved > self.budget:
            raise MemoryBudgetExceeded(f"activations {self.saved / 2**20:.1f} MiB exceed the memory budget "
                                       f"{self.budget / 2**20:.1f} MiB")


def mark_preempted(run_dir, step: int) -> None:
    (run_dir / PREEMPTED_MARKER).write_text(f"{step}\n")


def preempted_since(run_dir, since: float) -> bool:
    marker = run_dir / PREEMPTED_MARKER
    return marker.exists() and marker.stat().st_mtime >= since


class ResilienceGuard:
    """The loop's one contact for what can go wrong in a step: preemption (SIGTERM) and Ctrl-C (SIGINT), out-of-memory (halve the
    micro-batch, double accumulation: same global batch, same loss), and non-finite steps (skip the update;
    after `max_bad_steps` in a row, ask for a rollback)."""

    def __init__(self, cfg, progress, device: torch.device, notice=print, group=None):
        self.cfg, self.progress, self.device, self.notice, self.group = cfg, progress, device, notice, group
        self.preemption: PreemptionWatch | None = None
        self._watching = None
        self.bad_streak: list[int] = []  # data batches of the current run of consecutive non-finite steps
        self.scaler_skips = 0  # of them, fp16 steps whose loss was finite and only the gradients overflowed
        self.fruitless_rollbacks = 0  # rollbacks since the last finite step

    def __enter__(self):
        self._watching = watching(self.cfg.preempt_grace_s)
        self.preemption = self._watching.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._watching.__exit__(*exc)

    def at_boundary(self, save_due: bool = False) -> tuple[bool, bool]:
        """At a step boundary, agreed by every rank (one tiny all-reduce per step): (stop, save) = whether any rank
        got SIGTERM or SIGINT (every rank then stops here; one that learns of it this way starts its own grace period
        too), and whether any rank's `save_due` (the wall-clock checkpoint timer, whose clocks differ by rank) asks
        every rank to save after this step. The flags live in CPU memory and go over gloo (a gloo group of its own
        under nccl), so asking never waits for the device."""
        watch = self.preemption
        mine = [2.0 if watch.interrupted else 1.0 if watch.requested else 0.0, 1.0 if save_due else 0.0]
        if not dist.is_initialized():
            return mine[0] > 0, save_due
        if self.group is None and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # every rank asks at the same first step boundary
        flags = torch.tensor(mine)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop, save = flags.tolist()  # a host read of host memory: no device sync
        if stop == 2.0 and not watch.interrupted:
            watch.interrupt()
        elif stop == 1.0 and not watch.requested:
            watch.notice()
        return stop > 0, save > 0

    def with_oom_adaptation(self, run_step, zero_grad, evidence=None):
        """`run_step()` until it fits: on out-of-memory every rank halves the micro-batch and tries again.
        `evidence(error)` writes what memory held at the error (observe/oom.py) and returns where, or None."""
        while True:
            try:
                return run_step()
            except Exception as e:  # noqa: BLE001 - only out-of-memory errors are handled, the rest re-raised
                if not is_out_of_memory(e):
                    raise
                failed = e
                where = evidence(e) if evidence is not None else None  # the failed step's tensors still held
            zero_grad()
            self._adapt(failed, where)

    def _adapt(self, error: Exception, where=None) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        p = self.progress
        seen = f"; memory snapshot and estimate: {where}" if where else ""
        if p.micro_batch == 1:
            raise OutOfMemory(f"out of memory at micro-batch 1 ({str(error).strip().splitlines()[0]}); the layout "
                              f"does not fit: use more sharding, tensor parallelism or activation checkpointing{seen}")
        old = (p.micro_batch, p.accum_steps)
        p.micro_batch, p.accum_steps = p.micro_batch // 2, p.accum_steps * 2
        if p.micro_batch * p.accum_steps != old[0] * old[1]:
            raise OutOfMemory(f"out of memory at micro-batch {old[0]}, which cannot be halved evenly{seen}")
        self.notice(f"out of memory ({type(error).__name__}): micro-batch {old[0]} x accumulation {old[1]} "
                    f"-> {p.micro_batch} x {p.accum_steps} (global batch unchanged){seen}")

    @staticmethod
    def by_scaler(values) -> bool:
        """fp16 (the step ran at a loss scale): a finite loss whose gradients overflowed is the scaler's to skip (no
        forward to replay)."""
        return not values.finite and values.loss_scale is not None and math.isfinite(values.loss)

    def after_update(self, step: int, values, data_step: int, detail: str = "") -> list[int] | None:
        """Count a non-finite step (`values`: its StepValues; its update was skipped on every rank: loss and norm are
        global); `detail` ends its notice (what the numerics watch found). Returns the bad batches to roll back past
        once `max_bad_steps` came in a row, else None. fp16 skips by the scaler (`by_scaler`) end a streak only at
        SCALER_SKIPS in a row."""
        if values.finite:
            self.bad_streak, self.fruitless_rollbacks, self.scaler_skips = [], 0, 0
            return None
        self.progress.skipped += 1
        self.bad_streak.append(data_step)
        by_scaler = self.by_scaler(values)
        self.scaler_skips += by_scaler
        what = (f"fp16 gradients overflowed at loss scale {values.loss_scale:g}, the scaler skipped the update"
                if by_scaler else "non-finite loss or gradient norm, update skipped")
        self.notice(f"step {step + 1}: {what} ({self.progress.skipped} skipped so far)"
                    + (f"; {detail}" if detail else ""))
        if len(self.bad_streak) - self.scaler_skips < self.cfg.max_bad_steps and self.scaler_skips < SCALER_SKIPS:
            return None
        bad, self.bad_streak, self.scaler_skips = self.bad_streak, [], 0
        self.fruitless_rollbacks += 1
        if self.fruitless_rollbacks > MAX_FRUITLESS_ROLLBACKS:
            # Every batch after the checkpoint fails: its weights overflow, skipping more data cannot help.
            raise UserError(f"{MAX_FRUITLESS_ROLLBACKS} rollbacks in a row were followed by only non-finite steps "
                            f"(step {step + 1}): the checkpoint's weights themselves produce them"
                            + (f"; {detail}" if detail else ""))
        return bad
