"""Gradient compression (`[parallel] grad_compression`: none | bf16 | powersgd | sign_ef; docs/optimizers.md): what
the data-parallel gradient reduction sends. Here: its `[parallel]` keys (`adds_to`, placed after `ddp_bucket_mb`) and
their checks, its value type `Compression` (the method and its settings; every question about one), where it acts
on a layout (`grad_compression_site`, `Compression.site`), how an optimizer that communicates itself (1-bit Adam,
its own capability) takes the collective over (`Compression.run_by`, `in_phase`, `check_optimizer`), what the run's
reduction is (`GradReduction`, the `gradient_reduction` hook's answer: the trainer hands it to
distributed/compression.py's `GradComm`, the runtime: hooks, per-parameter state, byte counts; capabilities may not
import distributed/), and what it costs and saves (`Compression.cost`, `CompressionCost.seconds`: the estimator's and
the planner's terms, priced on the profile the estimator passes).

The run's settings are a `Compression` that every Recipe holds (`Recipe.compression`, none included) and the
planner's Context (`Context.compression`): the capability is never among `Recipe.capabilities` (`from_config` is
None); its class registers the keys and their checks.

For the gradients G (fp32) one data-parallel rank reduces with the compressed collective (ddp/zero1: all of its
gradients; hsdp's replicate hook: its FSDP shard), per optimizer step:

  method    wire bytes / fp32 ring all-reduce's     state kept between steps           temporaries in the hook
  bf16      1/2                                     -                                  a bf16 copy (G/2)
  powersgd  sum r(n+m) over the matrices it         error feedback (G) + Q (m r each)  the input's copy (G) and P
            compresses (n m > 2 r (n+m)) + the
            rest uncompressed, over G/4
  sign_ef   1/32 + scales (one fp32 per tensor      worker residual (G) + server       the padded matrix, its
            piece, or per `sign_ef_block`)          residual (G/p)                     residual, the signs (~2.2 G)

Compute: bf16 two casts; powersgd 6 n m r FLOPs per compressed matrix (P = M Q, Q = M^T P, M' = P Q^T) plus the
error feedback's element-wise passes; sign_ef ~14 element-wise passes over G (error feedback, scales, pack, unpack,
decompress, both phases). Each also costs operator launches (per parameter for powersgd and sign_ef).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError, UserError
from paratrain.layout import Layout, check_choice
from paratrain.modes import CompressionSite
from paratrain.optimizers import GradientReduction, OptimizerEntry, Phase

FP32 = 4

GradCompression = Literal["none", "bf16", "powersgd", "sign_ef"]
GRAD_COMPRESSIONS: tuple[str, ...] = get_args(GradCompression)


@dataclass
class CompressionKeys:
    # -- communication (docs/optimizers.md: gradient compression; docs/layouts.md: overlap) --
    # Compress the data-parallel gradient all-reduce: ddp/zero1 (DDP comm hook), hsdp's replicate dimension (sign_ef:
    # FSDP all-reduce hook; bf16: reduce dtype); bf16 also reduce-scatters fsdp/zero2 gradients in bf16.
    grad_compression: GradCompression = "none"
    powersgd_rank: int = 4  # PowerSGD's matrix approximation rank
    powersgd_warmup_steps: int = 10  # plain all-reduce for the first steps (>= 2: DDP rebuilds its buckets at step 1)
    sign_ef_block: int = 0  # sign_ef: one scale per this many elements (a multiple of 8; 0: one per tensor piece)
    sign_ef_warmup_steps: int = 0  # sign_ef: plain fp32 all-reduce for the first steps (1-bit Adam's warm-up stage)


@dataclass(frozen=True)
class Compression:
    """The `[parallel]` settings that decide what the gradient reduction sends; every question about the method."""

    method: GradCompression = "none"
    powersgd_rank: int = 4
    sign_ef_block: int = 0
    powersgd_warmup_steps: int = 10  # (the run's: plain all-reduces before the compressed ones)
    sign_ef_warmup_steps: int = 0

    @classmethod
    def from_config(cls, parallel) -> "Compression":
        return cls(parallel.grad_compression, parallel.powersgd_rank, parallel.sign_ef_block,
                   parallel.powersgd_warmup_steps, parallel.sign_ef_warmup_steps)

    def config_values(self) -> dict:
        """Its `[parallel]` keys and values (`from_config` backwards)."""
        return {"grad_compression": self.method, "powersgd_rank": self.powersgd_rank,
                "sign_ef_block": self.sign_ef_block, "powersgd_warmup_steps": self.powersgd_warmup_steps,
                "sign_ef_warmup_steps": self.sign_ef_warmup_steps}

    def wire_settings(self) -> dict:
        """What decides the bytes a step sends, by name (the estimate's JSON): the method and its rank or block (the
        warm-ups are steps of the run before it)."""
        return {"method": self.method, "powersgd_rank": self.powersgd_rank, "sign_ef_block": self.sign_ef_block}

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def casts_to_bf16(self) -> bool:
        """bf16: the gradients travel as a bf16 copy."""
        return self.method == "bf16"

    @property
    def low_rank(self) -> bool:
        """powersgd: each gradient matrix travels as a rank-r approximation with error feedback."""
        return self.method == "powersgd"

    @property
    def one_bit(self) -> bool:
        """sign_ef: each element travels as its sign, with a scale per tensor piece and error feedback."""
        return self.method == "sign_ef"

    def check_flags(self) -> "Compression":
        """These settings as command-line flags (`plan`, `estimate`): a one-line error where no run could use them."""
        if self.method not in GRAD_COMPRESSIONS:
            raise UserError(f"--grad-compression '{self.method}' is not one of {', '.join(GRAD_COMPRESSIONS)}")
        if self.powersgd_rank < 1 or self.sign_ef_block < 0 or self.sign_ef_block % 8:
            raise UserError("--powersgd-rank must be >= 1 and --sign-ef-block 0 or a multiple of 8")
        return self

    def site(self, layout: Layout) -> CompressionSite:
        """Where it acts on `layout`, or a ConfigError (`grad_compression_site`)."""
        return grad_compression_site(layout, self.method)

    def cost(self, shapes: list[tuple[int, ...]], p: int) -> "CompressionCost":
        """What compressing the gradients of `shapes` (what one rank reduces) over p ranks costs and saves."""
        numel = sum(math.prod(s) for s in shapes)
        if not self.enabled or numel == 0 or p <= 1:
            return CompressionCost()
        G = numel * FP32
        if self.casts_to_bf16:
            return CompressionCost(0.5, 0, G // 2, 3 * G, 0.0, 2)
        if self.low_rank:
            compressed, plain = powersgd_split(shapes, self.powersgd_rank)
            sent = plain + sum(r * (n + m) for n, m, r in compressed)
            q = sum(m * r for _, m, r in compressed) * FP32
            pmem = sum(n * r for n, _, r in compressed) * FP32
            flops = sum(6 * n * m * r + 4 * (n + m) * r * r for n, m, r in compressed)
            return CompressionCost(sent / numel, G + q, G + pmem + plain * FP32, 8 * G, flops,
                                   12 * len(compressed) + 8, 3)
        # sign_ef: 1 bit per element, scales per tensor piece (one per parameter and rank) or per block
        block = self.sign_ef_block
        scales = numel / block if block else len(shapes) * p
        sent = numel / 8 + FP32 * scales
        return CompressionCost(sent / G, G + math.ceil(G / p), int(2.2 * G), 14 * G, 0.0, 20 + 6 * len(shapes), 2)

    # -- with an optimizer that communicates itself (OptimizerEntry.communicates: 1-bit Adam, 0/1 Adam) ---------------
    def run_by(self, entry: OptimizerEntry) -> "Compression":
        """The compressed collective a run of `entry` holds state for: these settings, or the optimizer's own
        collective with them (sign_ef_block)."""
        return dataclasses.replace(self, method=entry.compression) if entry.communicates else self

    def in_phase(self, entry: OptimizerEntry, phase: Phase) -> "Compression":
        """What one of `entry`'s phases' reductions sends: its 1-bit all-reduce, else the uncompressed one."""
        own = phase.reduction is GradientReduction.ONE_BIT
        return self.run_by(entry) if own else dataclasses.replace(self, method=Compression().method)

    def check_optimizer(self, entry: OptimizerEntry, key: str = "parallel.grad_compression") -> None:
        """A one-line ConfigError where `entry` cannot run with this method (set by `key`): one that communicates
        itself takes none, and an entry may refuse a method (`refuses_compression`)."""
        if entry.communicates and self.enabled:
            raise ConfigError(f"optimizer.name={entry.name} compresses its own communication (the momentum's 1-bit "
                              f"all-reduce): {key} must be none, got {self.method}")
        reason = entry.refuses_compression(self.method, key)
        if reason:
            raise ConfigError(f"optimizer.name={entry.name} {reason}")


def grad_compression_site(layout: Layout, method: str) -> CompressionSite:
    """Where `parallel.grad_compression` acts on this layout, or a ConfigError naming what would work:

      NONE            no compression
      DDP_HOOK        ddp / zero1: a DDP communication hook replaces the gradient all-reduce (every method)
      REPLICATE_HOOK  hsdp: FSDP reduce-scatters within a replica uncompressed, then a hook all-reduces the shard
                      over dp_replicate compressed (sign_ef)
      REDUCE_DTYPE    bf16 with FSDP (zero2, fsdp, hsdp, also under tp/pp/ep): MixedPrecisionPolicy(reduce_dtype=
                      bf16) reduce-scatters (and for hsdp all-reduces) the gradients in bf16
    """
    check_choice("parallel.grad_compression", method, GRAD_COMPRESSIONS)
    comp = Compression(method)
    if not comp.enabled:
        return CompressionSite.NONE
    key = f"parallel.grad_compression={method}"
    if layout.dp_cp == 1:
        raise ConfigError(f"{key} compresses the data-parallel gradient reduction, but {layout.describe()} has no data "
                          "parallelism; use it with dp_mode ddp, zero1 or hsdp over several ranks")
    if layout.uses_ddp:
        return CompressionSite.DDP_HOOK
    if comp.casts_to_bf16:
        return CompressionSite.REDUCE_DTYPE
    if not layout.hybrid:
        raise ConfigError(f"{key} compresses all-reduces (ddp, zero1, hsdp's dp_replicate dimension); dp_mode="
                          f"{layout.dp_mode} reduce-scatters its gradients, where only bf16 applies (reduce-scatter in "
                          "bf16); use dp_mode=ddp or zero1, or hsdp with dp_replicate > 1")
    if comp.low_rank:
        raise ConfigError(f"{key} is PyTorch's DDP hook and needs whole gradient matrices; hsdp's replicate all-reduce "
                          "sees flat shards: use sign_ef or bf16 with hsdp, or powersgd with dp_mode=ddp or zero1")
    if layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.cp > 1:
        raise ConfigError(f"{key} with hsdp supports no tp, pp, ep or cp yet (the hook needs one FSDP mesh of dense "
                          "blocks); use bf16 there, or hsdp alone")
    return CompressionSite.REPLICATE_HOOK


@dataclass(frozen=True)
class GradReduction:
    """What a run's data-parallel gradient reduction runs, decided here and handed by the trainer (training/step.py)
    to distributed/compression.py's GradComm: the compressed collective it holds state for, where it acts, the
    schedule of an optimizer that communicates itself, and the name its state is saved under (the method, or the
    optimizer's)."""

    compression: Compression = field(default_factory=Compression)
    site: CompressionSite = CompressionSite.NONE
    schedule: object = None  # the optimizer's (OptimizerEntry.schedule: 1-bit Adam's MomentumSchedule)
    name: str = "none"

    @classmethod
    def of_run(cls, compression: Compression, layout: Layout, entry: OptimizerEntry | None = None, optimizer=None,
               steps: int = 0) -> "GradReduction":
        """The run's `compression` (Recipe.compression) on `layout`, for the optimizer `entry` with its
        OptimizerConfig `optimizer` (None: one that does not communicate itself) in a run of `steps` optimizer steps
        (1-bit Adam's default warm-up is a share of them)."""
        comp, schedule, name = compression, None, compression.method
        if optimizer is not None and entry is not None and entry.communicates and layout.dp > 1:
            schedule = entry.schedule(optimizer, steps)
            comp = comp.run_by(entry)  # its 1-bit all-reduce (sign_ef_block)
            name = entry.name  # it names the state in checkpoints and the notices
        return cls(comp, comp.site(layout), schedule, name)


# -- what it costs and saves (the estimator's and the planner's terms) -------------------------------------------------


@dataclass(frozen=True)
class CompressionCost:
    wire_fraction: float = 1.0  # bytes on the wire / those of the uncompressed fp32 reduction
    state_bytes: int = 0  # kept from step to step (error feedback, PowerSGD's Q)
    transient_bytes: int = 0  # alive while the hook runs
    memory_bytes: float = 0.0  # element-wise memory traffic of compressing and decompressing
    gemm_flops: float = 0.0  # PowerSGD's matrix products
    ops: int = 0  # operator launches per step
    collectives: int = 1  # collectives per bucket (latency): powersgd 3, sign_ef 2 (all-to-all + all-gather)

    def seconds(self, hw, fp32_flops: float) -> float:
        """Compute seconds of compressing and decompressing on `hw` (an estimate.profile.Hardware; `fp32_flops`: its
        fp32 matmul rate, as the estimator resolves it): PowerSGD's GEMMs, the element-wise traffic, the launches."""
        return (self.gemm_flops / (fp32_flops * hw.gemm_rate(max(self.gemm_flops / max(self.ops, 1), 1.0)))
                if self.gemm_flops else 0.0) + self.memory_bytes / hw.mem_bandwidth + self.ops * hw.op_overhead_s


def powersgd_matrix(shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """torch's powerSGD_hook's decision for one gradient: (n, m, r) when it compresses the tensor as an n x m matrix
    (n = shape[0], m = numel / n) of rank r = min(n, m, rank), i.e. when r (n + m) x 2 < n m (its
    min_compression_rate 2); None when it sends it uncompressed (vectors, small matrices)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = math.prod(shape) // max(n, 1)
    r = min(n, m, rank)
    return (n, m, r) if r * (n + m) * 2 < n * m else None


def powersgd_split(shapes: list[tuple[int, ...]], rank: int) -> tuple[list[tuple[int, int, int]], int]:
    """([(n, m, r) of the matrices PowerSGD compresses], elements it sends uncompressed)."""
    compressed, plain = [], 0
    for shape in shapes:
        matrix = powersgd_matrix(shape, rank)
        if matrix is None:
            plain += math.prod(shape)
        else:
            compressed.append(matrix)
    return compressed, plain


@dataclass(frozen=True)
class GradientCompression(Capability):
    """The registration of gradient compression: its `[parallel]` keys and their checks. Its run value is a
    `Compression` (Recipe.compression), never an instance of this class."""

    name = "grad_compression"
    adds_to = ("parallel", CompressionKeys)
    adds_after = "ddp_bucket_mb"

    @classmethod
    def from_config(cls, cfg) -> None:
        return None

    @classmethod
    def gradient_reduction(cls, compression, layout, entry, optimizer=None, steps: int = 0) -> GradReduction:
        return GradReduction.of_run(compression, layout, entry, optimizer, steps)

    @classmethod
    def check(cls, cfg) -> None:
        p = cfg.parallel
        if p.powersgd_rank < 1:
            raise ConfigError("parallel.powersgd_rank must be >= 1")
        if p.sign_ef_warmup_steps < 0:
            raise ConfigError("parallel.sign_ef_warmup_steps must be >= 0")
        if p.sign_ef_block < 0 or p.sign_ef_block % 8 != 0:
            raise ConfigError("parallel.sign_ef_block must be 0 (one scale per tensor piece) or a positive multiple "
                              "of 8")
        if p.powersgd_warmup_steps < 2:
            raise ConfigError("parallel.powersgd_warmup_steps must be >= 2 (DDP rebuilds its gradient buckets after "
                              "the first step; PowerSGD's state is kept per bucket)")
