"""The metrics record of one optimizer step: what `MetricsLog` hands to every sink (progress display, JSONL,
TensorBoard, Prometheus). Built on every rank: the MoE, pipeline and memory numbers are collectives."""

from __future__ import annotations

import torch

from paratrain.models import count_params
from paratrain.observe.sysmetrics import PhaseTimer, gather_rank_stats


class StepRecorder:
    def __init__(self, spec, step, train_data, env, peak_flops: float | None, flops_per_token: float, restarts: int,
                 dp_group, comm=None, message=print):
        """peak_flops: a device peak (datasheet or metrics.peak_tflops) for MFU; None records `mfu` as null."""
        self.spec, self.step, self.train_data, self.env, self.dp_group = spec, step, train_data, env, dp_group
        self.comm = comm  # distributed.compression.GradComm: bytes of the gradient reduction
        m = spec.cfg.metrics
        self.profiler = None  # torch.profiler over a window of steps (metrics.profile_steps)
        if m.profile_steps > 0:
            from paratrain.observe.profile import StepProfiler, gather_rows

            self.profiler = StepProfiler(spec.cfg.run_dir, env.rank, env.world_size, m.profile_start, m.profile_steps,
                                         env.device, message, gather_rows)
        self.peak, self.flops_per_token, self.restarts = peak_flops, flops_per_token, restarts
        self.timer = PhaseTimer()  # splits each step into data wait / comm wait / compute
        self.first = True
        self.bubble_history: list[list[float]] = []  # pipeline: measured idle fraction per stage rank, per step

    def start(self, step: int) -> float:
        if self.comm is not None:
            self.comm.start_step(step)
        if self.profiler is not None:
            self.profiler.begin()
        return self.timer.start()

    def record(self, step: int, loss: float, lr: float, grad_norm: torch.Tensor, seconds: float, progress,
               saved: dict) -> dict:
        """`progress` is the run's Progress, after this step's batch (data_step already advanced); `saved` the
        checkpoint save made since the previous record (checkpoint_save_s, checkpoint_step), if any."""
        if self.profiler is not None:
            self.profiler.end()
        tokens = self.spec.tokens_per_step
        world = self.env.world_size
        tok_s = tokens / seconds
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / world,
                  "mfu": self.flops_per_token * tok_s / (self.peak * world) if self.peak else None,
                  "step_time_s": seconds,
                  "skipped_steps": progress.skipped, "tokens": (step + 1) * tokens,
                  "micro_batch": progress.micro_batch, "restarts": self.restarts, **self.timer.split(seconds)}
        record.update(self.train_data.progress(progress.data_step, self.spec.global_batch))  # epochs, tokens/source
        if self.comm is not None:  # comm_bytes, compression_ratio
            record.update(self.comm.step_metrics(progress.accum_steps))
        if self.step.moe:  # every rank: one small all-reduce of the step's expert load
            record.update(self.step.moe.step_metrics(self.dp_group))
        if self.step.pipeline is not None:  # every rank: one tiny all-gather over the pp group
            idle = self.step.pipeline.measured_bubble()
            self.bubble_history.append(idle)
            record.update(pp_bubble_measured=sum(idle) / len(idle), pp_bubble_per_stage=idle,
                          pp_bubble_predicted=self.spec.layout.predicted_bubble())
        record.update(saved)
        if self.first:  # the first record of each process says what runs (for `paratrain report`)
            self.first = False
            record.update(layout=self.spec.layout.short_name(), world_size=world, model=self.spec.model_name,
                          params=count_params(self.spec.model_args))
        return record

    def release(self, record: dict, show: bool) -> list[tuple[dict, bool]]:
        """The records to log now: this one, or while profiling none until the window's trace has been read (then
        all of them, with the profiler's compute / communication split)."""
        return [(record, show)] if self.profiler is None else self.profiler.hold(record, show)

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
