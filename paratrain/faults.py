"""Fault injection for resilience tests: real signals and real exceptions at chosen steps.

Set PARATRAIN_FAULTS to a comma-separated list of KIND@STEP[:RANK] (rank omitted: every rank):
    kill@5:1   rank 1 SIGKILLs itself before step 5        (first launch attempt only)
    term@5:0   rank 0 SIGTERMs itself before step 5        (first attempt only; a preemption notice)
    stop@5:1   rank 1 SIGSTOPs itself before step 5        (a hung rank)
    hang@5:1   rank 1 SIGSTOPs itself in the middle of step 5's forward, in its middle block (its peers wait in a
               collective it never enters)
    oom@5      an out-of-memory error in step 5's forward  (once per process)
    overflow@5 the middle block's attention output projection is scaled to max |w| = 1e38 before step 5 (once per
               process): that block's output overflows (bf16 and fp32 end at 3.4e38)
    nan@5      the loss of data batch 5 becomes NaN        (every time that batch is used: bad data)
    slowsave@10    the write of step 10's checkpoint pauses SLOW_SAVE_S before its files, on the thread that writes
               them (with checkpoint.async_save the background one: training goes on meanwhile)
    killsave@10:1  rank 1 SIGKILLs itself in the middle of the write of step 10's checkpoint, on the thread that
               writes it: its shards written, the metadata not (first launch attempt only)
Steps count from 0 (the optimizer step index); nan counts data batches, which differ from steps
once bad batches have been skipped; slowsave and killsave name the checkpoint's step (step-10).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from paratrain.distributed.launch import ATTEMPT_ENV, attempt  # ATTEMPT_ENV: set by our launcher

ENV = "PARATRAIN_FAULTS"
SLOW_SAVE_S = 3.0  # slowsave's pause: long enough for a test to act while the write is in flight


class InjectedOOM(RuntimeError):
    """Stands in for torch.cuda.OutOfMemoryError on machines without CUDA."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, rest = item.partition("@")
        step, _, rank = rest.partition(":")
        kinds = ("kill", "term", "stop", "hang", "oom", "overflow", "nan", "slowsave", "killsave")
        if kind not in kinds or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"bad {ENV} entry '{item}' (expected KIND@STEP[:RANK])")
        faults.append(Fault(kind, int(step), int(rank) if rank else None))
    return faults


class FaultInjector:
    def __init__(self, rank: int):
        self.rank = rank
        self.faults = [f for f in parse(os.environ.get(ENV, "")) if f.rank in (None, rank)]
        self.first_attempt = attempt() == 0
        self.fired: set[Fault] = set()

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _due(self, kind: str, step: int) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and f.step == step and f not in self.fired), None)

    def before_step(self, step: int, settle=None) -> None:
        """`settle`: called before a signal is sent (the trainer's: wait for the background save in flight), so which
        checkpoint a test finds does not depend on the save thread's timing (killsave kills in the middle of one)."""
        signals = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
        for kind, sig in signals.items():
            fault = self._due(kind, step)
            if fault and (self.first_attempt or kind == "stop"):
                self.fired.add(fault)
                if settle is not None:
                    settle()
                os.kill(os.getpid(), sig)

    def _fire(self, kind: str, step: int) -> bool:
        fault = self._due(kind, step)
        if fault:
            self.fired.add(fault)
        return fault is not None

    def during_step(self, step: int, train_step) -> None:
        """Faults inside step `step`, before its forward: out-of-memory, an overflowing weight, a stop mid-forward."""
        if self._fire("oom", step):
            # step + 1: as the progress lines and the OOM evidence count steps (PARATRAIN_FAULTS counts from 0)
            raise InjectedOOM(f"injected out-of-memory in step {step + 1}")
        if self._fire("overflow", step):
            _overflow(train_step)
        if self._fire("hang", step):
            _stop_mid_forward(train_step)

    def in_save_write(self, step: int, written: bool) -> None:
        """On the thread writing checkpoint step-`step`: before this rank's shards (slowsave) and after them, before
        the metadata (killsave)."""
        if not written and self._fire("slowsave", step):
            time.sleep(SLOW_SAVE_S)
        if written and self.first_attempt and self._fire("killsave", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def poison(self, data_step: int) -> bool:
        return any(f.kind == "nan" and f.step == data_step for f in self.faults)


def _middle_block(train_step) -> tuple[str, object]:
    """(name, module) of the middle block of the model among those this rank holds."""
    # lazy: torch is loaded only when a fault is injected
    from paratrain.distributed.initialize import canonical_name
    # lazy: torch is loaded only when a fault is injected
    from paratrain.observe.numerics import forward_modules

    modules = forward_modules(train_step)
    n = modules[0].args.n_layers
    blocks = {canonical_name(f"layers.{k}"): b for m in modules for k, b in m.layers.items()}
    name = f"layers.{n // 2}" if f"layers.{n // 2}" in blocks else sorted(blocks)[0]
    return name, blocks[name]


def _overflow(train_step) -> None:
    # lazy: torch is loaded only when a fault is injected
    import torch

    # lazy: torch is loaded only when a fault is injected
    from paratrain.distributed.tensors import local_tensor

    _, block = _middle_block(train_step)
    weight = next(p for name, p in block.named_parameters() if name.endswith("attention.wo.weight"))
    with torch.no_grad():
        w = local_tensor(weight)
        w.mul_(1e38 / w.abs().max().clamp(min=1e-30))


def _stop_mid_forward(train_step) -> None:
    _, block = _middle_block(train_step)

    def stop(module, args):
        handle.remove()
        os.kill(os.getpid(), signal.SIGSTOP)

    handle = block.register_forward_pre_hook(stop)
