"""The training loop: one code path for one process and for every parallel layout.

Read top to bottom: resolve the run (data, model size, layout, batch) -> build the model on the
meta device and parallelise it -> optimizer -> optional resume -> step loop -> final eval,
checkpoint, memory report and a sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.checkpoint import (CheckpointWriter, export_safetensors, load_checkpoint, newest_valid_checkpoint,
                                  resolve_resume)
from paratrain.config import Config, dump_toml
from paratrain.data import DEFAULT_CORPUS, dataset_meta, load_tokenizer, open_split, prepare_for_config
from paratrain.distributed.env import DistEnv, init_distributed, register_process, shutdown_distributed
from paratrain.distributed.expert_parallel import MoEMeter
from paratrain.distributed.grad_norm import clip_grad_norm
from paratrain.distributed.tensors import full_tensor, local_tensor
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import PRECISION_DTYPES, parallelize, unwrap, uses_fsdp
from paratrain.distributed.pipeline import PipelinePlan, PipelineSampler, build_pipeline, plan_pipeline
from paratrain.errors import ConfigError, UserError
from paratrain.faults import ATTEMPT_ENV, FaultInjector
from paratrain.resilience import MemoryBudget, OutOfMemory, PreemptionWatch, is_out_of_memory, mark_preempted
from paratrain.flops import peak_flops
from paratrain.generate import sample
from paratrain.metrics import MetricsLog, build_sinks, check_metrics_config
from paratrain.models import ModelArgs, Transformer, count_active_params, count_params, flops_per_token, preset_args
from paratrain.optim import build_optimizer, lr_at
from paratrain.sysmetrics import PhaseTimer, gather_rank_stats

VOCAB_PAD = 64  # pad small vocabularies so embedding/output split evenly over tensor-parallel ranks


@dataclass
class RunPlan:
    """Everything decided before any process group or model exists."""

    cfg: Config
    dims: ParallelDims
    model_args: ModelArgs
    data_dir: Path
    global_batch: int
    accum_steps: int
    batch_fixed: str  # which of global batch / accumulation the user fixed
    pipeline: PipelinePlan | None = None  # parallel.pp > 1: stages, schedule, microbatches


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    sample_text: str | None = None
    final_weights: dict | None = None
    skipped_steps: int = 0
    memory: list[dict] = field(default_factory=list)  # per rank: bytes of params, grads, optimizer state
    preempted: bool = False
    run_dir: Path | None = None


def data_source(cfg: Config) -> Path:
    return DEFAULT_CORPUS if cfg.data.source == "tinyshakespeare" else Path(cfg.data.source)


def prepare_data(cfg: Config) -> dict:
    """Prepare (or reuse) the dataset, or check a mixture's datasets; meta["dir"] holds the tokenizer."""
    return prepare_for_config(cfg.data, data_source(cfg))


def model_args_for(cfg: Config, data_vocab: int) -> ModelArgs:
    m = cfg.model
    padded = math.ceil(data_vocab / VOCAB_PAD) * VOCAB_PAD
    overrides = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
                                             "rope_theta", "tie_embeddings")}
    overrides.update({k: v for k, v in vars(m).items() if k.startswith("moe_")})  # mixture-of-experts settings
    if m.vocab_size is not None:
        padded = m.vocab_size
    args = preset_args(m.preset, vocab_size=padded, **overrides)
    if args.vocab_size < data_vocab:
        raise ConfigError(f"model vocab size {args.vocab_size} is smaller than the dataset's {data_vocab}")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: "
                          "dim must divide by n_heads and n_heads by n_kv_heads")
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len={cfg.training.seq_len} is longer than the model's max_seq_len="
                          f"{args.max_seq_len}")
    return args


def plan_run(cfg: Config, world_size: int, meta: dict | None = None) -> RunPlan:
    """Validate the whole run against the world size; raises ConfigError before anything starts.

    Everything that does not depend on the dataset is checked before the dataset is prepared, so a
    config mistake writes nothing; only the vocabulary-size checks wait for the data.
    """
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.validate_model(model_args_for(cfg, VOCAB_PAD * dims.tp))
    meta = meta if meta is not None else prepare_data(cfg)
    args = model_args_for(cfg, meta["vocab_size"])
    dims.validate_model(args)
    t = cfg.training
    if t.global_batch is not None:
        global_batch, fixed = t.global_batch, "global batch fixed; accumulation derived"
    else:
        global_batch, fixed = t.micro_batch * t.accum_steps * dims.dp, "accumulation fixed; global batch derived"
    if dims.pp > 1:
        # The schedule cuts each data-parallel rank's batch into parallel.pp_microbatches; no accumulation loop.
        if global_batch % dims.dp:
            raise ConfigError(f"global batch {global_batch} is not divisible by the data-parallel degree ({dims.dp})")
        dims.validate_batch(global_batch, global_batch // dims.dp, t.seq_len)
        if cfg.checkpoint.export_safetensors:
            raise ConfigError("checkpoint.export_safetensors is not supported with parallel.pp > 1 yet "
                              "(the DCP checkpoint loads on any layout)")
        pipeline, accum = plan_pipeline(cfg.parallel, args, global_batch // dims.dp, dims), 1
    else:
        pipeline, accum = None, dims.validate_batch(global_batch, t.micro_batch, t.seq_len)
    return RunPlan(cfg, dims, args, Path(meta.get("dir", cfg.data.dir)), global_batch, accum, fixed, pipeline)


def _dp_mean(value: torch.Tensor, group) -> float:
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size(group)
    return value.item()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # (B*T, V) vs (B*T,)


class Trainer:
    def __init__(self, plan: RunPlan, env: DistEnv, want_final_weights: bool = False):
        self.plan, self.env, self.cfg = plan, env, plan.cfg
        self.want_final_weights = want_final_weights
        cfg, dims, dev = self.cfg, plan.dims, env.device
        self.mesh, dpm = dims.build_mesh(dev.type)
        self.dp_group = dpm.get_group() if dpm is not None else None
        self.dp_rank = dpm.get_local_rank() if dpm is not None else 0

        self.train_data = open_split(cfg.data, "train", cfg.training.seq_len)  # one dataset or a mixture
        self.val_data = open_split(cfg.data, "val", cfg.training.seq_len)
        self.tokenizer = load_tokenizer(plan.data_dir)
        self.prompt_ids = self.tokenizer.encode(cfg.sample.prompt)  # fails now, not after training

        # Build on the meta device (no memory) and materialise after sharding. Tied embeddings are the
        # exception: materialising from meta would untie them, so those models are built for real.
        self.pipeline, self.pp_group = None, None
        if plan.pipeline is not None:
            # This rank's stages, each laid out like a model (TP, AC, compile, FSDP), and the schedule.
            self.pipeline = build_pipeline(plan.pipeline, plan.model_args, dims, self.mesh, cfg.checkpointing,
                                           cfg.training.precision, cfg.training.compile, dev, cfg.training.seed,
                                           self._pipeline_loss)
            self.model, self.pp_group = self.pipeline.model, self.pipeline.group
        else:
            with torch.device(dev if plan.model_args.tie_embeddings else "meta"):
                model = Transformer(plan.model_args)
            self.model = parallelize(model, dims, self.mesh, dpm, cfg.checkpointing, cfg.training.precision,
                                     cfg.training.compile, dev, cfg.training.seed, cfg.parallel.ddp_bucket_mb)
        zero1_group = self.dp_group if (dims.dp > 1 and dims.dp_mode == "zero1") else None
        self.optimizer = build_optimizer(unwrap(self.model), cfg.optimizer, dev, zero1_group)

        precision = cfg.training.precision
        # FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does the low-precision compute.
        self.autocast = precision != "fp32" and not uses_fsdp(dims)
        self.scaler = None
        if precision == "fp16":
            if uses_fsdp(dims) or dims.tp_enabled or dims.pp > 1:
                # DTensor gradients: the sharded scaler unscales local shards and agrees on overflow across ranks.
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(dev.type)
            else:
                self.scaler = torch.amp.GradScaler(dev.type)
        self.loss_parallel = dims.tp_enabled and dims.loss_parallel and self.pipeline is None

        if env.world_size > 1:
            register_process()
            coords = self.mesh.get_coordinate() if self.mesh is not None else None
            axes = dict(zip(self.mesh.mesh_dim_names, coords)) if coords is not None else {}
            env.print(f"{dev} | mesh position {axes} | data shard {self.dp_rank}", all_ranks=True)
        self.flops_per_token = flops_per_token(plan.model_args, cfg.training.seq_len)
        self.moe = MoEMeter(unwrap(self.model)) if plan.model_args.moe_experts else None  # aux loss, expert load
        self.peak, self.peak_source = peak_flops(dev, cfg.metrics.peak_tflops)
        self.timer = PhaseTimer()  # splits each step into data wait / comm wait / compute
        self.start_step, self.skipped = 0, 0
        # The batch split can change at run time (out-of-memory adaptation); the global batch never does.
        self.micro_batch, self.accum_steps = cfg.training.micro_batch, plan.accum_steps
        # Data position: optimizer step t reads batch data_step; bad batches found by a rollback are skipped.
        self.data_step, self.skip_batches = 0, set()
        self.writer = CheckpointWriter(cfg.run_dir / "checkpoints", cfg.checkpoint.keep, env.is_main,
                                       cfg.checkpoint.async_save, self.tokenizer)
        self.faults = FaultInjector(env.rank)
        self.restart_count = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.restarted = self.restart_count > 0
        self.last_save_s = None
        budget = cfg.resilience.memory_budget_gib
        self.memory_budget = MemoryBudget(int(budget * 2**30)) if budget > 0 else None

    # -- pieces of a step --------------------------------------------------------------------
    def _contexts(self, sync: bool) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if not sync and hasattr(self.model, "no_sync"):
            stack.enter_context(self.model.no_sync())  # DDP: all-reduce once, on the last micro-step
        if self.autocast:
            stack.enter_context(torch.autocast(self.env.device.type, dtype=PRECISION_DTYPES[self.cfg.training.precision]))
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss per microbatch (scaled for fp16); the schedule backpropagates it."""
        loss = loss_fn(logits, targets)
        return self.scaler.scale(loss) if self.scaler else loss

    def _pipeline_step(self, micro_batches, poisoned: bool) -> torch.Tensor:
        (x, y), = micro_batches  # this data-parallel rank's whole slice; the schedule cuts the microbatches
        if self.scaler:
            self.scaler.scale(torch.ones((), device=self.env.device))  # stages without the loss need the scale too
        with self._contexts(sync=True):
            loss = self.pipeline.train_step(x.to(self.env.device), y.to(self.env.device))
        if self.scaler:
            loss = loss / self.scaler.get_scale()
        return loss * float("nan") if poisoned else loss

    def _forward_backward(self, micro_batches, poisoned: bool = False) -> torch.Tensor:
        if self.pipeline is not None:
            return self._pipeline_step(micro_batches, poisoned)
        accum = len(micro_batches)
        total = torch.zeros((), device=self.env.device)
        if self.moe:
            self.moe.reset()
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)  # (B, T)
            with self._contexts(sync=i == accum - 1):
                with self.memory_budget.track() if self.memory_budget else contextlib.nullcontext():
                    loss = loss_fn(self.model(x), y) / accum  # mean over this rank's share of the global batch
                    aux = self.moe.collect() / accum if self.moe else None  # MoE load-balancing loss, same scaling
                if poisoned:
                    loss = loss * float("nan")
                # The balance loss is a second root: the loss may be a DTensor (loss parallel), aux never is.
                roots = [loss] if aux is None else [loss, aux]
                torch.autograd.backward([self.scaler.scale(r) for r in roots] if self.scaler else roots)
            if self.memory_budget:
                self.memory_budget.check()
            total += full_tensor(loss.detach())
        return total

    def _step_gradients(self, step: int, data_step: int) -> torch.Tensor:
        """Forward and backward of one global batch; on out-of-memory, halve the micro-batch, double the
        accumulation (same global batch, same loss) and try again."""
        p = self.plan
        while True:
            with self.timer("data_time_s"):
                micro = self.train_data.micro_batches(data_step, p.global_batch, self.cfg.training.seed, self.dp_rank,
                                                      p.dims.dp, 1 if self.pipeline else self.accum_steps)
            failed = None
            try:
                if self.faults:
                    self.faults.maybe_oom(step)
                return self._forward_backward(micro, poisoned=bool(self.faults) and self.faults.poison(data_step))
            except Exception as e:  # noqa: BLE001 - only out-of-memory errors are handled, the rest re-raised
                if not is_out_of_memory(e):
                    raise
                failed = e
            self._agree_and_adapt(failed)

    def _agree_and_adapt(self, error: Exception) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.micro_batch == 1:
            raise OutOfMemory(f"out of memory at micro-batch 1 ({error}); the layout does not fit: use more "
                              "sharding, tensor parallelism or activation checkpointing")
        old = (self.micro_batch, self.accum_steps)
        self.micro_batch, self.accum_steps = self.micro_batch // 2, self.accum_steps * 2
        if (self.micro_batch * self.accum_steps) != old[0] * old[1]:
            raise OutOfMemory(f"out of memory at micro-batch {old[0]}, which cannot be halved evenly")
        self.notice(f"out of memory ({type(error).__name__}): micro-batch {old[0]} x accumulation {old[1]} "
                         f"-> {self.micro_batch} x {self.accum_steps} (global batch unchanged)")

    def _clip(self) -> torch.Tensor:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.training.grad_clip or float("inf")
        return clip_grad_norm(self.model.parameters(), max_norm, pp_group=self.pp_group)

    @torch.no_grad()
    def evaluate(self) -> float:
        p = self.plan
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        batches = self.val_data.eval_batches(self.cfg.training.eval_batches, p.global_batch, seed=self.cfg.training.seed)
        per_rank = p.global_batch // p.dims.dp
        for x, y in batches:
            x, y = x[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank], y[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
            size = per_rank // self.pipeline.plan.microbatches if self.pipeline else self.micro_batch
            for xs, ys in zip(x.split(size), y.split(size)):
                with self._contexts(sync=True):
                    if self.pipeline is not None:  # forward only, stage by stage; the loss comes from the last stage
                        loss = self.pipeline.eval_loss(xs.to(self.env.device), ys.to(self.env.device), loss_fn)
                    else:
                        loss = loss_fn(self.model(xs.to(self.env.device)), ys.to(self.env.device))
                total += full_tensor(loss) * xs.shape[0] / per_rank
        self.model.train()
        return _dp_mean(total / len(batches), self.dp_group)

    # -- state -------------------------------------------------------------------------------
    def trainer_state(self, next_step: int) -> dict:
        state = {"step": next_step, "data_step": self.data_step, "skip_batches": sorted(self.skip_batches),
                 "micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
                 "skipped_steps": self.skipped, "rng_cpu": torch.get_rng_state(),
                 "seq_len": self.cfg.training.seq_len, "config_toml": dump_toml(self.cfg),
                 "model_args": dataclasses.asdict(self.plan.model_args)}
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def save(self, next_step: int) -> Path:
        start = time.perf_counter()
        path = self.writer.save(next_step, self.model, self.optimizer, self.trainer_state(next_step))
        self.last_save_s = time.perf_counter() - start
        return path

    def _restore(self, path: Path) -> int:
        state = load_checkpoint(path, self.model, self.optimizer)
        step = int(state["step"])
        self.data_step = int(state.get("data_step", step))
        self.skip_batches |= set(int(b) for b in state.get("skip_batches", []))
        self.skipped = int(state.get("skipped_steps", 0))
        if "micro_batch" in state and int(state["micro_batch"]) < self.micro_batch:
            # an earlier out-of-memory adaptation of this run still applies
            self.micro_batch, self.accum_steps = int(state["micro_batch"]), int(state["accum_steps"])
        torch.set_rng_state(state["rng_cpu"])
        return step

    def _print_memory_estimate(self):
        """The memory estimator's table for this very layout, before the first step."""
        from paratrain.estimate import estimate_for_run

        try:
            estimate = estimate_for_run(self.plan, device=self.env.device.type)
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

        peak = device_peak_bytes(self.env.device)
        peaks = [peak]
        if dist.is_initialized():
            peaks = [None] * self.env.world_size
            dist.all_gather_object(peaks, peak)
        worst = max(peaks)
        self.log.message(self.mem_estimate.compare_line(worst) + f" (worst rank {peaks.index(worst)})")

    def notice(self, text: str) -> None:
        """Events a user must see whatever the progress display (resume, rollback, OOM, preemption)."""
        if self.env.is_main:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        if self.env.is_main:
            print(text, file=sys.stderr, flush=True)

    def maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        if resume == "none" and self.restarted:
            resume = "auto"  # a relaunch after a crash continues from the newest checkpoint
        path = resolve_resume(resume, self.cfg.run_dir / "checkpoints", warn=self.warn)
        if path is None:
            return
        self.start_step = self._restore(path)
        self.notice(f"resumed from {path} at step {self.start_step}")

    def _rollback(self, bad_batches: list[int]) -> int | None:
        """After repeated non-finite steps: reload the newest checkpoint and never use those batches again."""
        self.writer.finish()
        path = newest_valid_checkpoint(self.cfg.run_dir / "checkpoints", warn=self.warn)
        if path is None:
            return None
        self.skip_batches |= set(bad_batches)
        step = self._restore(path)  # adds the checkpoint's own skip list to ours
        self.notice(f"rolled back to {path} (step {step}); skipping batches {sorted(bad_batches)}")
        return step

    def memory_report(self) -> list[dict]:
        """Bytes of parameters, gradients and optimizer state held by each rank."""

        def nbytes(t):
            t = local_tensor(t)
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        opt = self.optimizer.optim if hasattr(self.optimizer, "optim") else self.optimizer
        mine = {"rank": self.env.rank,
                "params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))}
        if not dist.is_initialized():
            return [mine]
        rows = [None] * self.env.world_size
        dist.all_gather_object(rows, mine)
        return rows

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, p, env = self.cfg, self.plan, self.env
        run_dir = cfg.run_dir
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(dump_toml(cfg))
        log = self.log = MetricsLog(run_dir / "metrics.jsonl", cfg.training.steps, 0, cfg.metrics.progress,
                                    enabled=env.is_main, sinks=build_sinks(cfg, env))
        self.maybe_resume()
        n_params, n_active = count_params(p.model_args), count_active_params(p.model_args)
        active = f" ({n_active:,} active per token)" if n_active != n_params else ""  # mixture of experts
        log.message(f"model {cfg.model.preset}: {n_params:,} parameters{active} | layout {p.dims.describe()} | "
                    f"global batch {p.global_batch} x {cfg.training.seq_len} tokens "
                    f"(micro {self.micro_batch} x accum {self.accum_steps} x dp {p.dims.dp}; {p.batch_fixed}) | "
                    f"{cfg.training.precision} on {env.device.type} | peak {self.peak / 1e12:.2f} TFLOP/s per device "
                    f"({self.peak_source})")
        if self.pipeline is not None:
            log.message(self.pipeline.plan.describe())
        self.mem_estimate = self._print_memory_estimate()
        result = TrainResult(run_dir=run_dir)
        tokens_per_step = p.global_batch * cfg.training.seq_len
        self.model.train()
        memory_rows = None
        preempt = PreemptionWatch(cfg.resilience.preempt_grace_s)
        bad_streak: list[int] = []  # data batches of the current run of consecutive non-finite steps
        step = self.start_step
        with preempt:
            while step < cfg.training.steps:
                if self.faults:
                    self.faults.before_step(step)
                if preempt.agreed():  # every rank stops at the same step boundary
                    self.writer.finish()
                    path = self.save(step)
                    if env.is_main:
                        mark_preempted(run_dir, step)
                    self.notice(f"preempted: saved {path} at step {step}; resume with --checkpoint.resume=auto")
                    result.preempted = True
                    break
                self.writer.poll()
                while self.data_step in self.skip_batches:
                    self.data_step += 1
                data_step = self.data_step
                t0 = self.timer.start()
                lr = lr_at(step, cfg.optimizer, cfg.training.steps)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                loss = self._step_gradients(step, data_step)
                grad_norm = self._clip()
                with self.timer("comm_time_s", env.device):
                    loss_value = _dp_mean(loss, self.dp_group)
                finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
                if self.scaler:
                    self.scaler.step(self.optimizer)  # skips the update itself when gradients overflowed
                    self.scaler.update()
                elif finite:
                    self.optimizer.step()
                if step == cfg.training.steps - 1:
                    memory_rows = self.memory_report()
                self.optimizer.zero_grad(set_to_none=True)
                if step == self.start_step + 1:
                    self._print_measured_peak()
                self.data_step += 1
                if not finite and not self.scaler:
                    # Loss and norm are reduced over all ranks, so every rank skips the same step.
                    self.skipped += 1
                    bad_streak.append(data_step)
                    self.notice(f"step {step + 1}: non-finite loss or gradient norm, update skipped "
                                f"({self.skipped} skipped so far)")
                    if len(bad_streak) >= cfg.resilience.max_bad_steps:
                        back = self._rollback(bad_streak)
                        if back is None:
                            raise UserError(f"{len(bad_streak)} consecutive non-finite steps and no checkpoint to "
                                            "roll back to")
                        del result.losses[max(0, back - self.start_step):]
                        bad_streak, step = [], back
                        continue
                else:
                    bad_streak = []
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                dt = time.perf_counter() - t0
                result.losses.append(loss_value)
                tok_s = tokens_per_step / dt
                record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                          "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / env.world_size,
                          "mfu": self.flops_per_token * tok_s / (self.peak * env.world_size), "step_time_s": dt,
                          "skipped_steps": self.skipped, "tokens": (step + 1) * tokens_per_step,
                          "micro_batch": self.micro_batch, "restarts": self.restart_count, **self.timer.split(dt)}
                record.update(self.train_data.progress(data_step + 1, p.global_batch))  # epochs, tokens per source
                if self.moe:  # every rank: one small all-reduce of the step's expert load
                    record.update(self.moe.step_metrics(self.dp_group))
                if self.pipeline is not None:  # every rank: one tiny all-gather over the pp group
                    idle = self.pipeline.measured_bubble()
                    record.update(pp_bubble_measured=sum(idle) / len(idle), pp_bubble_per_stage=idle,
                                  pp_bubble_predicted=self.pipeline.plan.predicted_bubble())
                if self.last_save_s is not None:
                    record["checkpoint_save_s"], self.last_save_s = self.last_save_s, None
                is_eval = cfg.training.eval_every and (step + 1) % cfg.training.eval_every == 0 and step + 1 < cfg.training.steps
                if is_eval:
                    record["val_loss"] = self.evaluate()
                show = (step + 1) % cfg.training.log_every == 0 or step == self.start_step or is_eval
                if show:  # every rank: one all-gather of per-rank memory per log step
                    record.update(gather_rank_stats(env.device))
                log.log(record, show=show)
                step += 1
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.training.steps:
                    self.save(step)

            result.skipped_steps = self.skipped
            if not result.preempted:
                self._finish(result, memory_rows)
            self.writer.finish()
        log.close()
        return result

    def _finish(self, result: TrainResult, memory_rows) -> None:
        """Final evaluation, checkpoint, export, memory report and sample."""
        cfg, p, env, log = self.cfg, self.plan, self.env, self.log
        if self.start_step < cfg.training.steps or cfg.training.eval_every:
            result.val_loss = self.evaluate()
            log.log({"step": cfg.training.steps, "val_loss": result.val_loss})
        if cfg.checkpoint.save_final and self.start_step < cfg.training.steps:
            path = self.save(cfg.training.steps)
            log.message(f"checkpoint: {path}")
        if cfg.checkpoint.export_safetensors:
            out = export_safetensors(self.model, cfg.run_dir / "model.safetensors", env.is_main)
            if out:
                log.message(f"consolidated weights: {out}")
        if self.pipeline is not None and self.pipeline.bubble_history:
            history = self.pipeline.bubble_history[1:] or self.pipeline.bubble_history  # the first step warms up
            idle = [sum(h[s] for h in history) / len(history) for s in range(p.dims.pp)]
            log.message(f"pipeline bubble: predicted {self.pipeline.plan.predicted_bubble():.1%}; measured idle per "
                        f"stage rank " + ", ".join(f"{s}: {v:.1%}" for s, v in enumerate(idle)))
        if memory_rows is not None:
            result.memory = memory_rows
            log.message(format_memory_report(memory_rows))
        if self.want_final_weights:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            if self.pipeline is None:
                weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            else:  # each stage holds its own parameter names: merge them over the pp group
                mine = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
                parts = [None] * p.dims.pp
                dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in mine.items()}, group=self.pp_group)
                weights = {k: v for part in parts for k, v in part.items()}
            result.final_weights = weights if env.is_main else None
        if cfg.sample.max_new_tokens > 0:
            model = PipelineSampler(self.pipeline, p.model_args.vocab_size) if self.pipeline else self.model
            ids = sample(model, self.prompt_ids, cfg.sample.max_new_tokens, cfg.training.seq_len,
                         cfg.sample.temperature, cfg.sample.top_k, seed=cfg.training.seed, device=env.device,
                         vocab_limit=self.tokenizer.vocab_size)
            result.sample_text = self.tokenizer.decode(ids)
            log.message("sample:\n" + cfg.sample.prompt + result.sample_text)
        if result.val_loss is not None:
            log.message(f"val loss {result.val_loss:.4f}")


def format_memory_report(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:9.2f} MiB"

    lines = ["per-rank model state: rank | parameters | gradients | optimizer"]
    lines += [f"  {r['rank']:>4} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])}" for r in rows]
    return "\n".join(lines)


def train(cfg: Config, want_final_weights: bool = False) -> TrainResult:
    """Entry point for every rank (and for a single process)."""
    from paratrain.distributed.env import world_from_env

    _, world, _ = world_from_env()
    # Checks that need only the config run before the process group exists and before data is written.
    ParallelDims.from_config(cfg.parallel, world).validate_model(model_args_for(cfg, VOCAB_PAD * cfg.parallel.tp))
    check_metrics_config(cfg.metrics)  # sink settings and their optional packages
    env = init_distributed(cfg.training.device, cfg.resilience.collective_timeout_s)
    if world > 1:
        # One rank prepares the data; the others wait, then read it or raise the same error.
        box = [None]
        if env.is_main:
            try:
                prepare_data(cfg)
            except UserError as e:
                box = [str(e)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UserError(box[0])
        meta = dataset_meta(cfg.data)
    else:
        meta = prepare_data(cfg)
    plan = plan_run(cfg, env.world_size, meta)
    torch.manual_seed(cfg.training.seed)
    result = Trainer(plan, env, want_final_weights).fit()
    shutdown_distributed()  # every rank got here at the same step: leave the process group cleanly
    return result
