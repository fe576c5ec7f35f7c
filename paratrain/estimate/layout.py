"""The estimator's own view of a parallel layout, including what the trainer cannot run yet (pipeline
stages). Validated here, with one-line errors, because `ParallelDims.from_config` rejects pp > 1.

World = pp x dp_replicate x dp_shard x tp. Expert parallelism borrows its ranks from dp_shard (as in
`paratrain/distributed/expert_parallel.py`): ep must divide dp_shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError

DP_MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")  # distributed/pipeline.py
INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")


@dataclass(frozen=True)
class Layout:
    dp_mode: str = "fsdp"  # ddp | zero1 | zero2 | fsdp | hsdp (zero3 = fsdp)
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    microbatches: int = 1  # pipeline microbatches per step (pp > 1); with pp = 1 see accumulation
    pp_virtual: int = 1  # stages per rank: interleaved schedules 2 by default, zbv always 2
    pp_split: tuple[int, ...] | None = None  # blocks per stage (pp x pp_virtual of them); None: balanced

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 (fully_shard) holds the parameters: as in parallelize.uses_fsdp."""
        return self.dp > 1 and self.dp_mode in ("zero2", "fsdp", "hsdp")

    @property
    def uses_ddp(self) -> bool:
        return self.dp > 1 and self.dp_mode in ("ddp", "zero1")

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter, gradient and optimizer state is split over by FSDP."""
        return self.dp_shard if self.uses_fsdp else 1

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    def describe(self) -> str:
        parts = []
        if self.pp > 1:
            sched = self.pp_schedule + (f" v={self.pp_virtual}" if self.pp_schedule in INTERLEAVED else "")
            parts.append(f"pp={self.pp} ({sched}, {self.microbatches} microbatches)")
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        if self.dp_shard > 1 or (self.dp > 1 and self.dp_mode in ("ddp", "zero1")):
            parts.append(f"{'dp' if self.dp_mode in ('ddp', 'zero1') else 'dp_shard'}={self.dp_shard if self.uses_fsdp else self.dp}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" +sp" if self.sequence_parallel else ""))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if not parts:
            return "1 rank"
        mode = self.dp_mode if self.dp > 1 else ""
        return f"{self.world_size} ranks: " + " x ".join(parts) + (f" ({mode})" if mode else "")


def resolve_layout(*, world_size: int | None = None, dp_mode: str = "fsdp", dp_replicate: int = 1,
                   dp_shard: int = -1, tp: int = 1, pp: int = 1, ep: int = 1, sequence_parallel: bool = True,
                   loss_parallel: bool = True, pp_schedule: str = "1f1b", microbatches: int | None = None,
                   pp_virtual: int = 2, pp_split: tuple[int, ...] | None = None) -> Layout:
    """Fill in dp_shard (-1: the rest of the world) and check the degrees; UserError on any mistake."""
    if dp_mode not in DP_MODES:
        raise UserError(f"--dp-mode '{dp_mode}' is not one of {', '.join(DP_MODES)}")
    mode = "fsdp" if dp_mode == "zero3" else dp_mode
    for name, value in (("--dp-replicate", dp_replicate), ("--tp", tp), ("--pp", pp), ("--ep", ep),
                        ("--pp-virtual", pp_virtual)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if dp_shard != -1 and dp_shard < 1:
        raise UserError(f"--dp-shard must be >= 1 (or -1 for the rest of the world), got {dp_shard}")
    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {world_size}")
    if pp_schedule not in SCHEDULES:
        raise UserError(f"--pp-schedule '{pp_schedule}' is not one of {', '.join(SCHEDULES)}")
    if mode in ("ddp", "zero1") and dp_shard not in (-1, 1) and dp_replicate > 1:
        raise UserError(f"--dp-mode {mode} has one data-parallel degree: give --dp-replicate or --dp-shard, not both")
    if mode in ("zero2", "fsdp") and dp_replicate > 1:
        raise UserError(f"--dp-replicate {dp_replicate} with --dp-mode {mode}: use --dp-mode hsdp to replicate shards")
    if dp_shard == -1:
        if world_size is None:
            dp_shard = 1
        else:
            rest, r = divmod(world_size, tp * pp * dp_replicate)
            if r or rest < 1:
                raise UserError(f"tp={tp} x pp={pp} x dp_replicate={dp_replicate} does not divide the world size "
                                f"{world_size}")
            dp_shard = rest
    if mode in ("ddp", "zero1") and dp_replicate > 1:
        dp_shard, dp_replicate = dp_replicate * dp_shard, 1  # one flat data-parallel axis
    product = dp_replicate * dp_shard * tp * pp
    if world_size is not None and product != world_size:
        raise UserError(f"dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} x pp={pp} = {product}, "
                        f"but the world size is {world_size}")
    if mode == "hsdp" and dp_replicate == 1 and dp_shard > 1:
        raise UserError("--dp-mode hsdp needs --dp-replicate > 1 (replicas of the shard group)")
    if tp > 1 and mode in ("ddp", "zero1") and dp_replicate * dp_shard > 1:
        raise UserError(f"--dp-mode {mode} does not compose with tp in paratrain; use --dp-mode fsdp or hsdp with tp")
    if ep > 1:
        if mode not in ("zero2", "fsdp", "hsdp"):
            raise UserError(f"--ep {ep} needs --dp-mode fsdp, zero2 or hsdp (experts are sharded over the "
                            f"data-parallel ranks), not {mode}")
        if dp_shard % ep:
            raise UserError(f"--ep {ep} must divide dp_shard={dp_shard} (expert parallelism borrows its ranks from it)")
    if microbatches is None:
        microbatches = pp if pp > 1 else 1
    if microbatches < 1:
        raise UserError(f"--microbatches must be >= 1, got {microbatches}")
    if pp > 1 and pp_schedule in (*INTERLEAVED, "zbv") and microbatches % pp:
        raise UserError(f"--pp-schedule {pp_schedule} needs --microbatches ({microbatches}) divisible by pp={pp}")
    if pp > 1 and microbatches < pp and pp_schedule != "gpipe":
        raise UserError(f"--microbatches {microbatches} < pp={pp}: the pipeline never fills; use at least {pp}")
    virtual = 2 if pp_schedule == "zbv" else (pp_virtual if pp_schedule in INTERLEAVED else 1)
    if pp == 1:
        virtual, pp_split = 1, None
    if pp_split is not None:
        pp_split = tuple(int(x) for x in pp_split)
        if len(pp_split) != pp * virtual or min(pp_split) < 1:
            raise UserError(f"--pp-split needs {pp * virtual} positive block counts (one per stage), got "
                            f"{','.join(map(str, pp_split))}")
    return Layout(mode, dp_replicate, dp_shard, tp, pp, ep, sequence_parallel, loss_parallel, pp_schedule,
                  microbatches, virtual, pp_split)


def check_model(layout: Layout, args, seq_len: int, micro_batch: int) -> None:
    """Divisibility of the model by the layout (the trainer's ParallelDims.validate_model, plus pp and ep)."""
    t = layout.tp
    moe_layers = [i for i in range(args.n_layers) if _is_moe(args, i)]
    if t > 1:
        names = ["n_heads", "n_kv_heads", "dim"] + ([] if len(moe_layers) == args.n_layers else ["ffn_hidden"])
        for name in names:
            value = getattr(args, name)
            if value % t:
                raise UserError(f"model {name}={value} is not divisible by tp={t}")
        if args.vocab_size % t:
            raise UserError(f"vocab size {args.vocab_size} is not divisible by tp={t} (embedding and output are "
                            "sharded by vocabulary)")
        if getattr(args, "tie_embeddings", False):
            raise UserError("tied embeddings do not compose with tensor parallelism (model.tie_embeddings=false)")
        if layout.sequence_parallel and seq_len % t:
            raise UserError(f"sequence length {seq_len} is not divisible by tp={t} (sequence parallel)")
        shared = _expert_hidden(args) * getattr(args, "moe_shared_experts", 0) if moe_layers else 0
        if shared % t:
            raise UserError(f"shared-expert width {shared} is not divisible by tp={t}")
    if layout.pp > 1:
        chunks = layout.pp * layout.pp_virtual
        if args.n_layers < chunks:
            raise UserError(f"{args.n_layers} layers cannot fill {chunks} pipeline stages"
                            + (f" (pp={layout.pp} x {layout.pp_virtual} chunks per rank)" if layout.pp_virtual > 1 else ""))
        if getattr(args, "tie_embeddings", False):
            raise UserError("tied embeddings span the first and last pipeline stage; set model.tie_embeddings=false "
                            "with pp > 1")
        if layout.pp_split is not None and sum(layout.pp_split) != args.n_layers:
            raise UserError(f"--pp-split {','.join(map(str, layout.pp_split))} covers {sum(layout.pp_split)} blocks, "
                            f"the model has {args.n_layers}")
    if layout.ep > 1:
        experts = getattr(args, "moe_experts", 0)
        if not experts:
            raise UserError(f"--ep {layout.ep} needs a mixture-of-experts model (moe_experts > 0)")
        if experts % layout.ep:
            raise UserError(f"moe_experts={experts} is not divisible by ep={layout.ep}")
    if micro_batch < 1 or seq_len < 1:
        raise UserError("--micro-batch and --seq-len must be >= 1")
    if seq_len > args.max_seq_len:
        raise UserError(f"sequence length {seq_len} exceeds the model's max_seq_len {args.max_seq_len}")


def _is_moe(args, index: int) -> bool:
    return getattr(args, "moe_experts", 0) > 0 and index >= getattr(args, "moe_first_dense_layers", 0)


def _expert_hidden(args) -> int:
    return getattr(args, "moe_ffn_hidden", None) or args.ffn_hidden
