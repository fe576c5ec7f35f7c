"""The planner from Python: a `PlanRequest` of typed values in, the ranked `Plan` out.

    from paratrain.estimate.planner import PlanRequest, plan
    best = plan(PlanRequest("llama3-8b", gpus=8, seq=8192, global_batch_tokens=1 << 20)).ranked[0]

`plan_context(request)` is the planning `Context`, the world size and the search's `Options` the request makes (what
`paratrain plan` plans, explains and writes out; tests and benchmarks predict single layouts in it). `paratrain plan`
reads its arguments into a request (paratrain/commands/plan.py), so bad values are the same one-line `UserError`,
named by the command line's flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple

from paratrain.capabilities import implied_by_settings, optimizer_entry
from paratrain.capabilities.grad_compression import Compression
from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.estimate.gpus import HEADROOM, check_headroom, parse_memory
from paratrain.estimate.hardware import bandwidth_link, resolve_hardware
from paratrain.estimate.model_states import model_params
from paratrain.estimate.hetero import MAX_GPUS, build_groups, plan_hetero, slowest_first
from paratrain.estimate.search import AC_MODES, PLANNED_SCHEDULES, Options, Plan, evaluate, explain, parse_layout
from paratrain.estimate.search import plan as search_plan
from paratrain.estimate.step_time import Context, all_reduce_time, planned_run
from paratrain.layout import CONFIG_KEYS
from paratrain.layout_grammar import COMPRESSION_KEYS, LAYOUT_KEYS, layout_flags
from paratrain.models.args import ModelArgs
from paratrain.models.presets import preset_args
from paratrain.modes import DP_MODE_OPTIONS, DP_MODES, PRECISIONS, SCHEDULES, CheckpointMode, DPMode, Schedule

# The [parallel] values a plan may pin (the layout flags of `paratrain plan`, paratrain/layout_grammar.py): each fixes
# that field of every planned layout; the blocks per stage and tp without sequence or loss parallelism are the
# planner's to choose. The gradient compression and the DDP bucket size are the run's, planned as given.
PINNED_KEYS = tuple(k for k in LAYOUT_KEYS if k not in ("pp_split", "sequence_parallel", "loss_parallel"))
PLAN_FLAG_KEYS = (*PINNED_KEYS, *COMPRESSION_KEYS, "ddp_bucket_mb")

GpuGroupSpec = tuple[int, str] | Mapping  # (count, GPU name or profile), or a cluster file's [[group]] table


@dataclass(frozen=True)
class PlanRequest:
    """What to plan, `paratrain plan`'s defaults where unset; a field is the flag of its name (`parallel`: the layout
    flags, `capabilities`: the capabilities' section flags with their sections' other keys, `memory_tiers`: not
    --no-memory-tiers)."""

    model: str | ModelArgs  # a preset name, or the model's ModelArgs
    # ranks in all, or GPU groups in rank order (a heterogeneous cluster: [(8, "H100"), (8, "A100")], or the
    # [[group]] tables of a cluster file, estimate/hetero.py read_cluster)
    gpus: int | Sequence[GpuGroupSpec] | None = None
    model_name: str | None = None  # printed, and in errors (default: the preset's name, else "model")
    vocab_size: int | None = 128  # for presets that take the vocabulary from the data
    gpus_per_node: int = 8
    gpu: str = "H100"  # a GPU name from the table, or a saved calibration profile's
    gpu_memory: int | str | None = None  # memory per GPU (bytes, or text: "40GiB") instead of the gpu's
    intra: str | None = None  # intra-node link (default: the GPU's usual one)
    inter: str | None = None  # inter-node link (default ib400)
    inter_node_bandwidth: str | None = None  # a node's link to the others ("1Gbit"), over `inter`'s
    profile_dir: str | None = None  # where calibration profiles live (default ~/.cache/paratrain/profiles)
    seq: int | None = None  # sequence length (default: min(max_seq_len, 4096))
    global_batch_tokens: int | None = None  # tokens per optimizer step (default: 512 sequences or 4Mi tokens)
    precision: str | None = None  # modes.PRECISIONS (default: bf16 on GPUs, fp32 on a CPU profile)
    compile: bool = False  # training.compile: compiled blocks
    tf32: bool | None = None  # training.tf32 (unset: on for fp32 where the GPU has TF32)
    optimizer: str = "adamw"  # an entry of paratrain/optimizers.py
    # what the run uses besides what its precision and optimizer imply (a capability with a section of its own, e.g.
    # adapters on a frozen model)
    capabilities: tuple = ()
    parallel: Mapping[str, object] = field(default_factory=dict)  # pinned [parallel] values (keys: PLAN_FLAG_KEYS)
    dp_modes: Sequence[str] | None = None  # the choices searched (default: all)
    schedules: Sequence[str] | None = None  # (default: PLANNED_SCHEDULES)
    checkpointing: Sequence[str] | None = None  # (default: AC_MODES)
    micro_batches: Sequence[int] | None = None  # (default: 1, 2, 4, 8, 16)
    max_tp: int | None = None
    max_pp: int | None = None
    max_cp: int | None = None  # (default: any leaving each rank 1024 tokens or more of a sequence)
    headroom: float | None = None  # fraction of device memory kept free (default estimate.gpus.HEADROOM)
    host_memory: int | str | None = None  # host memory per node (bytes, or text: "512GiB"; default: not checked)
    memory_tiers: bool = True  # try the chunked loss, activation offloading and CPU offload when nothing fits


class Planning(NamedTuple):
    """A request resolved: what every planned layout shares, the world size and the search's options."""

    ctx: Context
    world: int
    opts: Options

    def plan(self, top: int = 5) -> Plan:
        """The layouts ranked by predicted step time, memory-checked (UserError when none fits)."""
        if self.ctx.cluster:
            return plan_hetero(self.ctx, self.opts, top=top)
        return search_plan(self.ctx, self.world, self.opts, top=top)

    def explain(self, layout: str) -> str:
        """Why `layout` (a layout name as printed) is rejected, or how it ranks."""
        if self.ctx.cluster:
            raise UserError("--explain plans one GPU type; for a heterogeneous cluster run the plan and read its "
                            "stages")
        return explain(layout, self.ctx, self.world, self.opts)

    # -- what a capability's alternative to the plain plan asks (Capability.plan_alternative: local SGD) --
    @staticmethod
    def of(request: PlanRequest) -> "Planning":
        """Another request resolved (e.g. one node's share of the run)."""
        return plan_context(request)

    def parameter_count(self) -> int:
        return sum(p.numel for p in model_params(self.ctx.args))

    @staticmethod
    def all_reduce_s(nbytes: float, ranks: int, link) -> float:
        return all_reduce_time(nbytes, ranks, link)

    def candidate(self, name: str):
        """The candidate a layout's name (as printed) is on this world (UserError / ConfigError when none)."""
        return parse_layout(name, self.ctx, self.world)

    def evaluate(self, candidate):
        """A candidate's prediction and memory check (a search Result: `reason` None when it fits)."""
        return evaluate(candidate, self.ctx, self.opts.headroom)


def plan(request: PlanRequest, top: int = 5) -> Plan:
    """The ranked plan for `request` (`Plan.ranked[0]` the first choice)."""
    return plan_context(request).plan(top)


def plan_context(request: PlanRequest) -> Planning:
    """The planning Context, world size and Options of `request`; UserError on bad input."""
    r = request
    hw, world, per_node, groups = _hardware(r)
    headroom = check_headroom(HEADROOM if r.headroom is None else r.headroom)
    name, margs, seq, native, tokens = _shape(r)
    precision = r.precision or ("fp32" if hw.device == "cpu" else "bf16")
    if precision not in PRECISIONS:
        raise UserError(f"--precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    for capability in implied_by_settings(precision, r.optimizer):  # (fp8 needs FP8 tensor cores)
        capability.check_hardware([g.hw for g in groups] if groups else [hw])
    flags = pinned_values(r.parallel)
    parallel = dataclasses.replace(ParallelConfig(), **flags)
    compression = Compression.from_config(parallel).check_flags()
    if parallel.ddp_bucket_mb <= 0:
        raise UserError(f"--ddp-bucket-mb must be > 0, got {parallel.ddp_bucket_mb}")
    entry = optimizer_entry(r.optimizer)
    compression.check_optimizer(entry, "--grad-compression")
    host = _bytes(r.host_memory)
    # the settings every candidate shares (each sets its own layout, checkpointing, micro-batch and memory tiers);
    # the capabilities its precision and optimizer imply come with it (fp8's GEMM rate and casts)
    run = planned_run(hw, precision=precision, tf32=r.tf32, seq_len=seq, optimizer=entry.name,
                      compression=compression, ddp_bucket_mb=parallel.ddp_bucket_mb, compile=r.compile,
                      capabilities=r.capabilities,
                      **{c.recipe_field: c for c in r.capabilities if c.recipe_field})  # (a field of its own)
    ctx = Context(margs, run, tokens // seq, hw, per_node, name, native_max_seq_len=native, cluster=groups,
                  host_memory_bytes=host)
    return Planning(ctx, world, _options(r, fixed_fields(flags), headroom))


def _hardware(r: PlanRequest) -> tuple:
    """(the hardware the plan's shared terms use, world size, GPUs per node, the GPU groups or None)."""
    if r.gpus is None:
        raise UserError("--gpus N is required (the number of GPUs to plan for, or groups like 8xH100,8xA100)")
    if r.gpus_per_node < 1:
        raise UserError("--gpus-per-node must be >= 1")
    if isinstance(r.gpus, int):
        world = r.gpus
        if world < 1:
            raise UserError("--gpus and --gpus-per-node must be >= 1")
        if world > MAX_GPUS:
            raise UserError(f"--gpus {world} is more than {MAX_GPUS} GPUs (a typo?); the planner enumerates the "
                            "layouts of at most that many")
        if world > r.gpus_per_node and world % r.gpus_per_node:
            raise UserError(f"--gpus {world} is not divisible by --gpus-per-node {r.gpus_per_node} "
                            "(whole nodes only)")
        hw = resolve_hardware(r.gpu, r.intra, r.inter, r.profile_dir)
        if r.gpu_memory is not None:
            hw = dataclasses.replace(hw, memory_bytes=_bytes(r.gpu_memory))
        if r.inter_node_bandwidth is not None:
            hw = dataclasses.replace(hw, inter=bandwidth_link(r.inter_node_bandwidth, min(r.gpus_per_node, world)))
        return hw, world, min(r.gpus_per_node, world), None
    if r.gpu_memory is not None:
        raise UserError("--gpu-memory sets the memory of --gpu's GPUs; a heterogeneous cluster's come from its GPU "
                        "names or profiles")
    groups = build_groups(list(r.gpus), r.gpus_per_node, r.intra, r.inter, r.profile_dir)
    world = sum(g.count for g in groups)
    per_node = min(g.gpus_per_node for g in groups)
    return slowest_first(groups), world, per_node, groups if len(groups) > 1 else None  # one type: the ordinary plan


def _shape(r: PlanRequest) -> tuple:
    """(model name, ModelArgs, sequence length, the model's own max_seq_len or None, tokens per step)."""
    if isinstance(r.model, str):
        name, margs = r.model_name or r.model, preset_args(r.model, vocab_size=r.vocab_size)
    else:
        name, margs = r.model_name or "model", r.model
    seq = r.seq or min(margs.max_seq_len, 4096)
    if seq < 1:
        raise UserError(f"--seq must be >= 1, got {seq}")
    native = None
    if seq > margs.max_seq_len:  # a long-context stage: the model trained on longer sequences than its preset's
        native, margs = margs.max_seq_len, dataclasses.replace(margs, max_seq_len=seq)
    tokens = r.global_batch_tokens or min(4 * 2**20, 512 * seq)
    if tokens % seq:
        raise UserError(f"--global-batch-tokens {tokens} is not a multiple of --seq {seq}")
    return name, margs, seq, native, tokens


def _options(r: PlanRequest, fixed: dict, headroom: float) -> Options:
    return Options(
        dp_modes=tuple(map(DPMode, _one_or_choices(fixed.get("dp_mode"), "--dp-mode", r.dp_modes, "--dp-modes",
                                                   DP_MODES))),
        schedules=tuple(map(Schedule, _one_or_choices(fixed.get("pp_schedule"), "--pp-schedule", r.schedules,
                                                      "--schedules", PLANNED_SCHEDULES, SCHEDULES))),
        ac_modes=tuple(map(CheckpointMode, checked_choices(r.checkpointing, AC_MODES, "--checkpointing") or AC_MODES)),
        micro_batches=micro_batch_sizes(r.micro_batches), max_tp=r.max_tp, max_pp=r.max_pp, max_cp=r.max_cp,
        headroom=headroom, fixed=fixed, memory_tiers=r.memory_tiers)


def _bytes(memory: int | str | None) -> int | None:
    return parse_memory(memory) if isinstance(memory, str) else memory


def pinned_values(values: Mapping[str, object]) -> dict:
    """The [parallel] values a plan pins, checked: keys of PLAN_FLAG_KEYS, degrees >= 1 (dp_shard -1: the rest)."""
    unknown = sorted(set(values) - set(PLAN_FLAG_KEYS))
    if unknown:
        raise UserError(f"parallel: {unknown[0]!r} is not a setting a plan pins (one of {', '.join(PLAN_FLAG_KEYS)})")
    return layout_flags(SimpleNamespace(**values), PLAN_FLAG_KEYS)


def fixed_fields(flags: dict) -> dict:
    """The Layout fields the pinned values fix (every planned layout has them): dp_shard -1 fixes nothing."""
    field_of = {key: field for field, key in CONFIG_KEYS.items()}
    fixed = {field_of[k]: v for k, v in flags.items() if k in PINNED_KEYS and not (k == "dp_shard" and v == -1)}
    if "dp_mode" in fixed:
        if fixed["dp_mode"] not in DP_MODE_OPTIONS:
            raise UserError(f"--dp-mode '{fixed['dp_mode']}' is not one of {', '.join(DP_MODE_OPTIONS)}")
        fixed["dp_mode"] = DPMode(fixed["dp_mode"])
    if "pp_schedule" in fixed and fixed["pp_schedule"] not in SCHEDULES:
        raise UserError(f"--pp-schedule '{fixed['pp_schedule']}' is not one of {', '.join(SCHEDULES)}")
    return fixed


def checked_choices(values: Sequence | None, allowed: Sequence | None, flag: str) -> tuple | None:
    """None (not given), or the values given as a tuple, each one of `allowed` (any when None), and not none."""
    if values is None:
        return None
    items = tuple(values)
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise UserError(f"{flag}: '{bad[0]}' is not one of {', '.join(allowed)}")
    if not items:
        raise UserError(f"{flag} is empty")
    return items


def micro_batch_sizes(values: Sequence[int] | None) -> tuple[int, ...] | None:
    """The micro-batch sizes to try, checked (each >= 1), or None (the planner's powers of two)."""
    if values is not None and any(v < 1 for v in values):
        raise UserError("--micro-batches must be >= 1")
    return checked_choices(values, None, "--micro-batches")


def _one_or_choices(one, one_flag: str, many, flag: str, default: tuple, allowed: tuple | None = None) -> tuple:
    """A pinned value, or the choices to search (`default` when neither is given)."""
    if one is not None and many is not None:
        raise UserError(f"give {one_flag} or {flag}, not both")
    if one is not None:
        return (one,)
    return checked_choices(many, allowed or default, flag) or default
