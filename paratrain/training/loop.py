"""The training loop: one code path for one process and for every parallel layout.

`Trainer.__init__` builds the run from its `RunSpec`: the mesh, the model on the meta device laid out by
`parallelize` (or cut into pipeline stages), the optimizer, and the small objects the loop calls once each per
step: `TrainStep` (forward, loss, backward, clip, update), `ResilienceGuard` (preemption, out-of-memory,
non-finite steps), `Checkpointer` (save, resume, rollback), `Evaluator` and `StepRecorder` (the metrics record).
`fit()` reads top to bottom.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.config import dump_toml
from paratrain.data import load_tokenizer, open_split
from paratrain.distributed.compression import GradComm
from paratrain.distributed.context_parallel import context_for
from paratrain.distributed.env import DistEnv, register_process
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize, unwrap
from paratrain.distributed.pipeline import build_pipeline, check_stage_gpu
from paratrain.distributed.tensors import local_tensor
from paratrain.errors import UserError
from paratrain.faults import ATTEMPT_ENV, FaultInjector
from paratrain.observe.flops import is_datasheet_peak, peak_flops
from paratrain.generate import prompt_ids, sample
from paratrain.observe.metrics import MetricsLog, build_sinks
from paratrain.models import build_model, count_active_params, count_params, flops_per_token, format_params
from paratrain.spec import RunSpec, stage_gpus
from paratrain.training.checkpoint import Checkpointer, Progress, export_safetensors, full_weights
from paratrain.training.evaluation import Evaluator, dp_mean
from paratrain.training.optim import build_optimizer, lr_at
from paratrain.training.record import StepRecorder
from paratrain.training.resilience import MemoryBudget, ResilienceGuard, mark_preempted
from paratrain.training.step import TrainStep, make_scaler, schedule_loss


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
    sample_text: str | None = None
    final_weights: dict | None = None  # full weights by name (rank 0, when asked for)
    skipped_steps: int = 0
    memory: list[dict] = field(default_factory=list)  # per rank: bytes of params, grads, optimizer state
    preempted: bool = False
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

        # Build on the meta device (no memory) and materialise after sharding. Tied embeddings are the
        # exception: materialising from meta would untie them, so those models are built for real.
        with torch.device(dev if spec.model_args.tie_embeddings else "meta"):
            model = build_model(spec.model_args)
        scaler = make_scaler(spec.layout, t.precision, dev)
        self.comm = GradComm(cfg.parallel, self.dims, dev, t.seed)  # gradient compression, buckets, prefetching
        pipeline = None
        if spec.layout.pipelined:  # this rank's stages, each laid out like a model, and the schedule
            check_stage_gpu(stage_gpus(cfg, spec.layout), self.dims.pp_rank, dev)  # heterogeneous clusters
            pipeline = build_pipeline(self.dims, model, cfg.activation_checkpoint, t.precision, t.compile, dev, t.seed,
                                      schedule_loss(scaler), self.comm)
            model = pipeline.model
        else:
            model = parallelize(model, self.dims, cfg.activation_checkpoint, t.precision, t.compile, dev, t.seed,
                                comm=self.comm)
        self.comm.prepare()
        optimizer = build_optimizer(unwrap(model), cfg.optimizer, dev,
                                    self.dims.dp_group if spec.layout.zero1 else None)
        budget = cfg.resilience.memory_budget_gib
        self.step = TrainStep(model, optimizer, spec.layout, t.precision, dev, t.grad_clip, scaler, pipeline,
                              self.dims.pp_group, MemoryBudget(int(budget * 2**30)) if budget > 0 else None,
                              context=context_for(self.dims))  # cp: batches cut to this rank's chunks

        self.progress = Progress(t.micro_batch, spec.accum_steps)
        self.guard = ResilienceGuard(cfg.resilience, self.progress, dev, notice=self.notice)
        self.checkpointer = Checkpointer(spec, model, optimizer, self.progress, env.is_main, self.tokenizer,
                                         dump_toml(cfg), notice=self.notice, warn=self.warn, comm=self.comm)
        self.evaluate = Evaluator(open_split(cfg.data, "val", t.seq_len), self.step, spec, self.dims.dp_rank,
                                  self.dims.loss_group)
        self.peak, self.peak_source = peak_flops(dev, cfg.metrics.peak_tflops)
        self.restarts = int(os.environ.get(ATTEMPT_ENV, "0"))
        mfu_peak = self.peak if is_datasheet_peak(self.peak_source) else None  # no MFU against a measured matmul
        self.recorder = StepRecorder(spec, self.step, self.train_data, env, mfu_peak,
                                     flops_per_token(spec.model_args, t.seq_len), self.restarts, self.dims.dp_group,
                                     self.comm, self.notice)
        self.faults = FaultInjector(env.rank)
        if env.world_size > 1:
            register_process()
            env.print(f"{dev} | mesh position {self.dims.coordinates()} | data shard {self.dims.dp_rank}", all_ranks=True)

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, spec, env, t = self.cfg, self.spec, self.env, self.cfg.training
        result = TrainResult(run_dir=cfg.run_dir)
        # The checkpoint to resume from is found, verified and loaded before this run writes anything.
        start = step = self.checkpointer.resume(restarted=self.restarts > 0)
        if env.is_main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / "config.toml").write_text(dump_toml(resolved_config(cfg, spec.layout)))
        self.log = MetricsLog(cfg.run_dir / "metrics.jsonl", t.steps, 0, cfg.metrics.progress, enabled=env.is_main,
                              sinks=build_sinks(cfg, env))
        if start == 0 and cfg.model.init_from:  # a Hugging Face model's weights onto this layout; a fresh optimizer
            from paratrain import hf

            folder = hf.load_initial_weights(unwrap(self.step.model), cfg, spec.model_args)
            self.notice(f"initialised from Hugging Face folder {folder}")
        self._print_header()
        memory_rows = None
        self.step.model.train()
        with self.guard:
            while step < t.steps:
                if self.faults:
                    self.faults.before_step(step)
                if self.guard.preempted():  # every rank stops at the same step boundary
                    self._save_preempted(step, start)
                    result.preempted = True
                    break
                self.checkpointer.poll()
                data_step = self.progress.next_batch()
                t0 = self.recorder.start(step)
                lr = lr_at(step, cfg.optimizer, t.steps)
                for group in self.step.optimizer.param_groups:
                    group["lr"] = lr
                loss = self.guard.with_oom_adaptation(lambda: self._forward_backward(step, data_step),
                                                      self.step.zero_grad)
                grad_norm = self.step.clip()
                with self.recorder.timer("comm_time_s", env.device):
                    loss_value = dp_mean(loss, self.dims.loss_group)  # over dp x cp
                finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
                self.step.update(finite)
                if step == t.steps - 1:
                    memory_rows = self.memory_report()
                self.step.zero_grad()
                if step == start + 1:
                    self._print_measured_peak()
                self.progress.data_step += 1
                bad = self.guard.after_update(step, finite or self.step.scaler is not None, data_step)
                if bad is not None:
                    back = self.checkpointer.rollback(bad)
                    if back is None:
                        raise UserError(f"{len(bad)} consecutive non-finite steps and no checkpoint to roll back to")
                    del result.losses[max(0, back - start):]
                    step = back
                    continue
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                result.losses.append(loss_value)
                record = self.recorder.record(step, loss_value, lr, grad_norm, time.perf_counter() - t0,
                                              self.progress, self.checkpointer.take_save())
                is_eval = t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps
                if is_eval:
                    record["val_loss"] = self.evaluate(self.progress.micro_batch)
                show = (step + 1) % t.log_every == 0 or step == start or is_eval
                if show:
                    self.recorder.add_rank_stats(record)
                for held, shown in self.recorder.release(record, show):  # profiled steps wait for their trace
                    self.log.log(held, show=shown)
                step += 1
                if self.checkpointer.due(step):
                    self.checkpointer.save(step)
            for held, shown in self.recorder.close():
                self.log.log(held, show=shown)
            result.skipped_steps = self.progress.skipped
            if not result.preempted:
                self._finish(result, start, memory_rows)
            self.checkpointer.finish()
            # The run's last record: how it ended, and the save made after the last step's record (if any).
            self.log.log({"step": step, "end": "preempted" if result.preempted else "finished",
                          **self.checkpointer.take_save()}, show=False)
        self.log.close(linger=not result.preempted)  # preempted: no time to wait for a last scrape
        return result

    def _forward_backward(self, step: int, data_step: int) -> torch.Tensor:
        """This rank's micro-batches of global batch `data_step`, forward and backward (retried on OOM)."""
        spec, p = self.spec, self.progress
        with self.recorder.timer("data_time_s"):
            micro = self.train_data.micro_batches(data_step, spec.global_batch, self.cfg.training.seed,
                                                  self.dims.dp_rank, spec.layout.dp, p.accum_steps)
        if self.faults:
            self.faults.maybe_oom(step)
        return self.step.forward_backward(micro, poisoned=bool(self.faults) and self.faults.poison(data_step))

    # -- start and end ------------------------------------------------------------------------
    def _print_header(self) -> None:
        cfg, spec, t = self.cfg, self.spec, self.cfg.training
        n_params, n_active = count_params(spec.model_args), count_active_params(spec.model_args)
        active = f" ({format_params(n_active)} active per token)" if n_active != n_params else ""  # mixture of experts
        self.log.message(f"model {spec.model_name}: {format_params(n_params)} parameters{active} | "
                         f"layout {spec.layout.describe()} | "
                         f"global batch {spec.global_batch} x {t.seq_len} tokens (micro {self.progress.micro_batch} x "
                         f"accum {self.progress.accum_steps} x dp {spec.layout.dp}; {spec.batch_fixed}) | "
                         f"{t.precision} on {self.env.device.type} | {self._peak_text()}")
        if spec.layout.pipelined:
            self.log.message(spec.layout.describe_pipeline())
        self.mem_estimate = self._print_memory_estimate()

    def _peak_text(self) -> str:
        if is_datasheet_peak(self.peak_source):
            return f"peak {self.peak / 1e12:.2f} TFLOP/s per device ({self.peak_source})"
        return (f"MFU n/a on {self.env.device.type}: no datasheet peak (measured matmul {self.peak / 1e12:.2f} TFLOP/s "
                f"is not one; set metrics.peak_tflops for MFU)")

    def _save_preempted(self, step: int, start: int) -> None:
        self.checkpointer.finish()
        if step == start:  # stopped before the first step: the state is the one this run started from
            if self.env.is_main:
                mark_preempted(self.cfg.run_dir, step)
            self.notice(f"preempted at step {step} before any progress: nothing new to save")
            return
        path = self.checkpointer.save(step)
        self.guard.preemption.saved_step = step
        if self.env.is_main:
            mark_preempted(self.cfg.run_dir, step)
        self.notice(f"preempted: saved {path} at step {step}; resume with --checkpoint.resume=auto")

    def _finish(self, result: TrainResult, start: int, memory_rows) -> None:
        """Final evaluation, checkpoint, export, memory report and sample."""
        cfg, spec, env, log = self.cfg, self.spec, self.env, self.log
        steps = cfg.training.steps
        if start < steps or cfg.training.eval_every:
            result.val_loss = self.evaluate(self.progress.micro_batch)
            log.log({"step": steps, "val_loss": result.val_loss})
        if cfg.checkpoint.save_final and start < steps:
            log.message(f"checkpoint: {self.checkpointer.save(steps)}")
        if cfg.checkpoint.export_safetensors:
            out = export_safetensors(self.step.model, cfg.run_dir / "model.safetensors", env.is_main)
            if out:
                log.message(f"consolidated weights: {out}")
        if cfg.checkpoint.export_hf:  # the final checkpoint as a Hugging Face folder, RUN_DIR/hf
            from paratrain import hf

            self.checkpointer.finish()
            log.message(f"Hugging Face model: {hf.export_final(cfg, env.rank, env.world_size)}")
        bubble = self.recorder.bubble_summary()
        if bubble:
            log.message(bubble)
        if memory_rows is not None:
            result.memory = memory_rows
            log.message(format_memory_report(memory_rows))
        if self.want_final_weights:
            weights = full_weights(self.step.model, self.dims.pp_group)
            result.final_weights = weights if env.is_main else None
        if cfg.sample.max_new_tokens > 0:
            ids = sample(self.step.sampler(spec.model_args.vocab_size), self.prompt_ids, cfg.sample.max_new_tokens,
                         cfg.training.seq_len, cfg.sample.temperature, cfg.sample.top_k, seed=cfg.training.seed,
                         device=env.device, vocab_limit=self.tokenizer.vocab_size)
            result.sample_text = self.tokenizer.decode(ids)
            log.message("sample:\n" + cfg.sample.prompt + result.sample_text)
        if result.val_loss is not None:
            log.message(f"val loss {result.val_loss:.4f}")

    def _print_memory_estimate(self):
        """The memory estimator's table for this very layout, before the first step."""
        from paratrain.estimate import estimate_for_run

        try:
            estimate = estimate_for_run(self.spec, device=self.env.device.type)
        except UserError as e:
            self.log.message(f"memory estimate unavailable: {e}")
            return None
        self.log.message(estimate.format_table())
        if self.env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.env.device)
        return estimate

    def _print_measured_peak(self) -> None:
        """After the first steps: the measured peak of the worst rank beside the estimate (CUDA; on CPU the
        process RSS includes Python itself, so it is not comparable and not printed)."""
        if self.mem_estimate is None or self.env.device.type != "cuda":
            return
        from paratrain.estimate import device_peak_bytes

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

        def nbytes(t):
            t = local_tensor(t)
            return t.numel() * t.element_size()

        params = list(self.step.model.parameters())
        opt = self.step.optimizer
        opt = opt.optim if hasattr(opt, "optim") else opt
        mine = {"rank": self.env.rank,
                "params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))}
        if not dist.is_initialized():
            return [mine]
        rows = [None] * self.env.world_size
        dist.all_gather_object(rows, mine)
        return rows


def format_memory_report(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:9.2f} MiB"

    lines = ["per-rank model state: rank | parameters | gradients | optimizer"]
    lines += [f"  {r['rank']:>4} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])}" for r in rows]
    return "\n".join(lines)
