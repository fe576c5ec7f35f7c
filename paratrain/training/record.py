"""The metrics record of one optimizer step: what `MetricsLog` hands to every sink (progress display, JSONL,
TensorBoard, Prometheus). Built on every rank: the MoE, pipeline and memory numbers are collectives.

A step's record is made in two halves so that the hot path never waits for the device: `record()` right after the
step keeps the loss, the gradient norm, the `finite` flag and the step's timing marks as they are (device tensors
and CUDA events; host floats on a CPU) beside the host-side numbers, in a `PendingRecord`; on a log step `read()`
brings every pending step's tensors to the host in one transfer and `finish()` completes each record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from paratrain.models import count_params
from paratrain.observe.hang import at_step
from paratrain.observe.profile import StepProfiler, gather_rows
from paratrain.observe.sysmetrics import PhaseTimer, gather_rank_stats


class StepClock:
    """Step boundaries without waiting for the device: CUDA timing events on the current stream (their interval is
    read once the device has passed them, on a log step), perf_counter elsewhere (a CPU step has finished when its
    Python returns)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin, end) -> float:
        return begin.elapsed_time(end) / 1000 if self.cuda else end - begin


@dataclass
class StepValues:
    """A step's device numbers, on the host."""
    loss: float
    grad_norm: float
    finite: bool
    loss_scale: float | None = None  # fp16: the scale the step ran at


@dataclass
class PendingRecord:
    step: int
    data_step: int  # the batch this step read
    lr: float
    micro_batch: int
    loss: torch.Tensor  # device scalars: mean over dp x cp, global gradient norm, both finite
    grad_norm: torch.Tensor
    finite: torch.Tensor
    begin: object  # StepClock marks
    end: object
    phases: tuple  # PhaseTimer.take()
    host: dict  # the record's other host-side numbers (data progress, communication, pipeline, saves)
    later: list  # callables reading more of the record's numbers from the device (the MoE statistics)
    loss_scale: torch.Tensor | None = None  # fp16: the scaler's scale the step ran at (a device scalar)
    show: bool = False
    profile_index: int | None = None  # metrics.profile_steps: the step's index in the profiler (StepProfiler.count)


class StepRecorder:
    def __init__(self, spec, train_step, train_data, env, peak_flops: float | None, flops_per_token: float,
                 restarts: int, dp_group, comm=None, message=print):
        """peak_flops: a device peak (datasheet or metrics.peak_tflops) for MFU; None records `mfu` as null."""
        self.spec, self.train_step, self.train_data, self.env = spec, train_step, train_data, env
        self.dp_group = dp_group
        self.comm = comm  # distributed.compression.GradComm: bytes of the gradient reduction
        m = spec.cfg.metrics
        self.profiler = None  # torch.profiler over a window of steps (metrics.profile_steps)
        if m.profile_steps > 0:
            self.profiler = StepProfiler(spec.cfg.run_dir, env.rank, env.world_size, m.profile_start, m.profile_steps,
                                         env.device, message, gather_rows)
        self.peak, self.flops_per_token, self.restarts = peak_flops, flops_per_token, restarts
        self.timer = PhaseTimer()  # splits each step into data wait / comm wait / compute
        self.clock = StepClock(env.device)
        self.first = True
        self.bubble_history: list[list[float]] = []  # pipeline: measured idle fraction per stage rank, per step

    def start(self, step: int):
        """At the top of a step; returns its start mark (and tells a hang record which step this is)."""
        at_step(step)
        if self.comm is not None:
            self.comm.start_step(step)
        if self.profiler is not None:
            self.profiler.begin()
        self.timer.start()
        return self.clock.mark()

    def record(self, step: int, data_step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor,
               finite: torch.Tensor, begin, progress, saved: dict) -> PendingRecord:
        """Right after the step, nothing read from the device. `progress` is the run's Progress, after this step's
        batch (data_step already advanced); `saved` the checkpoint save made since the previous record
        (checkpoint_save_s, checkpoint_step), if any."""
        end = self.clock.mark()
        if self.profiler is not None:
            self.profiler.end()
        host = {}
        host.update(self.train_data.progress(progress.data_step, self.spec.global_batch))  # epochs, tokens/source
        if self.comm is not None:  # comm_bytes, compression_ratio
            host.update(self.comm.step_metrics(progress.accum_steps))
        later = []  # numbers to read on the host at the settle point
        if self.train_step.moe:  # every rank: one small all-reduce of the step's expert load, read later
            later.append(self.train_step.moe.step_stats(self.dp_group))
        later.append(self.train_step.token_loss.step_stats())  # the capabilities' loss terms (z-loss, ...), if any
        if self.train_step.pipeline is not None:  # every rank: one tiny all-gather over the pp group (host times)
            idle = self.train_step.pipeline.measured_bubble()
            self.bubble_history.append(idle)
            host.update(pp_bubble_measured=sum(idle) / len(idle), pp_bubble_per_stage=idle,
                        pp_bubble_predicted=self.spec.layout.predicted_bubble())
        host.update(saved)
        return PendingRecord(step, data_step, lr, progress.micro_batch, loss.detach(), grad_norm.detach(), finite,
                             begin, end, self.timer.take(), host, [f for f in later if f is not None],
                             loss_scale=self.train_step.step_scale,
                             profile_index=self.profiler.count if self.profiler is not None else None)

    @staticmethod
    def read(pending: list[PendingRecord]) -> list[StepValues]:
        """Every pending step's loss, gradient norm and finite flag in one device-to-host transfer (the log step's
        one wait for the device; CUDA events recorded before it have then been passed too)."""
        if not pending:
            return []
        device = pending[0].loss.device
        nan = torch.full((), float("nan"), device=device)
        rows = torch.stack([torch.stack([p.loss.float().reshape(()), p.grad_norm.float().reshape(()).to(device),
                                         p.finite.float().reshape(()),
                                         nan if p.loss_scale is None else p.loss_scale.float().reshape(()).to(device)])
                            for p in pending]).tolist()
        return [StepValues(loss, norm, flag > 0, None if p.loss_scale is None else scale)
                for (loss, norm, flag, scale), p in zip(rows, pending)]

    def finish(self, p: PendingRecord, values: StepValues, skipped: int) -> dict:
        """The step's complete record; `skipped` the run's skipped updates after this step."""
        seconds = self.clock.seconds(p.begin, p.end)
        world = self.env.world_size
        tok_s = self.spec.tokens_per_step / seconds
        record = {"step": p.step + 1, "batch": p.data_step, "loss": values.loss, "lr": p.lr,
                  "grad_norm": values.grad_norm,
                  "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / world,
                  "samples_per_s": self.spec.global_batch / seconds,
                  "mfu": self.flops_per_token * tok_s / (self.peak * world) if self.peak else None,
                  "step_time_s": seconds, "skipped_steps": skipped, "tokens": (p.step + 1) * self.spec.tokens_per_step,
                  "micro_batch": p.micro_batch, "restarts": self.restarts, **self.timer.split(seconds, p.phases),
                  **({"loss_scale": values.loss_scale} if values.loss_scale is not None else {}), **p.host}
        for read in p.later:
            record.update(read())
        if self.first:  # the first record of each process says what runs (for `paratrain report`)
            self.first = False
            record.update(layout=self.spec.layout.short_name(), world_size=world, model=self.spec.model_name,
                          params=count_params(self.spec.model_args))
        return record

    def release(self, record: dict, show: bool, profile_index: int | None = None) -> list[tuple[dict, bool]]:
        """The records to log now: this one, or while profiling none until the window's trace has been read (then
        all of them, with the profiler's compute / communication split). `profile_index`: its PendingRecord's."""
        return [(record, show)] if self.profiler is None else self.profiler.hold(record, show, profile_index)

    @property
    def profile_closing(self) -> bool:
        """The profiling window's last step has just run: settle now, so its trace is read and written here."""
        return self.profiler is not None and self.profiler.closing

    def close(self) -> list[tuple[dict, bool]]:
        """At the end of the run: a profiling window cut short (fewer steps, preemption) is written and released."""
        return self.profiler.finish() if self.profiler is not None else []

    def add_rank_stats(self, record: dict) -> None:
        """Every rank's memory (one all-gather): on log steps only."""
        record.update(gather_rank_stats(self.env.device))

    def bubble_summary(self) -> str | None:
        if not self.bubble_history:
            return None
        history = self.bubble_history[1:] or self.bubble_history  # the first step warms up
        idle = [sum(h[s] for h in history) / len(history) for s in range(self.spec.layout.pp)]
        return (f"pipeline bubble: predicted {self.spec.layout.predicted_bubble():.1%}; measured idle per stage rank "
                + ", ".join(f"{s}: {v:.1%}" for s, v in enumerate(idle)))
