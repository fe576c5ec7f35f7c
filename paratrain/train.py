"""The training loop: one code path for one process and for every parallel layout.

Read top to bottom: resolve the run (data, model size, layout, batch) -> build the model on the
meta device and parallelise it -> optimizer -> optional resume -> step loop -> final eval,
checkpoint, memory report and a sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from paratrain.config import Config, dump_toml
from paratrain.data import DEFAULT_CORPUS, TokenData, ensure_prepared, load_tokenizer, read_meta
from paratrain.distributed.env import DistEnv, init_distributed
from paratrain.distributed.grad_norm import clip_grad_norm
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import PRECISION_DTYPES, parallelize, unwrap, uses_fsdp
from paratrain.errors import ConfigError, UserError
from paratrain.flops import peak_flops
from paratrain.generate import sample
from paratrain.metrics import MetricsLog
from paratrain.models import ModelArgs, Transformer, count_params, flops_per_token, preset_args
from paratrain.optim import build_optimizer, lr_at

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


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    sample_text: str | None = None
    final_weights: dict | None = None
    skipped_steps: int = 0
    memory: list[dict] = field(default_factory=list)  # per rank: bytes of params, grads, optimizer state
    run_dir: Path | None = None


def data_source(cfg: Config) -> Path:
    return DEFAULT_CORPUS if cfg.data.source == "tinyshakespeare" else Path(cfg.data.source)


def prepare_data(cfg: Config) -> dict:
    tokenizer, path = cfg.data.tokenizer, None
    if tokenizer.endswith(".json"):
        tokenizer, path = "tokenizer.json", tokenizer
    return ensure_prepared(data_source(cfg), cfg.data.dir, tokenizer=tokenizer, vocab_size=cfg.data.vocab_size,
                           tokenizer_path=path, val_fraction=cfg.data.val_fraction)


def model_args_for(cfg: Config, data_vocab: int) -> ModelArgs:
    m = cfg.model
    padded = math.ceil(data_vocab / VOCAB_PAD) * VOCAB_PAD
    overrides = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
                                             "rope_theta", "tie_embeddings")}
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
    accum = dims.validate_batch(global_batch, t.micro_batch, t.seq_len)
    return RunPlan(cfg, dims, args, Path(cfg.data.dir), global_batch, accum, fixed)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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

        self.train_data = TokenData(plan.data_dir, "train", cfg.training.seq_len)
        self.val_data = TokenData(plan.data_dir, "val", cfg.training.seq_len)
        self.tokenizer = load_tokenizer(plan.data_dir)
        self.prompt_ids = self.tokenizer.encode(cfg.sample.prompt)  # fails now, not after training

        # Build on the meta device (no memory) and materialise after sharding. Tied embeddings are the
        # exception: materialising from meta would untie them, so those models are built for real.
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
            if uses_fsdp(dims) or dims.tp_enabled:
                # DTensor gradients: the sharded scaler unscales local shards and agrees on overflow across ranks.
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(dev.type)
            else:
                self.scaler = torch.amp.GradScaler(dev.type)
        self.loss_parallel = dims.tp_enabled and dims.loss_parallel

        if env.world_size > 1:
            coords = self.mesh.get_coordinate() if self.mesh is not None else None
            axes = dict(zip(self.mesh.mesh_dim_names, coords)) if coords is not None else {}
            env.print(f"{dev} | mesh position {axes} | data shard {self.dp_rank}", all_ranks=True)
        self.flops_per_token = flops_per_token(plan.model_args, cfg.training.seq_len)
        self.peak, self.peak_source = peak_flops(dev, cfg.metrics.peak_tflops)
        self.start_step, self.skipped = 0, 0

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

    def _forward_backward(self, micro_batches) -> torch.Tensor:
        accum = len(micro_batches)
        total = torch.zeros((), device=self.env.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)  # (B, T)
            with self._contexts(sync=i == accum - 1):
                loss = loss_fn(self.model(x), y) / accum  # mean over this rank's share of the global batch
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += _local(loss.detach())
        return total

    def _clip(self) -> torch.Tensor:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.training.grad_clip or float("inf")
        return clip_grad_norm(self.model.parameters(), max_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        p = self.plan
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        batches = self.val_data.eval_batches(self.cfg.training.eval_batches, p.global_batch, seed=self.cfg.training.seed)
        per_rank = p.global_batch // p.dims.dp
        for x, y in batches:
            x, y = x[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank], y[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
            for xs, ys in zip(x.split(self.cfg.training.micro_batch), y.split(self.cfg.training.micro_batch)):
                with self._contexts(sync=True):
                    loss = loss_fn(self.model(xs.to(self.env.device)), ys.to(self.env.device))
                total += _local(loss) * xs.shape[0] / per_rank
        self.model.train()
        return _dp_mean(total / len(batches), self.dp_group)

    # -- state -------------------------------------------------------------------------------
    def trainer_state(self, next_step: int) -> dict:
        state = {"step": next_step, "skipped_steps": self.skipped, "rng_cpu": torch.get_rng_state(),
                 "config_toml": dump_toml(self.cfg), "model_args": dataclasses.asdict(self.plan.model_args)}
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def save(self, next_step: int) -> Path:
        return save_checkpoint(self.cfg.run_dir / "checkpoints", next_step, self.model, self.optimizer,
                               self.trainer_state(next_step), self.cfg.checkpoint.keep, self.env.is_main,
                               self.tokenizer)

    def maybe_resume(self, log) -> None:
        path = resolve_resume(self.cfg.checkpoint.resume, self.cfg.run_dir / "checkpoints")
        if path is None:
            return
        state = load_checkpoint(path, self.model, self.optimizer)
        self.start_step, self.skipped = int(state["step"]), int(state.get("skipped_steps", 0))
        torch.set_rng_state(state["rng_cpu"])
        log(f"resumed from {path} at step {self.start_step}")

    def memory_report(self) -> list[dict]:
        """Bytes of parameters, gradients and optimizer state held by each rank."""

        def nbytes(t):
            t = t.to_local() if hasattr(t, "to_local") else t
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
        log = MetricsLog(run_dir / "metrics.jsonl", cfg.training.steps, 0, cfg.metrics.progress, enabled=env.is_main)
        self.maybe_resume(log.message)
        n_params = count_params(p.model_args)
        log.message(f"model {cfg.model.preset}: {n_params:,} parameters | layout {p.dims.describe()} | "
                    f"global batch {p.global_batch} x {cfg.training.seq_len} tokens "
                    f"(micro {cfg.training.micro_batch} x accum {p.accum_steps} x dp {p.dims.dp}; {p.batch_fixed}) | "
                    f"{cfg.training.precision} on {env.device.type} | peak {self.peak / 1e12:.2f} TFLOP/s per device "
                    f"({self.peak_source})")
        result = TrainResult(run_dir=run_dir)
        tokens_per_step = p.global_batch * cfg.training.seq_len
        self.model.train()
        memory_rows = None
        for step in range(self.start_step, cfg.training.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.optimizer, cfg.training.steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            micro = self.train_data.micro_batches(step, p.global_batch, cfg.training.seed, self.dp_rank, p.dims.dp,
                                                  p.accum_steps)
            loss = self._forward_backward(micro)
            grad_norm = self._clip()
            if self.scaler:
                self.scaler.step(self.optimizer)  # skips the update itself when gradients overflowed
                self.scaler.update()
            elif torch.isfinite(grad_norm):
                self.optimizer.step()
            else:
                self.skipped += 1  # every rank sees the same reduced norm, so all skip together
                log.message(f"step {step}: non-finite gradient norm, update skipped")
            if step == cfg.training.steps - 1:
                memory_rows = self.memory_report()
            self.optimizer.zero_grad(set_to_none=True)
            loss_value = _dp_mean(loss, self.dp_group)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            dt = time.perf_counter() - t0
            result.losses.append(loss_value)
            tok_s = tokens_per_step / dt
            record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                      "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / env.world_size,
                      "mfu": self.flops_per_token * tok_s / (self.peak * env.world_size), "step_time_s": dt,
                      "skipped_steps": self.skipped, "tokens": (step + 1) * tokens_per_step}
            is_eval = cfg.training.eval_every and (step + 1) % cfg.training.eval_every == 0 and step + 1 < cfg.training.steps
            if is_eval:
                record["val_loss"] = self.evaluate()
            show = (step + 1) % cfg.training.log_every == 0 or step == self.start_step or is_eval
            log.log(record, show=show)
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.training.steps:
                self.save(step + 1)

        result.skipped_steps = self.skipped
        if self.start_step < cfg.training.steps or cfg.training.eval_every:
            result.val_loss = self.evaluate()
            log.log({"step": cfg.training.steps, "val_loss": result.val_loss})
        if cfg.checkpoint.save_final and self.start_step < cfg.training.steps:
            path = self.save(cfg.training.steps)
            log.message(f"checkpoint: {path}")
        if memory_rows is not None:
            result.memory = memory_rows
            log.message(format_memory_report(memory_rows))
        if self.want_final_weights:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            result.final_weights = weights if env.is_main else None
        if cfg.sample.max_new_tokens > 0:
            ids = sample(self.model, self.prompt_ids, cfg.sample.max_new_tokens, p.model_args.max_seq_len,
                         cfg.sample.temperature, cfg.sample.top_k, seed=cfg.training.seed, device=env.device,
                         vocab_limit=self.tokenizer.vocab_size)
            result.sample_text = self.tokenizer.decode(ids)
            log.message("sample:\n" + cfg.sample.prompt + result.sample_text)
        if result.val_loss is not None:
            log.message(f"val loss {result.val_loss:.4f}")
        log.close()
        return result


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
    env = init_distributed(cfg.training.device)
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
        meta = read_meta(cfg.data.dir)
    else:
        meta = prepare_data(cfg)
    plan = plan_run(cfg, env.world_size, meta)
    torch.manual_seed(cfg.training.seed)
    return Trainer(plan, env, want_final_weights).fit()
