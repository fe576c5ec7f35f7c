"""The training loop: one code path for one process and for every parallel layout.

`Trainer.__init__` builds the run from its `RunSpec`: the mesh, then `build_train_step` (the model on the meta device
laid out by `parallelize` or cut into pipeline stages, the optimizer: a `TrainStep` doing forward, loss, backward,
clip, update), the learning-rate scheduler (`WarmupCosine`), and the small objects the loop calls once each per step:
`ResilienceGuard` (preemption, out-of-memory, non-finite steps), `Checkpointer` (save, resume, rollback), `Evaluator`
and `StepRecorder` (the metrics record). `fit()` reads top to bottom.

The hot path never waits for the device. A step leaves its loss, gradient norm and `finite` flag on the device
(a non-finite update is skipped there, see training/step.py) and its record pending; at a *settle point* (a log
step: every training.log_every, the first step, evaluations; before a checkpoint save or a preemption save; the
last step) one transfer reads every pending step, and in step order the guard counts the non-finite ones (and
asks for a rollback after resilience.max_bad_steps in a row: the steps after the streak are then discarded, as
they would not have run), the losses are kept and the records are logged. A crash loses at most the records of the
steps since the last settle point (a restart replays them from the checkpoint, which is always settled).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain import hf
from paratrain.config import dump_toml
from paratrain.data import load_tokenizer, open_split
from paratrain.distributed.env import DistEnv, register_process
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import unwrap
from paratrain.distributed.pipeline import check_stage_gpu
from paratrain.errors import UserError
from paratrain.estimate import estimate_for_run
from paratrain.estimate.gpus import fmt_bytes
from paratrain.distributed.launch import attempt
from paratrain.faults import FaultInjector
from paratrain.generate import prompt_ids, sample
from paratrain.harness.tasks import require_lm_eval
from paratrain.models import count_active_params, count_params, flops_per_token, format_params
from paratrain.models.lora import lora_summary
from paratrain.observe.flops import is_datasheet_peak, peak_flops
from paratrain.observe.metrics import MetricsLog, build_sinks
from paratrain.observe.numerics import Finding, NumericsWatch
from paratrain.observe.oom import write_evidence
from paratrain.observe.sysmetrics import device_peak_bytes
from paratrain.spec import RunSpec, stage_gpus
from paratrain.training.checkpoint import Checkpointer, Progress, export_safetensors, full_weights
from paratrain.training.evaluation import Evaluator
from paratrain.training.export import export_final
from paratrain.training.optim import WarmupCosine
from paratrain.training.record import PendingRecord, StepRecorder
from paratrain.training.resilience import MemoryBudget, ResilienceGuard, mark_preempted
from paratrain.training.step import apply_tf32, build_run_step


def resolved_config(cfg, layout):
    """The config as this run ran it: the data-parallel degrees written out (no -1), so the file says the world size
    it was trained on (`paratrain estimate --model RUN/config.toml`, `paratrain train --config` replay it)."""
    import dataclasses

    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=layout.dp_shard,
                                                                 dp_replicate=layout.dp_replicate))


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    downstream: dict | None = None  # [eval]: the final {task: {metric: value}} (rank 0)
    sample_text: str | None = None
    final_weights: dict | None = None  # full weights by name (rank 0, when asked for)
    skipped_steps: int = 0
    memory: list[dict] = field(default_factory=list)  # per rank: bytes of params, grads, optimizer state
    preempted: bool = False  # stopped early by SIGTERM or SIGINT, with a checkpoint to resume from
    interrupted: bool = False  # by SIGINT (Ctrl-C): the command exits 130
    run_dir: Path | None = None


class Trainer:
    def __init__(self, spec: RunSpec, env: DistEnv, want_final_weights: bool = False):
        self.spec, self.env, self.cfg = spec, env, spec.cfg
        self.want_final_weights = want_final_weights
        cfg, dev, t = spec.cfg, env.device, spec.cfg.training
        self.dims = ParallelDims.build(spec.layout, dev.type)
        self.train_data = open_split(cfg.data, "train", t.seq_len)  # one dataset or a mixture
        self.tokenizer = load_tokenizer(spec.data_dir)
        self.prompt_ids = prompt_ids(self.tokenizer, cfg.sample.prompt)  # fails now, not after training

        if spec.layout.pipelined:  # heterogeneous clusters: this rank's stages on the GPU the plan gave them
            check_stage_gpu(stage_gpus(cfg.parallel, spec.layout), self.dims.pp_rank, dev)
        self.tf32 = apply_tf32(t.tf32, t.precision, dev)  # before any matmul of the run
        budget = cfg.resilience.memory_budget_gib
        self.train_step = build_run_step(spec, self.dims, dev,
                                         memory_budget=MemoryBudget(int(budget * 2**30)) if budget > 0 else None)
        model, optimizer = self.train_step.model, self.train_step.optimizer
        self.comm = self.train_step.comm  # gradient compression, buckets, prefetching
        self.scheduler = WarmupCosine(optimizer, cfg.optimizer, t.steps)  # the learning rate of each update

        self.progress = Progress(t.micro_batch, spec.accum_steps)
        self.guard = ResilienceGuard(cfg.resilience, self.progress, dev, notice=self.notice)
        self.checkpointer = Checkpointer(spec, model, optimizer, self.progress, env.is_main, self.tokenizer,
                                         dump_toml(cfg), notice=self.notice, warn=self.warn, comm=self.comm,
                                         scheduler=self.scheduler)
        self.evaluate = Evaluator(open_split(cfg.data, "val", t.seq_len), self.train_step, spec, self.dims.dp_rank,
                                  self.dims.loss_group)
        self.downstream = None  # [eval]: lm-eval's tasks on this model and layout
        if cfg.eval.tasks:
            require_lm_eval()  # (under torchrun no launcher checked it: one line, not an ImportError)
            from paratrain.training.downstream import DownstreamEval  # lazy: lm-eval is an extra, for runs that ask

            self.downstream = DownstreamEval(self.train_step, self.tokenizer, spec, self.dims, env.is_main)
        # MFU against the peak of the rate the run's matmuls go at (an fp32 run's: TF32's or plain fp32's)
        self.peak, self.peak_source = peak_flops(dev, cfg.metrics.peak_tflops, t.precision, self.tf32)
        self.restarts = attempt()  # a relaunched rank (ours or torchrun's) resumes from the newest checkpoint
        mfu_peak = self.peak if is_datasheet_peak(self.peak_source) else None  # no MFU against a measured matmul
        self.recorder = StepRecorder(spec, self.train_step, self.train_data, env, mfu_peak,
                                     flops_per_token(spec.model_args, t.seq_len), self.restarts, self.dims.dp_group,
                                     self.comm, self.notice)
        self.faults = FaultInjector(env.rank)
        # per-block statistics every metrics.numerics_every steps; the first non-finite module of a bad step
        self.numerics = NumericsWatch(self.train_step, spec.model_args.n_layers, cfg.metrics.numerics_every,
                                      t.precision)
        self.pending: list[PendingRecord] = []  # steps run but not yet read back (see the module's docstring)
        self.logged: list[tuple[dict, bool, int | None]] = []  # settled records (whether to show them, profiler
        # index), not yet logged
        if env.world_size > 1:
            register_process()
            if cfg.metrics.verbose:  # one line per rank: a screenful on a node, so only when asked for
                env.print(f"{dev} | mesh position {self.dims.coordinates()} | data shard {self.dims.dp_rank}",
                          all_ranks=True)

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        result = TrainResult(run_dir=cfg.run_dir)
        start = self._begin()
        if start is None:
            return result
        step, memory_rows = start, None
        self.train_step.model.train()
        with self.guard:
            while step < t.steps:
                if self.faults:
                    self.faults.before_step(step, settle=self.checkpointer.finish)
                stop, save = self.guard.at_boundary(self.checkpointer.timer_ran_out())  # agreed by every rank
                if stop:  # SIGTERM or Ctrl-C: every rank saves at the same step boundary
                    back = self._settle(result, start)
                    self._log_settled()
                    step = step if back is None else back
                    result.preempted, result.interrupted = True, self.guard.preemption.interrupted
                    self._save_preempted(step, start, result.interrupted)
                    break
                self.checkpointer.save_asked |= save  # checkpoint.every_minutes: a save after this step
                self.checkpointer.poll()
                rows = self._step(step, start)
                memory_rows = memory_rows if rows is None else rows
                back = self._after_step(step, start, result)
                if back is not None:  # rolled back to a checkpoint
                    step = back
                    continue
                step += 1
                if self.checkpointer.due(step):
                    self.checkpointer.save(step)
            self._end(result, start, step, memory_rows)
        self.log.close(linger=not result.preempted)  # preempted: no time to wait for a last scrape
        return result

    def _begin(self) -> int | None:
        """Before the first step: the checkpoint resumed (found, verified and loaded before this run writes anything),
        the resolved config, the metrics log and the header; the step to start from, or None when the run had already
        finished."""
        cfg, spec, env, t = self.cfg, self.spec, self.env, self.cfg.training
        folder = spec.source.hf_folder
        if folder is not None and spec.lora is not None:  # LoRA: the frozen base always comes from its folder
            self._load_hf_weights(folder)
        start = self.checkpointer.resume(restarted=self.restarts > 0)
        # A finished run started again: nothing to do (a checkpoint resumed by path, or a relaunch, at the last step
        # still evaluates and exports: paratrain verify evaluates checkpoints so).
        if start >= t.steps and cfg.checkpoint.resume == "auto" and not self.restarts:
            self.notice(f"{cfg.run_dir} already finished at step {start}: nothing to train")
            return None
        if env.is_main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / "config.toml").write_text(dump_toml(resolved_config(cfg, spec.layout)))
        self.log = MetricsLog(cfg.run_dir / "metrics.jsonl", t.steps, start, cfg.metrics.progress, enabled=env.is_main,
                              sinks=build_sinks(cfg.metrics, env, cfg.run.name, cfg.run_dir))
        # Each start of the run: readers take the records after this one for every step from `start` on (a resumed
        # or restarted run never shows the steps it abandoned).
        self.log.log({"step": start, "segment": "resume" if start else "start", "restarts": self.restarts},
                     show=False)
        if start == 0 and folder is not None and spec.lora is None:  # a fresh optimizer: the weights from the folder
            self._load_hf_weights(folder)
        self._print_header()
        return start

    def _step(self, step: int, start: int):
        """One optimizer step: forward and backward (adapting to out-of-memory), clipping, the update (skipped on the
        device when not finite), the learning rate, and its pending record (nothing read from the device). The last
        step returns the memory report (taken before its gradients are freed)."""
        ts, env = self.train_step, self.env
        data_step = self.progress.next_batch()
        t0 = self.recorder.start(step)
        loss = self.guard.with_oom_adaptation(lambda: self._forward_backward(step, data_step), ts.zero_grad,
                                              evidence=lambda error: self._oom_evidence(step, error))
        self.numerics.after_backward()
        grad_norm = ts.clip()
        with self.recorder.timer("comm_time_s", env.device):
            loss = ts.mean_loss(loss)  # over dp x cp
        finite = ts.finite(loss, grad_norm)  # a device bool: the update is skipped on the device
        ts.update(finite)
        lr = self.scheduler.lr
        self.scheduler.step()
        memory_rows = self.memory_report() if step == self.cfg.training.steps - 1 else None
        ts.zero_grad()
        if step == start + 1:
            self._print_measured_peak()
        self.progress.data_step += 1
        self.pending.append(self.recorder.record(step, data_step, loss, lr, grad_norm, finite, t0,
                                                 self.progress, self.checkpointer.take_save()))
        watched = self.numerics.end()  # a watch step's statistics, read at the settle point
        if watched is not None:
            self.pending[-1].later.append(watched)
        return memory_rows

    def _after_step(self, step: int, start: int, result: TrainResult) -> int | None:
        """At a settle point (a log, evaluation or downstream step, the last step, a save, the profiler's window
        closing): the pending records read and logged, the evaluations run. Returns the step rolled back to, if any."""
        cfg, t = self.cfg, self.cfg.training
        is_eval = t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps
        every = cfg.eval.every if self.downstream is not None else 0
        is_downstream = every and (step + 1) % every == 0 and step + 1 < t.steps
        show = (step + 1) % t.log_every == 0 or step == start or is_eval or is_downstream
        self.pending[-1].show = show
        if not (show or step + 1 == t.steps or self.checkpointer.due(step + 1) or self.recorder.profile_closing):
            return None
        back = self._settle(result, start)
        if back is not None:
            return back
        record = self.logged[-1][0]
        if is_eval:
            record["val_loss"] = self.evaluate(self.progress.micro_batch)
        if is_downstream:
            metrics = self.downstream(step + 1)
            if metrics is not None:
                record["downstream"] = metrics
        if show:
            self.recorder.add_rank_stats(record)
        self._log_settled()
        return None

    def _end(self, result: TrainResult, start: int, step: int, memory_rows) -> None:
        """After the last step (or a preemption): the profiler's held records, the final evaluation, sample and export,
        the checkpointer's last save, and the run's last record (how it ended)."""
        for held, shown in self.recorder.close():
            self.log.log(held, show=shown)
        result.skipped_steps = self.progress.skipped
        if not result.preempted:
            self._finish(result, start, memory_rows)
        self.checkpointer.close()
        ended = "interrupted" if result.interrupted else "preempted" if result.preempted else "finished"
        self.log.log({"step": step, "end": ended, **self.checkpointer.take_save()}, show=False)

    def _settle(self, result: TrainResult, start: int) -> int | None:
        """A settle point: read every pending step back (one transfer), then in step order let the guard count the
        non-finite ones and keep each loss and record (`self.logged`, written by `_log_settled`). Returns the step a
        rollback went back to, else None. Every step that ran keeps its record: a skipped update is marked
        `skipped`, and on a rollback the steps run after the bad streak are logged marked `rolled_back`, followed by
        a `segment` record that tells readers the records after its step were undone."""
        pending, self.pending, self.logged = self.pending, [], []
        read = self.recorder.read(pending)
        for i, (entry, values) in enumerate(zip(pending, read)):
            finding = None if values.finite or self.guard.by_scaler(values) else self._diagnose(entry)
            detail = finding.text() if finding else ""
            bad = self.guard.after_update(entry.step, values, entry.data_step, detail)
            record = self.recorder.finish(entry, values, self.progress.skipped)
            if not values.finite:
                record["skipped"] = True
            if finding:  # a watch step keeps its own numerics (gradients included); others get the replay's
                record.update({k: v for k, v in finding.record().items() if k not in record})
            self.logged.append((record, entry.show, entry.profile_index))
            if bad is not None:
                for later, later_values in zip(pending[i + 1:], read[i + 1:]):  # ran, then undone by the rollback
                    undone = self.recorder.finish(later, later_values, self.progress.skipped)
                    self.logged.append(({**undone, "rolled_back": True}, False, later.profile_index))
                self._log_settled()
                back = self.checkpointer.rollback(bad)  # also the learning rate (the scheduler's saved state)
                if back is None:
                    raise UserError(f"{len(bad)} consecutive non-finite steps and no checkpoint to roll back to; "
                                    f"{detail}")
                self.log.log({"step": back, "segment": "rollback", "batches": sorted(bad)}, show=False)
                del result.losses[max(0, back - start):]
                return back
            result.losses.append(values.loss)
        return None

    def _diagnose(self, entry: PendingRecord) -> Finding:
        """A non-finite step: replay its batch forward on every rank and name the first non-finite output."""
        found = self.numerics.first_nonfinite(self._micro_batches(entry.data_step))
        return Finding(entry.step, entry.data_step, found["module"], found.get("rank"), str(self.cfg.run_dir),
                       found.get("loss_finite", True), found["numerics"])

    def _log_settled(self) -> None:
        for record, show, profile_index in self.logged:
            for held, shown in self.recorder.release(record, show, profile_index):  # profiled steps wait for their trace
                self.log.log(held, show=shown)
        self.logged = []

    def _forward_backward(self, step: int, data_step: int) -> torch.Tensor:
        """This rank's micro-batches of global batch `data_step`, forward and backward (retried on OOM)."""
        with self.recorder.timer("data_time_s"):
            micro = self._micro_batches(data_step)
        if self.faults:
            self.faults.during_step(step, self.train_step)
        self.numerics.begin(step)  # a watch step measures from here (again, when retried after out-of-memory)
        return self.train_step.forward_backward(micro, poisoned=bool(self.faults) and self.faults.poison(data_step))

    def _oom_evidence(self, step: int, error: BaseException):
        """The allocator's snapshot beside the estimate, in the run folder (None when it cannot be written)."""
        try:
            return write_evidence(self.cfg.run_dir, self.env.rank, step, self.spec, self.env.device,
                                  self.progress.micro_batch, self.progress.accum_steps, error)
        except OSError:  # a full or read-only disk: adapting to the out-of-memory matters more than the evidence
            return None

    def _micro_batches(self, data_step: int):
        """This rank's micro-batches of global batch `data_step`."""
        spec = self.spec
        return self.train_data.micro_batches(data_step, spec.global_batch, self.cfg.training.seed, self.dims.dp_rank,
                                             spec.layout.dp, self.progress.accum_steps)

    # -- start and end ------------------------------------------------------------------------
    def _load_hf_weights(self, folder) -> None:
        """A Hugging Face model's weights onto this layout."""
        hf.load_initial_weights(unwrap(self.train_step.model), folder, self.spec.model_args)
        self.notice(f"initialised from Hugging Face folder {folder}")

    def _print_header(self) -> None:
        cfg, spec, t = self.cfg, self.spec, self.cfg.training
        n_params, n_active = count_params(spec.model_args), count_active_params(spec.model_args)
        active = f" ({format_params(n_active)} active per token)" if n_active != n_params else ""  # mixture of experts
        self.log.message(f"model {spec.model_name}: {format_params(n_params)} parameters{active} | "
                         f"{t.precision} on {self.env.device.type} | {self._peak_text()}")
        self.log.message(f"layout {spec.layout.describe()} | "
                         f"global batch {spec.global_batch} x {t.seq_len} tokens (micro {self.progress.micro_batch} x "
                         f"accum {self.progress.accum_steps} x dp {spec.layout.dp}; {spec.batch_fixed})")
        if spec.layout.pipelined:
            self.log.message(spec.layout.describe_pipeline())
        for line in (self.train_data.describe(), spec.lora and lora_summary(unwrap(self.train_step.model))):
            if line:
                self.log.message(line)
        self.mem_estimate = self._print_memory_estimate()

    def _peak_text(self) -> str:
        if is_datasheet_peak(self.peak_source):
            return f"peak {self.peak / 1e12:.2f} TFLOP/s per device ({self.peak_source})"
        return (f"MFU n/a on {self.env.device.type}: no datasheet peak (measured matmul {self.peak / 1e12:.2f} TFLOP/s "
                f"is not one; set metrics.peak_tflops for MFU)")

    def _save_preempted(self, step: int, start: int, interrupted: bool) -> None:
        what = "interrupted" if interrupted else "preempted"
        self.checkpointer.finish()
        if step == start:  # stopped before the first step: the state is the one this run started from
            if self.env.is_main:
                mark_preempted(self.cfg.run_dir, step)
            self.notice(f"{what} at step {step} before any progress: nothing new to save")
            return
        saved = self.checkpointer.saved_path
        # (a periodic save may have just written this very step: not twice)
        # (synchronous: committed before the exit, within the grace period; the save in flight was finished above)
        path = saved if saved is not None and saved.name == f"step-{step}" else \
            self.checkpointer.save(step, background=False)
        self.guard.preemption.saved_step = step
        if self.env.is_main:
            mark_preempted(self.cfg.run_dir, step)
        self.notice(f"{what}: saved {path} at step {step}; resume with --checkpoint.resume=auto")

    def _finish(self, result: TrainResult, start: int, memory_rows) -> None:
        """Final evaluation, checkpoint, export, memory report and sample."""
        cfg, spec, env, log = self.cfg, self.spec, self.env, self.log
        steps = cfg.training.steps
        if start < steps or cfg.training.eval_every:
            result.val_loss = self.evaluate(self.progress.micro_batch)
            log.log({"step": steps, "val_loss": result.val_loss})
        if self.downstream is not None and start < steps:
            result.downstream = self.downstream(steps, final=True)
            if result.downstream is not None:
                log.log({"step": steps, "downstream": result.downstream})
                log.message(f"downstream tasks (step {steps}; lm-eval's files in {cfg.run_dir / 'eval'}):\n"
                            + self.downstream.table)
        if cfg.checkpoint.save_final and start < steps:
            # (synchronous: nothing is left to overlap it, and the line names a committed checkpoint)
            log.message(f"checkpoint: {self.checkpointer.save(steps, background=False)}")
        if cfg.checkpoint.export_safetensors:
            out = export_safetensors(self.train_step.model, cfg.run_dir / "model.safetensors", env.is_main)
            if out:
                log.message(f"consolidated weights: {out}")
        if cfg.checkpoint.export_hf:  # the final checkpoint as a Hugging Face folder, RUN_DIR/hf
            self.checkpointer.finish()
            out = export_final(cfg.run_dir, steps, cfg.checkpoint.export_hf_dtype, env.rank, env.world_size)
            log.message(f"Hugging Face model: {out}")
        bubble = self.recorder.bubble_summary()
        if bubble:
            log.message(bubble)
        if memory_rows is not None:
            result.memory = memory_rows
            log.message(format_memory_report(memory_rows))
        if self.want_final_weights:
            weights = full_weights(self.train_step.model, self.dims.pp_group)
            result.final_weights = weights if env.is_main else None
        if cfg.sample.max_new_tokens > 0:
            ids = sample(self.train_step.sampler(spec.model_args.vocab_size), self.prompt_ids, cfg.sample.max_new_tokens,
                         cfg.training.seq_len, cfg.sample.temperature, cfg.sample.top_k, seed=cfg.training.seed,
                         device=env.device, vocab_limit=self.tokenizer.vocab_size)
            result.sample_text = self.tokenizer.decode(ids)
            log.message("sample:\n" + cfg.sample.prompt + result.sample_text)
        if result.val_loss is not None:
            log.message(f"val loss {result.val_loss:.4f}")

    def _print_memory_estimate(self):
        """The memory estimator's verdict for this very layout in one line, before the first step; its table goes to
        RUN_DIR/memory-estimate.txt (and with metrics.verbose to the screen, less the model line shown above)."""
        try:
            estimate = estimate_for_run(self.spec, device=self.env.device.type)
        except UserError as e:
            self.log.message(f"memory estimate unavailable: {e}")
            return None
        table = estimate.format_table()
        path = self.cfg.run_dir / MEMORY_TABLE
        if self.env.is_main:
            path.write_text(table + "\n")
        self.log.message(memory_fit_line(estimate, path))
        if self.cfg.metrics.verbose:
            self.log.message(table.split("\n", 1)[1])
        if self.env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.env.device)
        return estimate

    def _print_measured_peak(self) -> None:
        """After the first steps: the measured peak of the worst rank beside the estimate (CUDA; on CPU the
        process RSS includes Python itself, so it is not comparable and not printed)."""
        if self.mem_estimate is None or self.env.device.type != "cuda":
            return

        peaks = [device_peak_bytes(self.env.device)]
        if dist.is_initialized():
            peaks = [None] * self.env.world_size
            dist.all_gather_object(peaks, device_peak_bytes(self.env.device))
        worst = max(peaks)
        self.log.message(self.mem_estimate.compare_line(worst) + f" (worst rank {peaks.index(worst)})")

    def notice(self, text: str) -> None:
        """Events a user must see whatever the progress display (resume, rollback, OOM, preemption)."""
        if self.env.is_main:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        if self.env.is_main:
            print(text, file=sys.stderr, flush=True)

    def memory_report(self) -> list[dict]:
        """Bytes of parameters, gradients and optimizer state held by each rank."""
        mine = {"rank": self.env.rank, **self.train_step.state_bytes()}
        if not dist.is_initialized():
            return [mine]
        rows = [None] * self.env.world_size
        dist.all_gather_object(rows, mine)
        return rows


MEMORY_TABLE = "memory-estimate.txt"  # in the run folder: the estimator's table for the run's layout


def memory_fit_line(est, table: Path) -> str:
    """'memory: 1.20 GiB of 79.65 GiB per rank (estimate) fits; table: runs/x/memory-estimate.txt' (on a CPU, no
    device memory to compare with: 'memory: 2.1 MiB per rank (estimate); ...')."""
    size = f"{fmt_bytes(est.total_bytes)} per rank (estimate)"
    if est.fits is not None:
        would = f" (would fit: {est.suggestion['change']})" if est.suggestion else ""
        size = f"{fmt_bytes(est.total_bytes)} of {fmt_bytes(est.gpu_bytes)} per rank (estimate) " + \
            ("fits" if est.fits else f"DOES NOT FIT{would}")
    host = f"; host {fmt_bytes(est.host_bytes)} per rank" if est.host else ""  # offloaded states and activations
    return f"memory: {size}{host}; table: {table}"


def format_memory_report(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:9.2f} MiB"

    lines = ["per-rank model state: rank | parameters | gradients | optimizer"]
    lines += [f"  {r['rank']:>4} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])}" for r in rows]
    return "\n".join(lines)
