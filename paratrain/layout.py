"""The parallel layout: one torch-free description of how a run is spread over ranks, and every rule about it.

The trainer, the memory estimator and the planner all use this one type. A `Layout` holds the resolved
degrees (world = pp x dp_replicate x dp_shard x cp x tp; expert parallelism borrows `ep` ranks from dp_shard;
context parallelism, cp, splits every sequence over cp ranks),
the data-parallel mode, and the pipeline's schedule, stages per rank, microbatches and blocks per stage.
Questions about a layout ("does FSDP hold the parameters?", "which ranks shard the optimizer?") are
answered by its predicates, so no other module compares mode strings.

    layout = Layout.from_config(cfg.parallel, world_size)     # degrees checked against the world size
    layout = layout.validate(model_args, world_size, batch)    # model and batch checked; automatic values filled
    cfg.parallel = layout.to_config(cfg.parallel)              # back: every degree written out

`from_config` and `to_config` are the one mapping between a layout and its `[parallel]` section (`CONFIG_KEYS`);
its name (`fsdp,tp=2,ac=full,mb=1`) and command-line flags are paratrain/layout_grammar.py's, the choices of each
mode and the questions about one mode paratrain/modes.py's. Every mistake is a ConfigError with one line naming the
setting. `distributed/parallel_dims.py` turns a Layout into a DeviceMesh; nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.errors import ConfigError, did_you_mean
from paratrain.modes import DP_MODE_OPTIONS, SCHEDULES, CheckpointMode, DPMode, Schedule
from paratrain.models.registry import layout_problem as side_head_problem
from paratrain.stage_split import balanced_split


@dataclass(frozen=True)
class Batch:
    """What a layout must divide: sequences per optimizer step, per micro-step and rank, and their length."""

    global_batch: int
    micro_batch: int
    seq_len: int


@dataclass(frozen=True)
class Layout:
    dp_mode: DPMode = DPMode.FSDP  # (an option coerced: `__post_init__`)
    dp_replicate: int = 1  # replicas (ddp and zero1 keep their whole data-parallel degree here)
    dp_shard: int = 1  # ranks each parameter is sharded over (FSDP)
    tp: int = 1
    pp: int = 1
    ep: int = 1  # experts sharded over this many of the dp_shard ranks
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B  # (a name coerced: `__post_init__`)
    pp_virtual: int = 1  # stages per pp rank
    pp_microbatches: int = 0  # per optimizer step and data-parallel rank; 0 until validate() picks it
    pp_split: tuple[int, ...] | None = None  # blocks per stage; None until validate() balances them
    cp: int = 1  # context parallel: each sequence split over cp ranks (2 x cp chunks, load-balanced)

    def __post_init__(self) -> None:
        # (a config's or a flag's name; the planner makes tens of thousands from members: no Enum lookup for those)
        if type(self.dp_mode) is not DPMode:
            object.__setattr__(self, "dp_mode", DPMode(self.dp_mode))
        if type(self.pp_schedule) is not Schedule:
            object.__setattr__(self, "pp_schedule", Schedule(self.pp_schedule))

    def with_checked(self, **changes) -> "Layout":
        """`dataclasses.replace` for fields no `__post_init__` coerces and no construction check reads (pp_split,
        pp_microbatches: `validate` fills them in): the same Layout, made tens of thousands of times a plan."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__, **changes)
        return copy

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def resolve(cls, world_size: int, *, dp_mode: str = "fsdp", dp_replicate: int = 1, dp_shard: int = -1,
                tp: int = 1, pp: int = 1, ep: int = 1, sequence_parallel: bool = True, loss_parallel: bool = True,
                pp_schedule: str = "1f1b", pp_virtual: int = 1, pp_microbatches: int = 0,
                pp_split: str | tuple[int, ...] | None = None, cp: int = 1) -> "Layout":
        """Fill in the automatic degrees (dp_shard=-1: the rest of the world) and check them against the world size.

        pp_virtual=1 with an interleaved schedule means "automatic" (2); pp_microbatches=0 is chosen from the batch
        by `validate`."""
        check_choice("parallel.dp_mode", dp_mode, DP_MODE_OPTIONS)
        check_choice("parallel.pp_schedule", pp_schedule, SCHEDULES)
        mode = DPMode(dp_mode)
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        for key, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp),
                           ("pp_virtual_stages", pp_virtual)):
            if value < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {value}")
        if dp_shard != -1 and dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard must be >= 1, or -1 for the rest of the world, got {dp_shard}")
        if pp_microbatches < 0:
            raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: automatic), got {pp_microbatches}")
        rest, r = divmod(world_size, tp * pp * cp)
        if r:
            raise ConfigError(f"parallel.tp ({tp}) x parallel.pp ({pp})" + (f" x parallel.cp ({cp})" if cp > 1 else "")
                              + f" does not divide the world size {world_size}")
        replicate, shard = dp_replicate, dp_shard
        if mode.zero_stage < 2:
            # One flat, replicated data-parallel axis; either degree may name it.
            if replicate > 1 and shard not in (-1, 1):
                raise ConfigError(f"dp_mode={mode} has one data-parallel degree: give parallel.dp_replicate or "
                                  "parallel.dp_shard, not both")
            replicate, shard = (replicate if replicate > 1 else (rest if shard == -1 else shard)), 1
        elif not mode.replicates_shards and replicate != 1:
            raise ConfigError(f"parallel.dp_replicate={replicate} with dp_mode={mode}: use dp_mode=hsdp to replicate "
                              "shards")
        elif mode.replicates_shards and replicate == 1 and world_size > 1:
            raise ConfigError("dp_mode=hsdp needs parallel.dp_replicate > 1 (replicas) and dp_shard (ranks per replica)")
        if shard == -1:
            shard, r = divmod(rest, replicate)
            if r or shard < 1:
                raise ConfigError(f"parallel.dp_replicate ({replicate}) does not divide the {rest} ranks left by tp x pp"
                                  + (" x cp" if cp > 1 else ""))
        product = replicate * shard * cp * tp * pp
        if product != world_size:
            raise ConfigError(f"parallel degrees dp_replicate={replicate} x dp_shard={shard} x "
                              + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp} x pp={pp} = {product}, but the world "
                              f"size is {world_size}")
        if mode.replicates_shards and replicate > 1 and shard == 1 and cp == 1:
            raise ConfigError(f"dp_mode=hsdp with dp_shard=1 shards nothing (each replica is one rank): use "
                              f"dp_mode=ddp (or zero1) for {replicate} replicas, or give parallel.dp_shard > 1")
        dp = replicate * shard
        if dp > 1 and mode.zero_stage < 2 and (tp > 1 or pp > 1):
            raise ConfigError(f"dp_mode={mode} does not compose with tp or pp; use dp_mode=fsdp, zero2 or hsdp")
        if cp > 1 and mode.zero_stage < 2:
            raise ConfigError(f"parallel.cp={cp} needs dp_mode fsdp, zero2 or hsdp (parameters and gradients are "
                              f"sharded over dp_shard x cp), not {mode}")
        if ep > 1:
            if mode.zero_stage < 2:
                raise ConfigError(f"parallel.ep={ep} needs dp_mode fsdp, zero2 or hsdp (experts are sharded over the "
                                  f"data-parallel ranks), not {mode}")
            if shard % ep:
                raise ConfigError(f"parallel.ep={ep} does not fit the mesh: expert parallelism borrows its ranks from "
                                  f"dp_shard={shard}, which it must divide")
        virtual = _virtual_stages(Schedule(pp_schedule), pp_virtual) if pp > 1 else 1
        split = _parse_split(pp_split) if pp > 1 else None
        if split is not None and len(split) != pp * virtual:
            raise ConfigError(_split_error(split, pp * virtual))
        # (a pipeline's last stage computes whole logits: loss parallelism is off there)
        return cls(mode, replicate, shard, tp, pp, ep, sequence_parallel, loss_parallel and pp == 1, pp_schedule,
                   virtual, pp_microbatches if pp > 1 else 0, split, cp=cp)

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "Layout":
        """From a `[parallel]` config section (config.ParallelConfig), checked against the world size."""
        return cls.resolve(world_size, **{field: getattr(parallel, key) for field, key in CONFIG_KEYS.items()})

    def to_config(self, base):
        """`base`, a `[parallel]` section (config.ParallelConfig), with this layout written over it: the section it
        resolves from on its world size, every degree written out (dp_shard too), the pipeline's settings where
        pp > 1 (blocks per stage once chosen); base's other settings (gradient compression, buckets, prefetching)
        kept."""
        values = {key: getattr(self, field) for field, key in CONFIG_KEYS.items()}
        values["pp_split"] = _fmt(self.pp_split) if self.pp_split else ""
        return dataclasses.replace(base, **values)

    def replace(self, **changes) -> "Layout":
        """A changed copy, checked again (for the estimator's and planner's what-ifs)."""
        # (all immutable; the names of its fields without `dataclasses.fields`, which the planner's thousands of
        # replaces spend most of their time in: a Layout has no ClassVar or InitVar pseudo-fields)
        fields = {**{name: getattr(self, name) for name in self.__dataclass_fields__}, **changes}
        world = fields["dp_replicate"] * fields["dp_shard"] * fields["cp"] * fields["tp"] * fields["pp"]
        virtual = fields.pop("pp_virtual")
        if "pp_schedule" in changes and "pp_virtual" not in changes:
            virtual = 1  # automatic for the new schedule
        return Layout.resolve(world, pp_virtual=virtual, **fields)

    def with_schedule(self, schedule: str, virtual: int, microbatches: int) -> "Layout":
        """`replace(pp_schedule=schedule, pp_virtual=virtual, pp_microbatches=microbatches)` without resolving the
        degrees again (they do not change: the planner makes thousands): the same Layout, or the same ConfigError."""
        check_choice("parallel.pp_schedule", schedule, SCHEDULES)
        if virtual < 1:
            raise ConfigError(f"parallel.pp_virtual_stages must be >= 1, got {virtual}")
        if microbatches < 0:
            raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: automatic), got {microbatches}")
        resolved = _virtual_stages(Schedule(schedule), virtual) if self.pp > 1 else 1
        if self.pp > 1 and self.pp_split is not None and len(self.pp_split) != self.pp * resolved:
            raise ConfigError(_split_error(self.pp_split, self.pp * resolved))
        return self.with_checked(pp_schedule=Schedule(schedule), pp_virtual=resolved,
                                 pp_microbatches=microbatches if self.pp > 1 else 0)

    # -- what the layout is ----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens of a step (dp x cp): gradients and the loss are averaged over them."""
        return self.dp * self.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def zero_stage(self) -> int:
        """What data parallelism shards (0: nothing, 1: optimizer state, 2: + gradients, 3: + parameters); context
        parallel ranks hold different tokens, so they share FSDP's sharding like data-parallel ones."""
        return self.dp_mode.zero_stage if self.dp_cp > 1 else 0

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 (`fully_shard`) holds the parameters (zero2, fsdp, hsdp)."""
        return self.zero_stage >= 2

    @property
    def uses_ddp(self) -> bool:
        """DistributedDataParallel wraps the model (ddp, zero1)."""
        return self.dp > 1 and self.dp_mode.zero_stage < 2

    @property
    def zero1(self) -> bool:
        """ZeroRedundancyOptimizer shards the optimizer state over the data-parallel ranks."""
        return self.zero_stage == 1

    @property
    def hybrid(self) -> bool:
        """HSDP: shards within a replica group, replicas across."""
        return self.dp_mode.replicates_shards and self.dp > 1

    @property
    def reshard_after_forward(self) -> bool:
        """Whether FSDP frees each block's gathered parameters after its forward: zero3/fsdp/hsdp do, zero2 keeps
        them to the backward. Inside a pipeline step no mode does: the schedule runs every micro-batch's forward and
        backward within the step, and torch.distributed.pipelining already keeps parameters gathered after each
        micro-batch's backward and holds the reduce-scatter back to the last one; resharding after forward would
        re-gather every block once per micro-batch (torchtitan makes the same choice)."""
        return self.dp_mode.zero_stage != 2 and not self.pipelined

    def fsdp_groups(self, blocks: int, moe_blocks: int = 0, pp_rank: int = 0) -> int:
        """FSDP parameter groups that all-gather on pipeline rank `pp_rank`, holding `blocks` blocks (`moe_blocks` of
        them mixture-of-experts): one per block, one per expert-parallel experts module when the experts are
        sharded over more than one rank (dp_shard / ep > 1), and the root of the model, or of each pipeline stage
        that holds parameters of its own (the first stage's embedding, the last stage's norm and output)."""
        if not self.uses_fsdp:
            return 0
        experts = moe_blocks if (self.ep > 1 and self.dp_shard // self.ep > 1) else 0
        if not self.pipelined:
            return blocks + experts + 1
        roots = sum(1 for s in (0, self.num_stages - 1) if self.stage_owner(s) == pp_rank)
        return blocks + experts + (1 if self.num_stages == 1 else roots)

    def fsdp_all_gathers(self, micro_steps: int, groups: int) -> int:
        """All-gathers of FSDP parameter groups per optimizer step, with `groups` groups on the rank (a block each,
        expert-parallel experts their own, and the root) and `micro_steps` micro-batches per rank and step. The
        trainer does this (bench/memory_accuracy.py counts them in its step), and the memory estimator and the
        planner's cost model count with this one rule: pipelined, each group once per step (gathered at its first
        forward and kept to the end of the step); zero2, once per micro-step; otherwise twice per micro-step
        (forward, backward), except the last block, which stays gathered from its forward to its backward.
        (torch.distributed.pipelining's multi-stage runtime keeps at most 3 of a rank's stages gathered: with more
        than 3 stages per rank it gathers evicted ones again and this is a lower bound; the planner uses 2 or 3.)"""
        if not self.uses_fsdp or groups <= 0:
            return 0
        if self.pipelined:
            return groups
        if not self.reshard_after_forward:
            return micro_steps * groups
        return micro_steps * (2 * groups - 1)

    def fsdp_reduce_scatters(self, micro_steps: int, groups: int) -> int:
        """Gradient reduce-scatters per optimizer step: each group once per micro-step; pipelined, once per step
        (torch.distributed.pipelining accumulates the micro-batches' gradients unsharded)."""
        if not self.uses_fsdp or groups <= 0:
            return 0
        return groups if self.pipelined else micro_steps * groups

    @property
    def fsdp_shard_axes(self) -> tuple[str, ...]:
        """Mesh axes FSDP shards over (flattened into one when there are two: dp_shard x cp, as torchtitan does)."""
        return tuple(name for name, size in (("dp_shard", self.dp_shard), ("cp", self.cp)) if size > 1)

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter, gradient and optimizer state is split over by FSDP (dp_shard x cp)."""
        return self.dp_shard * self.cp if self.uses_fsdp else 1

    @property
    def optimizer_shards(self) -> int:
        """Ranks the optimizer state is split over (FSDP's shards, or ZeRO-1's data-parallel ranks)."""
        return self.dp if self.zero1 else self.shard_degree

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp(self) -> bool:
        """Sequence parallelism: norms and the residual stream sharded along the sequence over tp."""
        return self.tp > 1 and self.sequence_parallel

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def uses_loss_parallel(self) -> bool:
        """Logits stay sharded by vocabulary through the loss (tp; a pipeline's last stage computes whole logits)."""
        return self.tp > 1 and self.loss_parallel and self.pp == 1

    def mesh_axes(self) -> list[tuple[str, int]]:
        """Named mesh axes, outermost first; only those of size > 1 (a single process has none). Why this order:
        see paratrain/distributed/parallel_dims.py."""
        axes = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp),
                ("tp", self.tp)]
        return [(name, size) for name, size in axes if size > 1]

    # -- pipeline stages -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_virtual

    def stage_owner(self, stage: int) -> int:
        """The pp rank that runs a stage: round robin, or a V for zbv (rank r runs r and 2p-1-r)."""
        if self.pp_schedule.v_shaped:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def local_stages(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_owner(s) == pp_rank]

    def stage_layers(self, stage: int) -> list[int]:
        start = sum(self.pp_split[:stage])
        return list(range(start, start + self.pp_split[stage]))

    def predicted_bubble(self) -> float:
        return predicted_bubble(self.pp, max(self.pp_microbatches, 1), self.pp_virtual)

    # -- checks against the model and the batch ---------------------------------------------------
    def validate(self, args, world_size: int, batch: Batch | None = None) -> "Layout":
        """Check the layout against the world size, the model (`ModelArgs`) and, when given, the batch.

        Returns the layout with its automatic pipeline values filled in (blocks per stage balanced by parameter
        count; microbatches: the smallest divisor of each data-parallel rank's batch reaching 2 x stages)."""
        layout = self.validate_shape(args, world_size)
        if batch is not None:
            layout = layout.check_batch(args, batch)
        return layout

    def validate_shape(self, args, world_size: int) -> "Layout":
        """`validate` without the batch: the world size, the model and the blocks per stage (none of it reads the
        pipeline's microbatches: the planner checks a shape once for all its micro-batches, then `check_batch`)."""
        if world_size != self.world_size:
            raise ConfigError(f"the layout needs {self.world_size} ranks, but the world size is {world_size}")
        self._check_model(args)
        layout = self
        if self.pp > 1:
            split = self.pp_split or balanced_split(args, self.num_stages)
            if sum(split) != args.n_layers:
                raise ConfigError(_split_error(split, self.num_stages, args.n_layers))
            layout = self.with_checked(pp_split=tuple(split))
        return layout

    def shape_key(self) -> tuple:
        """What `validate_shape` reads of the layout (its verdict and blocks per stage are the same for equal keys:
        the planner checks a value once)."""
        return (self.world_size, self.ep, self.tp, self.pp, self.pp_virtual, self.pp_schedule, self.cp, self.pp_split)

    def forward_only(self) -> "Layout":
        """The layout for forwards outside a run (`paratrain eval`: no optimizer step, no batch to cut): a pipeline
        runs each batch's stages one after the other (`Pipeline.forward`), whatever its size, and never steps its
        schedule; the schedule is still built, so it gets a microbatch count every schedule accepts (2 x stages,
        where the automatic rule starts) in place of the step's."""
        if self.pp == 1:
            return self
        return dataclasses.replace(self, pp_microbatches=2 * self.num_stages)

    def forward_batch(self, batch: Batch) -> int:
        """Sequences in one forward on a rank: the micro-batch, or with a pipeline one of its microbatches (the
        rank's share of the global batch cut into pp_microbatches)."""
        if self.pp > 1:
            return max(1, batch.global_batch // self.dp // max(self.pp_microbatches, 1))
        return batch.micro_batch

    def accumulation(self, batch: Batch) -> int:
        """Micro-steps per optimizer step: global batch = micro_batch x accumulation x dp (1 with a pipeline,
        whose schedule cuts the rank's batch into microbatches itself)."""
        if self.pp > 1:
            return 1
        per_step = batch.micro_batch * self.dp
        if batch.global_batch % per_step:
            raise ConfigError(f"global batch {batch.global_batch} is not divisible by micro_batch ({batch.micro_batch}) "
                              f"x data-parallel degree ({self.dp}) = {per_step}")
        return batch.global_batch // per_step

    def _check_model(self, args) -> None:
        """Divisibility that would otherwise fail deep inside a collective."""
        if self.ep > 1:
            if not args.moe_experts:
                raise ConfigError(f"parallel.ep={self.ep} needs a mixture-of-experts model (model.moe_experts > 0)")
            if args.moe_experts % self.ep:
                raise ConfigError(f"model.moe_experts={args.moe_experts} is not divisible by parallel.ep={self.ep}")
        if self.tp > 1:
            names = ["n_heads", "n_kv_heads", "dim"]
            if not all(args.is_moe_layer(i) for i in range(args.n_layers)):
                names.append("ffn_hidden")  # dense MLPs are sharded by hidden unit; routed experts are not
            for name in names:
                value = getattr(args, name)
                if value % self.tp:
                    raise ConfigError(f"model {name}={value} is not divisible by parallel.tp={self.tp}")
            shared = args.expert_hidden * args.moe_shared_experts if args.moe_experts else 0
            if shared % self.tp:
                raise ConfigError(f"shared-expert width {shared} (model.moe_ffn_hidden x moe_shared_experts) is not "
                                  f"divisible by parallel.tp={self.tp}")
            if args.vocab_size % self.tp:
                raise ConfigError(f"vocab size {args.vocab_size} is not divisible by parallel.tp={self.tp} "
                                  "(the embedding and output are sharded by vocabulary)")
            if args.tie_embeddings:
                raise ConfigError("tied embeddings do not compose with tensor parallelism; set model.tie_embeddings=false")
        if self.pp > 1:
            if self.num_stages > args.n_layers:
                what = f"parallel.pp={self.pp}" + (f" x {self.pp_virtual} virtual stages ({self.pp_schedule})"
                                                   if self.pp_virtual > 1 else "")
                raise ConfigError(f"{what} = {self.num_stages} pipeline stages, but the model has only {args.n_layers} "
                                  "blocks (model.n_layers); each stage needs at least one block")
            if args.tie_embeddings:
                raise ConfigError("tied embeddings do not compose with pipeline parallelism (the embedding is on the "
                                  "first stage, the output on the last); set model.tie_embeddings=false")
        why = side_head_problem(self, args)  # the model's side heads' (models/family.SideHead)
        if why:
            raise ConfigError(why)
        if self.cp > 1 and args.moe_experts:
            raise ConfigError(f"parallel.cp={self.cp} does not support mixture-of-experts models (model.moe_experts > 0): "
                              "routing capacity and the balance loss are computed over whole sequences")

    def check_batch(self, args, batch: Batch) -> "Layout":
        """`validate`'s checks against the batch (after `validate_shape`): the layout with its microbatches."""
        if batch.seq_len > args.max_seq_len:
            raise ConfigError(f"training.seq_len={batch.seq_len} is longer than the model's max_seq_len="
                              f"{args.max_seq_len}")
        if self.cp > 1 and batch.seq_len % (2 * self.cp):
            raise ConfigError(f"training.seq_len={batch.seq_len} is not divisible by 2 x parallel.cp = {2 * self.cp} "
                              f"(context parallelism cuts each sequence into 2 x cp chunks; rank i holds chunks i and "
                              f"2cp-1-i, so causal attention costs every rank the same)")
        if self.sp and batch.seq_len % (self.tp * self.cp):
            raise ConfigError(f"training.seq_len={batch.seq_len} is not divisible by parallel.tp={self.tp} "
                              + ("(sequence parallel)" if self.cp == 1 else
                                 f"x parallel.cp={self.cp} (sequence parallel splits each context-parallel rank's "
                                 f"{batch.seq_len // self.cp} tokens over tp)"))
        if self.pp == 1:
            self.accumulation(batch)
            return self
        if batch.global_batch % self.dp:
            raise ConfigError(f"global batch {batch.global_batch} is not divisible by the data-parallel degree "
                              f"({self.dp})")
        per_rank = batch.global_batch // self.dp
        m = self.pp_microbatches
        if m == 0:
            m = next((d for d in range(1, per_rank + 1) if per_rank % d == 0 and d >= 2 * self.num_stages), per_rank)
        elif per_rank % m:
            raise ConfigError(f"parallel.pp_microbatches={m} does not divide the batch of each data-parallel rank "
                              f"({per_rank} sequences = global batch / data-parallel degree)")
        if not self.pp_schedule.all_forwards_first and m < self.pp:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule} needs at least parallel.pp={self.pp} "
                              f"microbatches, got {m} (parallel.pp_microbatches, at most the {per_rank} sequences per "
                              "data-parallel rank)")
        if self.pp_schedule.multi_stage and m % max(1, m // self.pp):
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule}: {m} microbatches must be a multiple of the "
                              f"{m // self.pp} rounds of {self.pp} (choose a multiple of parallel.pp)")
        return self.with_checked(pp_microbatches=m)

    def batch_key(self, microbatches: int) -> tuple:
        """What `check_batch` reads of the layout with `microbatches` (its verdict is the same for equal keys: the
        planner checks a value once)."""
        return (self.cp, self.tp, self.sequence_parallel, self.pp, self.dp, self.pp_virtual, self.pp_schedule,
                microbatches)

    def check_checkpointing(self, mode: str) -> None:
        """Activation checkpointing (`activation_checkpoint.mode`) against the pipeline schedule: the zero-bubble
        schedules split each backward into an input-gradient and a weight-gradient step over one kept graph, which
        selective checkpointing refuses ("backward an extra time") and which keeps every micro-batch's recomputed
        forward to the end of the step (measured with torch 2.13: zbv with full checkpointing peaks 22% above zbv
        without), so checkpointing only costs there."""
        if self.pp > 1 and self.pp_schedule.zero_bubble and CheckpointMode(mode).recomputes:
            raise ConfigError(f"activation_checkpoint.mode={mode} does not work with parallel.pp_schedule="
                              f"{self.pp_schedule} (the zero-bubble backward keeps the recomputed activations to the end "
                              "of the step); use pp_schedule=1f1b or interleaved_1f1b, or mode=none")

    # -- description -----------------------------------------------------------------------------
    def describe(self) -> str:
        """One line for logs: `pp=2 x dp_shard=2 x tp=2 (fsdp)`."""
        parts = [f"{n}={s}" for n, s in self.mesh_axes()] or ["single process"]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (within dp_shard)")
        return f"{' x '.join(parts)} ({self.dp_mode if self.dp_cp > 1 else 'no data parallelism'})"

    def describe_pipeline(self) -> str:
        return (f"pipeline: {self.pp_schedule}, {self.pp} ranks x {self.pp_virtual} stage(s) = {self.num_stages} "
                f"stages (blocks per stage {list(self.pp_split or ())}), {self.pp_microbatches} microbatches; "
                f"predicted bubble {self.predicted_bubble():.1%}")

    def short_name(self) -> str:
        """Compact form for tables: `pp2 1f1b m=8 x fsdp 4 x cp2 x tp2 x ep2`."""
        bits = []
        if self.pp > 1:
            bits.append(f"pp{self.pp} {self.pp_schedule}" + (f" v={self.pp_virtual}" if self.pp_virtual > 1 else "")
                        + f" m={self.pp_microbatches}")
        if self.dp > 1:
            bits.append(f"{self.dp_mode} {self.dp_replicate}x{self.dp_shard}" if self.hybrid
                        else f"{self.dp_mode} {self.dp}")
        if self.cp > 1:
            bits.append(f"cp{self.cp}")
        if self.tp > 1:
            bits.append(f"tp{self.tp}")
        if self.ep > 1:
            bits.append(f"ep{self.ep}")
        return " x ".join(bits) or "1 rank"


# Layout field -> its `[parallel]` key (config.ParallelConfig): the one mapping between the two, both ways.
CONFIG_KEYS: dict[str, str] = {f.name: {"pp_virtual": "pp_virtual_stages"}.get(f.name, f.name)
                               for f in dataclasses.fields(Layout)}


def predicted_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a GPipe/1F1B pipeline, (p-1)/(m+p-1); interleaving divides it by the stages per rank."""
    return (pp - 1) / (microbatches + pp - 1) / virtual


def _virtual_stages(schedule: Schedule, requested: int) -> int:
    if schedule.multi_stage:
        virtual = requested if requested > 1 else 2
        if schedule.v_shaped and virtual != 2:
            raise ConfigError(f"parallel.pp_schedule=zbv runs exactly 2 stages per rank, not "
                              f"parallel.pp_virtual_stages={virtual}")
        return virtual
    if requested != 1:
        raise ConfigError(f"parallel.pp_virtual_stages={requested} needs an interleaved schedule "
                          f"(interleaved_1f1b, interleaved_zero_bubble or zbv), not {schedule}")
    return 1


def _parse_split(split) -> tuple[int, ...] | None:
    if split is None or split == "":
        return None
    if isinstance(split, str):
        try:
            split = tuple(int(x) for x in split.split(","))
        except ValueError:
            raise ConfigError(f"parallel.pp_split='{split}' must be comma-separated block counts, e.g. '3,3,2'") from None
    split = tuple(int(x) for x in split)
    if min(split) < 1:
        raise ConfigError(_split_error(split, len(split)))
    return split


def _fmt(split) -> str:
    return ",".join(map(str, split))


def _split_error(split, stages: int, n_layers: int | None = None) -> str:
    total = f", summing to model.n_layers={n_layers}" if n_layers is not None else ""
    return f"parallel.pp_split='{_fmt(split)}' must give {stages} stages of at least one block each{total}"


def check_choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(options)}"
                          + did_you_mean(value, options, cutoff=0.6))
