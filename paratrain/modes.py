"""Every choice of a mode, declared once, and the questions asked about one mode.

A kind of mode is a `StrEnum` (Schedule, DPMode, CheckpointMode) whose members are its choices and whose properties
and methods are the questions (`layout.pp_schedule.interleaved`), or a `Literal` type with predicates here (the
others). A member is its string: it compares, hashes, formats and serialises as the config writes it. The config's
sections (config.py) are typed with Literal types (an enum's derived from its members), so a config value is checked
against them; command lines offer their tuples of choices; a name that enters as a string is made a member once
(`Layout`, `Recipe`, the planner's candidates); and code that depends on a mode asks its member, a predicate here
(or the `Layout`, for what a whole layout decides) instead of comparing strings: tests/test_architecture.py fails on
a mode string or member compared anywhere but here and in paratrain/layout.py. Torch-free.
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

# -- data parallelism --------------------------------------------------------------------------------------------
class DPMode(enum.StrEnum):
    """A data-parallel mode (`parallel.dp_mode`), in the order of what they shard (ZeRO stages): ddp nothing, zero1 the
    optimizer state, zero2 also the gradients, fsdp also the parameters, hsdp as fsdp within each replica.
    `DPMode(option)` takes a config's option: zero3 is another name for fsdp."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    FSDP = "fsdp"
    HSDP = "hsdp"

    @classmethod
    def _missing_(cls, value):
        return cls.FSDP if value == "zero3" else None

    @property
    def zero_stage(self) -> int:
        """What it shards: 0 nothing, 1 the optimizer state, 2 also the gradients, 3 also the parameters."""
        return _ZERO_STAGES[self]

    @property
    def replicates_shards(self) -> bool:
        """hsdp: FSDP within each replica group, the replicas all-reducing their shards."""
        return self is DPMode.HSDP


DP_MODES: tuple[str, ...] = tuple(m.value for m in DPMode)
DP_MODE_OPTIONS: tuple[str, ...] = (*DP_MODES, "zero3")
DPModeOption = Literal[DP_MODE_OPTIONS]  # what a config may say (config.py's schema reads a Literal's choices)
_ZERO_STAGES: dict[DPMode, int] = {mode: min(i, 3) for i, mode in enumerate(DPMode)}  # (a table: the planner asks
# it for every layout it tries)

# Data-parallel modes over one flat axis, by ZeRO stage (what a change of mode to shard more can choose).
FLAT_DP_MODES: tuple[DPMode, ...] = tuple(m for m in DPMode if not m.replicates_shards)

# -- pipeline schedules ------------------------------------------------------------------------------------------
class Schedule(enum.StrEnum):
    """A pipeline schedule (`parallel.pp_schedule`) and the questions asked about one."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    ZBV = "zbv"

    @property
    def all_forwards_first(self) -> bool:
        """gpipe: every micro-batch's forward, then every backward (no minimum of micro-batches)."""
        return self is Schedule.GPIPE

    @property
    def interleaved(self) -> bool:
        """pp_virtual stages per rank, assigned round robin."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE)

    @property
    def v_shaped(self) -> bool:
        """zbv: exactly two stages per rank, in a V (rank r runs stages r and 2pp-1-r)."""
        return self is Schedule.ZBV

    @property
    def multi_stage(self) -> bool:
        """Several stages per rank."""
        return self.interleaved or self.v_shaped

    @property
    def zero_bubble(self) -> bool:
        """The backward split into input-gradient and weight-gradient steps."""
        return self in (Schedule.INTERLEAVED_ZERO_BUBBLE, Schedule.ZBV)

    @property
    def torch_schedule_name(self) -> str:
        """The class of torch.distributed.pipelining.schedules that runs it."""
        return {Schedule.GPIPE: "ScheduleGPipe", Schedule.ONE_F_ONE_B: "Schedule1F1B",
                Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
                Schedule.INTERLEAVED_ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
                Schedule.ZBV: "ScheduleZBVZeroBubble"}[self]


SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)
ScheduleName = Literal[SCHEDULES]  # what a config may say (config.py's schema reads a Literal's choices)


# -- activation checkpointing ------------------------------------------------------------------------------------
class CheckpointMode(enum.StrEnum):
    """An activation checkpointing mode (`activation_checkpoint.mode`) and the questions asked about one.

    none; full: every block recomputes its forward in backward (keeps only its input); every_k: blocks 0, k, 2k, ... do
    that and the blocks between keep all they save (one block in k checkpointed, not "store every k blocks");
    selective: every block recomputes its element-wise ops (the outputs of its matmuls and attention are kept);
    segments: each run of k consecutive blocks (`activation_checkpoint.segment_blocks`) keeps only its input and
    recomputes as one unit in backward (n/k inputs + one segment's k blocks at a time: sqrt(n) segments of sqrt(n)
    blocks store O(sqrt n))."""

    NONE = "none"
    FULL = "full"
    EVERY_K = "every_k"
    SELECTIVE = "selective"
    SEGMENTS = "segments"

    @property
    def recomputes(self) -> bool:
        """Some block recomputes part of its forward in backward."""
        return self is not CheckpointMode.NONE

    @property
    def whole_blocks(self) -> bool:
        """Blocks recompute their whole forward (full; every_k for every k-th block; segments, a segment at a time):
        what a recomputed block keeps is at most its input, and its forward's communication runs again."""
        return self in (CheckpointMode.FULL, CheckpointMode.EVERY_K, CheckpointMode.SEGMENTS)

    @property
    def by_segments(self) -> bool:
        """Runs of consecutive blocks keep only their first block's input and recompute together."""
        return self is CheckpointMode.SEGMENTS

    @property
    def selective(self) -> bool:
        """Each block recomputes its element-wise ops and keeps the outputs of its matmuls and attention."""
        return self is CheckpointMode.SELECTIVE

    @property
    def keeps_some_blocks_whole(self) -> bool:
        """Some block keeps every activation it saves (no checkpointing, or every_k's blocks in between)."""
        return self in (CheckpointMode.NONE, CheckpointMode.EVERY_K)

    @property
    def every_block_whole(self) -> bool:
        """full: every block keeps only its input (the least memory)."""
        return self is CheckpointMode.FULL

    @property
    def uniform(self) -> bool:
        """Every block is checkpointed alike (every_k alternates full and none; segments keep their first block's
        input)."""
        return self not in (CheckpointMode.EVERY_K, CheckpointMode.SEGMENTS)

    @property
    def recompute_rank(self) -> int:
        """How much it recomputes, as a rank: none 0, selective 1, every_k 2, full and segments 3."""
        return 2 if self is CheckpointMode.EVERY_K else 3 if self.whole_blocks else int(self.selective)

    def block_checkpointing(self, n_layers: int, every_k: int) -> list[CheckpointMode]:
        """How each block is checkpointed: none, full or selective (every_k: full for blocks 0, k, 2k, ...); segments:
        every block "segments" (which block starts a segment depends on its pipeline stage: `segments`)."""
        if self is CheckpointMode.EVERY_K:
            return [CheckpointMode.FULL if i % every_k == 0 else CheckpointMode.NONE for i in range(n_layers)]
        return [self] * n_layers

    def recomputed_blocks(self, n_blocks: int, every_k: int) -> int:
        """Blocks of `n_blocks` that recompute (all of them for full, selective and segments, 1 in every_k)."""
        if not self.recomputes:
            return 0
        return -(-n_blocks // every_k) if self is CheckpointMode.EVERY_K else n_blocks

    def recompute_period(self, every_k: int) -> int:
        """One block in this many recomputes, if any does (every_k: k; the others 1)."""
        return every_k if self is CheckpointMode.EVERY_K else 1

    def forward_repeats(self, every_k: int) -> float:
        """How many times more a block's whole forward (and its communication) runs, on average over the blocks: full
        and segments 1, every_k 1/k, selective and none 0 (selective keeps what the communication made)."""
        if self is CheckpointMode.EVERY_K:
            return 1 / every_k
        return 1.0 if self.whole_blocks else 0.0

    def stores_at_least(self, other: CheckpointMode) -> bool:
        """Blocks under this mode need at least the memory they need under `other` (the same micro-batch): none more
        than any mode, every_k and selective more than full; segments less than none only (its segment recomputed at
        once may hold more than full's or selective's blocks)."""
        if self is other or not self.recomputes:
            return True
        if self.by_segments or other.by_segments or not other.recomputes:
            return False
        return not self.every_block_whole and other.every_block_whole


CHECKPOINT_MODES: tuple[str, ...] = tuple(m.value for m in CheckpointMode)
CheckpointModeName = Literal[CHECKPOINT_MODES]  # what a config may say (config.py's schema reads a Literal's choices)


def checkpointing_label(mode: str, every_k: int) -> str:
    """The mode as a layout name writes it: every_k with its k (`every_k2`), the others as they are (also an
    activation offload mode's; a mode that is a capability writes its own: `Capability.checkpointing_label`)."""
    return f"{mode}{every_k}" if mode == CheckpointMode.EVERY_K else str(mode)


def _parse_every_k_label(text: str, modes: tuple[str, ...]) -> tuple[str, int] | None:
    """(mode, every_k) of a label that writes every_k with its k (`every_k3`; alone: k = 2), None when it names none
    of `modes`."""
    if text.startswith("every_k"):
        k = text[len("every_k"):] or "2"
        return ("every_k", int(k)) if k.isdigit() and int(k) >= 1 else None
    return (text, 2) if text in modes else None


def parse_checkpointing_label(text: str) -> tuple[str, int] | None:
    """(mode, every_k) of a `checkpointing_label`, None when it names no mode (every_k alone: k = 2)."""
    return _parse_every_k_label(text, CHECKPOINT_MODES)


def describe_checkpointing(mode: CheckpointMode, every_k: int) -> str:
    """For tables: `every_k (k=2)`, the others as they are (a mode that is a capability:
    `Capability.describe_checkpointing`)."""
    return str(mode) if mode.uniform else f"{mode} (k={every_k})"


# -- precision ---------------------------------------------------------------------------------------------------
class Precision(enum.StrEnum):
    """A run's precision (`training.precision`) and the questions asked about one: fp32; bf16: bf16 compute, fp32
    master weights; fp16: the same with dynamic loss scaling; fp8: bf16 compute with the blocks' linear layers as 8-bit
    matmuls (converted by the fp8 capability module in paratrain/capabilities/). Also a weight dtype's (fp32, bf16,
    fp16: `WeightDtype`)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def low_precision(self) -> bool:
        """Matmuls, attention and FSDP's gathered parameters in 16 bits (bf16, fp16; fp8 around its 8-bit matmuls)."""
        return self is not Precision.FP32

    @property
    def loss_scaled(self) -> bool:
        """fp16: a dynamic loss scaler keeps small gradients representable."""
        return self is Precision.FP16

    @property
    def fp8_matmuls(self) -> bool:
        """fp8: the blocks' linear layers multiply 8-bit floating-point copies of their inputs, weights and output
        gradients (each with a scale), accumulating in higher precision; everything else computes as bf16 does."""
        return self is Precision.FP8

    @property
    def compute_precision(self) -> Precision:
        """The 16-bit (or fp32) format a run computes in outside 8-bit matmuls: fp8 runs compute in bf16."""
        return Precision.BF16 if self.fp8_matmuls else self

    @property
    def headroom_format(self) -> Precision:
        """The 16-bit format whose range a run's numbers are judged against: fp16 for an fp16 run, else bf16 (what a
        fp32 run would overflow first if it moved to 16 bits; an fp8 run's 8-bit casts are scaled to fit)."""
        return self if self in LOW_PRECISIONS else Precision.BF16

    @property
    def value_bytes(self) -> int:
        """Bytes of one value computed in this precision (fp8: the bf16 activations around its 8-bit matmuls)."""
        return 4 if self is Precision.FP32 else 2

    @property
    def dtype_name(self) -> str:
        """torch's name of its compute dtype (also Hugging Face's config.json `torch_dtype`): float32, bfloat16,
        float16 (fp8 computes in bfloat16 around its 8-bit matmuls)."""
        return {Precision.FP32: "float32", Precision.BF16: "bfloat16",
                Precision.FP16: "float16"}[self.compute_precision]

    def tf32_on(self, tf32: bool | None) -> bool:
        """training.tf32 resolved: unset is on for fp32 runs (a device without TF32, before Ampere, ignores it)."""
        return not self.low_precision if tf32 is None else tf32

    def matmul_math(self, tf32: bool | None, tf32_cores: bool) -> str:
        """The rate its matmuls run at: fp8 the FP8 tensor cores', bf16 and fp16 the 16-bit tensor cores', fp32 TF32's
        when training.tf32 is on (`tf32_on`) and the device has TF32 tensor cores (`tf32_cores`), else plain fp32's."""
        if self.fp8_matmuls:
            return "fp8"
        if self.low_precision:
            return "bf16"
        return "tf32" if self.tf32_on(tf32) and tf32_cores else "fp32"


PRECISIONS: tuple[str, ...] = tuple(p.value for p in Precision)
PrecisionName = Literal[PRECISIONS]  # what a config may say (config.py's schema reads a Literal's choices)
WeightDtype = Literal["fp32", "bf16", "fp16"]  # what weights are stored in (a Hugging Face export, a frozen base)
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
LOW_PRECISIONS: tuple[Precision, ...] = tuple(Precision(p) for p in WEIGHT_DTYPES if Precision(p).low_precision)
# (the 16-bit formats)

# The datasheet rates matmuls run at (paratrain/estimate/gpus.py gives each GPU's dense peak of each): plain fp32, fp32
# on TF32 tensor cores, the 16-bit tensor cores (bf16 and fp16 alike) and the FP8 tensor cores.
MatmulMath = Literal["fp32", "tf32", "bf16", "fp8"]
MATMUL_MATHS: tuple[str, ...] = get_args(MatmulMath)


# -- optimizer implementations -----------------------------------------------------------------------------------
OptimizerImpl = Literal["fused", "foreach", "for"]  # torch's AdamW kernels (optimizer.impl also takes "auto")
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)


def resolve_impl(impl: str, device_type: str, precision: str, optimizer: str = "adamw") -> OptimizerImpl:
    """`optimizer.impl` on a device: "auto" is fused, apart from fp16 off CUDA (foreach). The trainer, the estimator,
    the planner and the benches all resolve it here. Fused on a CPU is 3x foreach on the default recipe's step and
    runs on FSDP2/TP/EP DTensor parameters on gloo (bench/RESULTS.md 2026-12-02); on DTensor parameters its one
    kernel also spares the ~15 foreach ops' sharding propagation (~1 s of CPU per rank on a launch's first step).
    But torch 2.13's fused AdamW on a CPU cannot take ShardedGradScaler's found_inf (shape [1] against its scalar
    step counts: fp16 with fsdp/tp/pp, and so fp16 with CPU offload, whose optimizer steps on the CPU). SGD is
    foreach: torch 2.13 has no DTensor sharding rule for fused SGD (FSDP, TP)."""
    if impl != "auto":
        return impl
    if optimizer == "sgd":
        return "foreach"
    return "fused" if device_type == "cuda" or precision != "fp16" else "foreach"

# -- gradient compression (a capability: paratrain/capabilities/) --------------------------------------------------
class CompressionSite(enum.Enum):
    """Where gradient compression acts on a layout (its capability decides: `Compression.site`); a word here, which
    the runtime (distributed/compression.py), the estimator and the planner all ask."""

    NONE = "none"  # no compression
    DDP_HOOK = "ddp_hook"  # ddp / zero1: a DDP communication hook replaces the gradient all-reduce (every method)
    REPLICATE_HOOK = "replicate_hook"  # hsdp: an FSDP all-reduce hook over dp_replicate (sign_ef)
    REDUCE_DTYPE = "reduce_dtype"  # bf16 with FSDP: reduce-scatter (and hsdp's all-reduce) in bf16

    @property
    def hooked(self) -> bool:
        """A communication hook compresses an all-reduce (its bytes, state and compute are the method's)."""
        return self in (CompressionSite.DDP_HOOK, CompressionSite.REPLICATE_HOOK)
