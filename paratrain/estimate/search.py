"""Enumerate the layouts paratrain can run, reject those that cannot run or do not fit (the memory estimator, with
headroom), predict the step time of the rest (paratrain/estimate/step_time.py) and rank them."""

from __future__ import annotations

import gc
import heapq
import math
from dataclasses import dataclass, field

from paratrain import capabilities
from paratrain.capabilities import optimizer_entry
from paratrain.errors import ConfigError, UserError
from paratrain.estimate.gpus import HEADROOM
from paratrain.layout import Batch, Layout
from paratrain.layout_grammar import parse_layout_name
from paratrain.modes import CheckpointMode, DPMode, Schedule
from paratrain.estimate.step_time import (Candidate, Context, Prediction, without_microbatches, cached, pipeline_key,
                                          predict, rank_blocks, step_lower_bound)
from paratrain.estimate import Target, activations as A, estimate, inputs_for
from paratrain.estimate.core import in_flight
from paratrain.estimate.gpus import fits, fmt_bytes, limit_text, usable_bytes
from paratrain.estimate.model_states import stage_blocks, state_bytes
from paratrain.estimate.report import ROWS
from paratrain.estimate.step_time import attention_time, group_link, ring_time, routed_expert_params
from paratrain.models.presets import block_param_count
from paratrain.models.registry import attention_shape

# The schedules planned by default: all but interleaved_zero_bubble, which the cost model predicts as interleaved_1f1b
# (the same bubble) and which allows no checkpointing (`--schedules` or `--pp-schedule` may still name it).
PLANNED_SCHEDULES = tuple(s for s in Schedule if not (s.interleaved and s.zero_bubble))
AC_MODES = tuple(sorted(CheckpointMode, key=lambda mode: mode.recompute_rank))  # the least recomputation first
# Context parallelism is enumerated while each rank keeps at least this many tokens of a sequence: below it a ring
# step's attention is too short to hide the K/V transfer, so more cp only adds exposed communication.
MIN_CP_TOKENS = 1024


@dataclass
class Options:
    dp_modes: tuple[DPMode, ...] = tuple(DPMode)
    schedules: tuple[Schedule, ...] = PLANNED_SCHEDULES
    ac_modes: tuple[str, ...] = AC_MODES
    micro_batches: tuple[int, ...] | None = None  # None: powers of two up to 16
    max_tp: int | None = None
    max_pp: int | None = None
    max_cp: int | None = None  # None: any degree leaving each rank at least MIN_CP_TOKENS of a sequence
    headroom: float = HEADROOM  # fraction of device memory kept free (estimate.gpus: the rule estimate uses too)
    estimate_limit: int = 120  # memory estimates run (cheapest predicted first) before giving up
    fixed: dict = field(default_factory=dict)  # Layout field -> value every planned layout has (the layout flags)
    memory_tiers: bool = True  # when nothing fits: try the chunked loss, activation offloading and CPU offload


@dataclass
class Result:
    cand: Candidate
    pred: Prediction | None = None
    reason: str | None = None  # why it was rejected
    total_bytes: int | None = None  # memory per rank (estimator total, worst rank)
    estimate: object = None
    stage_hw: list | None = None  # heterogeneous clusters: each pipeline rank's hardware
    even: Prediction | None = None  # heterogeneous clusters: the same layout with the even (balanced) split
    bound: dict | None = None  # when only a lower bound of its memory was computed: {"states", "activations"}

    @property
    def ok(self) -> bool:
        return self.reason is None and self.pred is not None


_NO_RESULT = None  # a Result's fields but cand and reason (`_result`)


def _result(cand: Candidate, reason: str | None) -> Result:
    """`Result(cand, reason=reason)` without the dataclass's __init__ (made for every candidate of a plan)."""
    global _NO_RESULT
    if _NO_RESULT is None:
        _NO_RESULT = vars(Result(None))
    r = object.__new__(Result)
    r.__dict__.update(_NO_RESULT, cand=cand, reason=reason)
    return r


class _Rejected(Result):
    """A Result of `structural_reason`'s rejection whose candidate is made when first read (a large plan rejects tens
    of thousands, and reads few)."""

    @property
    def cand(self) -> Candidate:
        made = self.__dict__["cand"]
        if made is None:
            lay, mb, make = self.__dict__["unmade"]
            made = self.__dict__["cand"] = make(lay, mb)
        return made


def _rejected(lay: Layout, mb: int, make, reason: str) -> Result:
    """`Result(make(lay, mb), reason=reason)`, its candidate made when read."""
    if _NO_RESULT is None:
        _result(None, None)
    r = object.__new__(_Rejected)
    r.__dict__.update(_NO_RESULT, cand=None, reason=reason, unmade=(lay, mb, make))
    return r


@dataclass
class Plan:
    ctx: Context
    opts: Options
    ranked: list[Result]  # feasible, fastest first
    rejected: list[Result] = field(default_factory=list)
    considered: int = 0
    unestimated: int = 0  # candidates never memory-checked (slower than enough feasible ones)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_reason(c: Candidate, ctx: Context) -> str | None:
    """Why paratrain cannot run this layout here (None: it can, memory aside): the planner's placement rules, then
    the layout's own checks against the model and the batch (`Layout.validate`)."""
    return _placement_reason(c, ctx) or _checkpointing_reason(c)


def _placement_reason(c: Candidate, ctx: Context) -> str | None:
    """structural_reason's checks of the layout and the micro-batch (the same for every checkpointing mode)."""
    reason = _group_placement_reason(c.layout, c.micro_batch, ctx)
    if reason:
        return reason
    key = ("layout_reason", id(ctx.args), ctx.global_seqs, ctx.seq_len, ctx.compression.method, ctx.optimizer)
    # (a layout's candidates come one after the other, one per checkpointing mode: the last layout's reason is
    # found without hashing the layout)
    last = ctx.cache.get("last layout_reason")
    if last is not None and last[0] is c.layout and last[1] == c.micro_batch and last[2] == key:
        reason = last[3]
    else:
        shapes = lambda lay: cached(ctx, ("layout shape", id(ctx.args), ctx.compression.method, ctx.optimizer,
                                          *without_microbatches(lay)), lambda: _shape_reasons(lay, c.world, ctx))
        reason = cached(ctx, (*key, c.layout, c.micro_batch), lambda: _layout_reason(c.layout, c.micro_batch, ctx,
                                                                                      shapes))
        ctx.cache["last layout_reason"] = (c.layout, c.micro_batch, key, reason)
    return reason or None


def _checkpointing_reason(c: Candidate) -> str | None:
    """structural_reason's checks of the checkpointing mode against the schedule and the memory tiers."""
    return _mode_reason(c.layout, c.ac, c.switched)


def _mode_reason(lay: Layout, ac: CheckpointMode, switched: tuple) -> str | None:
    try:
        lay.check_checkpointing(ac)
        for capability in switched:  # (activation offload: not with every mode)
            capability.check_checkpointing(ac)
    except ConfigError as e:
        return str(e)
    return None


def _layout_reason(lay: Layout, mb: int, ctx: Context, shapes) -> str:
    """The layout's own checks against the model and the batch ("" when it passes; the same for every checkpointing
    mode): `Layout.validate`'s, then the run's (gradient compression, optimizer). `shapes(lay)`: `_shape_reasons` of
    the layout (what reads no microbatches: once per shape for all its micro-batches)."""
    checked, run_reason = shapes(lay)
    if isinstance(checked, str):
        return checked
    # (check_batch reads only the fields of Layout.batch_key: once per value of them)
    key = ("check_batch", id(ctx.args), ctx.global_seqs, mb, ctx.seq_len, checked.batch_key(lay.pp_microbatches))
    reason = ctx.cache.get(key)
    if reason is None:
        try:
            checked.with_checked(pp_microbatches=lay.pp_microbatches).check_batch(
                ctx.args, Batch(ctx.global_seqs, mb, ctx.seq_len))
            reason = ""
        except ConfigError as e:
            reason = str(e)
        ctx.cache[key] = reason
    return reason or run_reason


def _shape_reasons(lay: Layout, world: int, ctx: Context) -> tuple[Layout | str, str]:
    """(`Layout.validate_shape` of the layout, or why it fails; why the run's gradient compression or optimizer
    refuses the layout, "" when neither does): neither reads the pipeline's microbatches."""
    def validated() -> list:  # [the blocks per stage], or [why the shape fails]
        try:
            return [lay.validate_shape(ctx.args, world).pp_split]
        except ConfigError as e:
            return [str(e)]

    # (validate_shape reads only the fields of Layout.shape_key: once per value of them)
    split, = cached(ctx, ("validate_shape", id(ctx.args), world, lay.shape_key()), validated)
    if isinstance(split, str):
        return split, ""
    checked = lay.with_checked(pp_split=split) if lay.pp > 1 else lay
    try:
        ctx.compression.site(lay)  # --grad-compression applies to this layout
        optimizer_entry(ctx.optimizer).check_layout(lay)  # and --optimizer
    except ConfigError as e:
        return checked, str(e)
    return checked, ""


class Screened:
    """The candidates of a plan (`layout_groups`) screened by `structural_reason` and given their `step_lower_bound`
    a (layout, micro-batch) at a time, with a Result made only for those the walk reaches (`result`) or rejects: a
    large plan has tens of thousands of candidates, of which it predicts a few thousand. The same verdicts, bounds
    and order as screening and bounding each candidate."""

    def __init__(self, ctx: Context, world: int, opts: Options):
        self.ctx = ctx
        self.considered = 0
        self.passed: list = []  # (layout, micro-batch, maker) of each candidate it passes, in candidate order
        self.bounds: list[float] = []  # their step_lower_bound
        self.rejected: list[Result] = []  # the others, with their reasons, in candidate order
        self.results: list = []  # passed[i]'s Result once made (None until then)
        shapes: dict = {}  # shape's id -> (shape, _shape_reasons) (holding the shape: its id stays its own)
        modes: dict = {}  # (pipelined, schedule, makers' id) -> (the makers passing, [(maker, reason)] of the others)
        memo: dict = {}  # (what step_lower_bound reads of a group, makers' id) -> their bounds
        one_bound: dict = {}  # (what step_lower_bound reads of a group, mode, every_k) -> the bound
        shape_reasons = lambda lay: (shapes.get(id(lay)) or shapes.setdefault(id(lay), (lay, _shape_reasons(
            lay, world, ctx))))[1]
        for shape, lay, mb, makers in layout_groups(ctx, world, opts):
            self.considered += len(makers)
            reason = _group_placement_reason(lay, mb, ctx) or _layout_reason(lay, mb, ctx, lambda _: shape_reasons(
                shape)) or None
            if reason:
                self.rejected += [_rejected(lay, mb, make, reason) for _, make in makers]
                continue
            key = (lay.pp > 1, lay.pp_schedule, id(makers))
            verdicts = modes.get(key)
            if verdicts is None:
                verdicts = modes[key] = _mode_verdicts(lay, mb, makers)
            passing, failing = verdicts
            for make, why in failing:
                self.rejected.append(_rejected(lay, mb, make, why))
            group = (pipeline_key(lay), lay.tp, mb, lay.ep, lay.cp, lay.dp,
                     lay.pp_microbatches if lay.pp > 1 else max(1, ctx.global_seqs // (lay.dp * mb)))
            key = (group, id(passing))
            bounds = memo.get(key)
            if bounds is None:
                bounds = memo[key] = tuple(_bound(one_bound, group, make(lay, mb), ctx) for _, make in passing)
            self.bounds += bounds
            self.passed += [(lay, mb, make) for _, make in passing]
        self.results = [None] * len(self.passed)
        self.every = None  # `all()`, once made

    def result(self, i: int) -> Result:
        r = self.results[i]
        if r is None:
            lay, mb, make = self.passed[i]
            r = self.results[i] = _result(make(lay, mb), None)
        return r

    def all(self) -> list[Result]:
        """Every passed candidate's Result, in candidate order: one list, the same at every call (the planner's
        fallbacks sort it in place and read it after)."""
        if self.every is None:
            self.every = [self.result(i) for i in range(len(self.passed))]
        return self.every

    def unchecked(self) -> int:
        """Those passed never memory-checked."""
        return sum(1 for r in self.results if r is None or (r.total_bytes is None and r.reason is None))


def _group_placement_reason(lay: Layout, mb: int, ctx: Context) -> str | None:
    """The planner's placement rules for a layout and micro-batch (_placement_reason's before the layout's own)."""
    if lay.tp > ctx.gpus_per_node:
        return f"tp={lay.tp} crosses nodes ({ctx.gpus_per_node} GPUs per node): tensor parallelism stays within a node"
    if ctx.gpus_per_node % lay.tp:
        return f"tp={lay.tp} does not divide the {ctx.gpus_per_node} GPUs per node"
    if ctx.global_seqs % (lay.dp * mb):
        return (f"the global batch ({ctx.global_seqs} sequences) does not divide into micro-batch {mb} x "
                f"data-parallel degree {lay.dp}")
    return None


def _mode_verdicts(lay: Layout, mb: int, makers: tuple) -> tuple[tuple, list]:
    """(the makers whose candidates on `lay` pass `_checkpointing_reason`, [(maker, why not)] of the others)."""
    passing, failing = [], []
    for ac, make in makers:
        why = _checkpointing_reason(make(lay, mb))
        if why:
            failing.append((make, why))
        else:
            passing.append((ac, make))
    return tuple(passing), failing


def _bound(memo: dict, group: tuple, c: Candidate, ctx: Context) -> float:
    key = (group, c.ac, c.every_k)
    bound = memo.get(key)
    if bound is None:
        bound = memo[key] = step_lower_bound(c, ctx)
    return bound


def memory(c: Candidate, ctx: Context, all_ranks: bool = False):
    """The memory estimator's verdict for a candidate: an Estimate (worst rank; all_ranks: every pipeline rank's
    total in `stages`, for stages on different GPUs)."""

    target = Target(gpu_name=ctx.hw.name, gpu_bytes=ctx.hw.memory_bytes,
                    overhead_bytes=None if ctx.hw.device == "cuda" else 0, device=ctx.hw.device,
                    host_bytes=ctx.host_memory_bytes, ranks_per_node=min(c.world, ctx.gpus_per_node))
    inputs = inputs_for(ctx.args, c.recipe, target, model_name=ctx.model_name)
    return estimate(inputs, suggest=False, all_ranks=all_ranks)


def memory_reason(est, ctx: Context, headroom: float) -> str | None:
    if est.host_fits is False:
        return (f"does not fit in host memory: {fmt_bytes(est.host_node_bytes)} per node of "
                f"{fmt_bytes(ctx.host_memory_bytes)} ({est.host_limit_text})")
    if fits(est.total_bytes, ctx.hw.memory_bytes, headroom):
        return None
    biggest = max(est.at_peak.items(), key=lambda kv: kv[1])
    label = dict(ROWS).get(biggest[0], biggest[0])
    where = f" on stage {est.stage}" if est.inputs.layout.pp > 1 else ""
    return (f"does not fit: {fmt_bytes(est.total_bytes)} per rank of {ctx.hw.name} {fmt_bytes(ctx.hw.memory_bytes)} "
            f"({100 * est.total_bytes / ctx.hw.memory_bytes:.0f}%, {limit_text(ctx.hw.memory_bytes, headroom)}); "
            f"largest: {label} {fmt_bytes(biggest[1])}{where} at the {est.phase}")


def cp_degrees(ctx: Context, ranks: int, tp: int, opts: Options) -> list[int]:
    """Context-parallel degrees to try among `ranks`: dense models only, dividing the sequence into 2 x cp chunks
    (and each rank's share over tp for sequence parallelism), each rank keeping MIN_CP_TOKENS or more."""
    if ctx.args.moe_experts:
        return [1]
    S = ctx.seq_len
    return [cp for cp in _divisors(ranks) if cp == 1 or (
        S % (2 * cp) == 0 and S % (cp * tp) == 0 and S // cp >= MIN_CP_TOKENS
        and (opts.max_cp is None or cp <= opts.max_cp))]


def candidates(ctx: Context, world: int, opts: Options) -> list[Candidate]:
    return [make(lay, mb) for _, lay, mb, makes in layout_groups(ctx, world, opts) for _, make in makes]


def layout_groups(ctx: Context, world: int, opts: Options):
    """`candidates` a (layout, micro-batch) at a time, in its order: (shape, layout, micro-batch, makers), `makers`
    the (checkpointing mode, candidate maker) of each of its candidates and `shape` the layout before its pipeline
    microbatches (the same object for all the micro-batches of a layout: what reads no microbatches is checked once
    per shape)."""
    a = ctx.args
    mbs = opts.micro_batches or tuple(2**i for i in range(5))
    every_mode = tuple((ac, ctx.candidate_maker(checkpointing=ac, every_k=2)) for ac in opts.ac_modes)
    # (no recomputation under a zero-bubble schedule: Layout.check_checkpointing)
    kept_only = tuple((ac, make) for ac, make in every_mode if not ac.recomputes)
    for tp in _divisors(math.gcd(world, ctx.gpus_per_node)):
        if opts.max_tp and tp > opts.max_tp:
            continue
        for pp in _divisors(world // tp):
            if pp > a.n_layers or (opts.max_pp and pp > opts.max_pp):
                continue
            for cp in cp_degrees(ctx, world // tp // pp, tp, opts):
                yield from _with_cp(ctx, world, opts, tp, pp, cp, mbs, every_mode, kept_only)


def _with_cp(ctx: Context, world: int, opts: Options, tp: int, pp: int, cp: int, mbs, every_mode: tuple,
             kept_only: tuple):
    a = ctx.args
    dp = world // tp // pp // cp
    modes = []
    # A pipelined mixture of experts (the largest models: the search would take seconds more) tries hybrid sharding
    # with 2 replicas only, 2 interleaved stages per rank, and no GPipe (1F1B's bubble with every microbatch in
    # flight: never faster, never smaller)
    moe_pipeline = a.moe_experts > 0 and pp > 1
    schedules = [s for s in opts.schedules if not (moe_pipeline and s.all_forwards_first)] or opts.schedules
    for mode in opts.dp_modes:
        if dp == 1:
            if not modes:
                modes.append((DPMode.FSDP, 1, 1))
            continue
        if mode.replicates_shards:
            modes += [(mode, r, dp // r) for r in _divisors(dp) if 1 < r < dp and (r == 2 or not moe_pipeline)]
        else:
            modes.append((mode, 1, dp))
    for mode, rep, shard in modes:
        for ep in [e for e in _divisors(shard) if a.moe_experts % e == 0] if a.moe_experts else [1]:
            try:  # the layouts paratrain runs (ddp and zero1: no tp, pp, cp or ep)
                layout = Layout.resolve(world, dp_mode=mode, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, ep=ep,
                                        cp=cp)
            except ConfigError:
                continue
            scheduled = {}  # (schedule, stages per rank) -> the layout with them, or None (once, not per micro-batch)
            for mb in mbs:
                if ctx.global_seqs % (dp * mb):
                    continue
                m = ctx.global_seqs // (dp * mb)  # pipeline microbatches (pp > 1)
                for sched in (Schedule.ONE_F_ONE_B,) if pp == 1 else schedules:
                    # interleaved: 2 stages per rank, and 3 where the blocks allow (a smaller bubble for more
                    # point-to-point traffic; torch's runtime keeps at most 3 stages' FSDP parameters gathered, so
                    # with more they would be gathered again within a step)
                    for v in (((2,) if moe_pipeline else (2, 3)) if (pp > 1 and sched.interleaved) else (1,)):
                        if pp * v > a.n_layers:
                            continue
                        if pp > 1:
                            if (sched, v) not in scheduled:
                                try:
                                    scheduled[sched, v] = layout.with_schedule(sched, v, 1)
                                except ConfigError:
                                    scheduled[sched, v] = None
                            shape = scheduled[sched, v]
                            if shape is None:
                                continue
                            lay = _with_microbatches(shape, m)
                        else:
                            shape = lay = layout
                        if opts.fixed and any(getattr(lay, key) != value for key, value in opts.fixed.items()):
                            continue
                        yield shape, lay, mb, (kept_only if pp > 1 and sched.zero_bubble else every_mode)


def _with_microbatches(layout: Layout, microbatches: int) -> Layout:
    """`layout.replace(pp_microbatches=...)` of a pipelined layout without checking it again (no check reads the
    microbatches but for being >= 1): the same Layout, made tens of thousands of times a plan."""
    return layout.with_checked(pp_microbatches=microbatches)


def evaluate(c: Candidate, ctx: Context, headroom: float, with_memory: bool = True) -> Result:
    reason = structural_reason(c, ctx)
    if reason:
        return Result(c, reason=reason)
    r = Result(c, pred=predict(c, ctx))
    if with_memory:
        r.cand, est = saving_in_the_background(c, ctx, memory(c, ctx))
        r.estimate, r.total_bytes = est, est.total_bytes
        r.reason = memory_reason(est, ctx, headroom)
    return r


def tier_variants(c: Candidate, ctx: Context) -> list[Candidate]:
    """A candidate with the memory tiers that can make it fit: each combination of the capabilities a name switches on
    that run on its layout (the chunked loss: without a pipeline; activation offload: not under a zero-bubble
    schedule; CPU offload: FSDP layouts), those `with_every_tier` in every one: the chunked loss alone, then with
    either offload, both. (The offloads need the profile's host side, `host_side`: a hand-made profile without one
    gets the chunked loss only.)"""
    combinations = [()]
    for cls in capabilities.switches():
        if cls.runs_on(c.layout) and (ctx.hw.host is not None or not cls.host_side):
            with_it = [(*on, cls()) for on in combinations]
            combinations = with_it if cls.with_every_tier else combinations + with_it
    return [c.switching(on) for on in combinations if on]


def plan(ctx: Context, world: int, opts: Options | None = None, top: int = 5) -> Plan:
    """Predict every valid candidate, then memory-check them fastest first until `top` fit (the estimator is
    the expensive part); when none fits, the same with the memory tiers (`tier_variants`); raise UserError naming the
    nearest miss when still none fits."""
    # (a large plan allocates hundreds of thousands of objects, none in a reference cycle: the cyclic garbage
    # collector's passes over them all would cost a tenth of the plan)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(ctx, world, opts or Options(), top)
    finally:
        if enabled:
            if not gc.get_freeze_count():  # (none frozen by anyone else: unfreeze moves back only these)
                # what the plan made and keeps (its caches and results) goes to the oldest generation, where a
                # collection after the plan would have moved it, without that collection's pass over all of it
                # (~0.1 s); frozen ones return there, so nothing stays out of the collector's reach
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _plan(ctx: Context, world: int, opts: Options, top: int) -> Plan:
    screened = Screened(ctx, world, opts)  # (predicted in _fitting, fastest first: only those that may rank)
    rejected = screened.rejected
    considered = screened.considered
    need = max(top, 1)
    ranked = _fitting(_fastest_first(screened.bounds, screened.result, ctx), screened.all, rejected, ctx, opts, need)
    results = None
    if not ranked and opts.memory_tiers:  # what does not fit: chunked loss, offloading
        results = screened.all()
        tiered = [evaluate(v, ctx, opts.headroom, with_memory=False) for r in results for v in tier_variants(r.cand, ctx)]
        fitting = [r for r in tiered if r.reason is None]
        ranked = _fitting(fastest_first(fitting, ctx), lambda: fitting, rejected, ctx, opts, need)
        results += tiered
        considered += len(tiered)
    unchecked = screened.unchecked() if results is None else sum(
        1 for r in results if r.total_bytes is None and r.reason is None)
    p = Plan(ctx, opts, ranked[:max(need, len(ranked))], rejected, considered, unchecked)
    if not ranked:
        raise UserError(no_fit_message(ctx, world, opts, results if results is not None else screened.all(),
                                       rejected))
    return p


def _fitting(walk, everything, rejected: list[Result], ctx: Context, opts: Options, need: int) -> list[Result]:
    """Memory-check the results of `walk` (fastest first) until `need` fit (rejects go to `rejected`); when none fits,
    the most memory-frugal ones of `everything()` (full checkpointing, the smallest micro-batch) may fit though
    slower."""
    ranked, checked = [], 0
    misses: dict = {}  # memory key -> [(micro-batch, MEM_ORDER)] of layouts that did not fit
    for r in walk:
        if len(ranked) >= need:
            break  # the rest are predicted slower than `top` layouts that fit
        key = _memory_key(r.cand)
        if any(_dominated(r.cand, mb, ac) for mb, ac in misses.get(key, ())):
            r.reason = "does not fit: needs at least the memory of a smaller layout that does not fit"
            rejected.append(r)
            continue
        if _lower_bound_exceeds(r, ctx, opts):  # states + stored activations already exceed it: no estimate needed
            rejected.append(r)
            misses.setdefault(key, []).append((r.cand.micro_batch, r.cand.ac))
            continue
        if checked >= opts.estimate_limit:
            break
        _check(r, ctx, opts)
        checked += 1
        (ranked if r.reason is None else rejected).append(r)
        if r.reason:
            misses.setdefault(key, []).append((r.cand.micro_batch, r.cand.ac))
    if not ranked:
        results = everything()
        for r in results:  # (every prediction, in the order the fastest-first walk would give them all)
            r.pred = r.pred or predict(r.cand, ctx)
        results.sort(key=lambda r: r.pred.step_s)
        # the most memory-frugal layouts (full checkpointing, the smallest micro-batch) may fit though slower
        smallest = min((x.cand.micro_batch for x in results), default=1)
        frugal = [r for r in results if r.total_bytes is None and r.cand.ac.every_block_whole
                  and r.cand.micro_batch == smallest]
        for r in frugal[: opts.estimate_limit]:
            _check(r, ctx, opts)
            (ranked if r.reason is None else rejected).append(r)
        ranked.sort(key=lambda r: r.pred.step_s)
    return ranked


def fastest_first(results: list[Result], ctx: Context):
    """`results` by predicted step time (ties in list order: as a stable sort), each predicted when reached (those
    given without a prediction). A layout is predicted in the order of its `step_lower_bound`, and one is yielded
    once no layout left unpredicted has a bound at or below its step time: the planner stops after the few it
    memory-checks, so most layouts of a large plan are never predicted."""
    return _fastest_first(_lower_bounds(results, ctx), results.__getitem__, ctx)


def _fastest_first(bounds: list[float], result, ctx: Context):
    """`fastest_first` of the results `result(i)` whose step times are at least `bounds[i]` (each made when
    reached)."""
    order = sorted(range(len(bounds)), key=bounds.__getitem__)
    ready: list = []  # heap of (step time, index) of the predicted, not yet yielded
    reached = 0
    while True:
        while reached < len(order) and (not ready or bounds[order[reached]] <= ready[0][0]):
            i = order[reached]
            r = result(i)
            r.pred = r.pred or predict(r.cand, ctx)
            heapq.heappush(ready, (r.pred.step_s, i))
            reached += 1
        if not ready:
            return
        yield result(heapq.heappop(ready)[1])


def _lower_bounds(results: list[Result], ctx: Context) -> list[float]:
    """Each result's step time (predicted) or `step_lower_bound`, once per distinct value of what the bound reads
    (many layouts differ only in data-parallel mode or replicas: the same compute, the same bound)."""
    if ctx.stage_hw:  # (heterogeneous stages: per call)
        return [r.pred.step_s if r.pred else step_lower_bound(r.cand, ctx) for r in results]
    memo: dict = {}
    shapes: dict = {}  # (layout's id, micro-batch) -> what the bound reads of them (a layout's candidates share it)
    bounds = []
    for r in results:
        if r.pred:
            bounds.append(r.pred.step_s)
            continue
        c = r.cand
        lay = c.layout
        shape = shapes.get((id(lay), c.micro_batch))
        if shape is None:
            # (step_lower_bound reads the micro-steps and `_slowest`, whose cache key is the rest with the context's)
            shape = shapes[id(lay), c.micro_batch] = (pipeline_key(lay), c.tp, c.micro_batch, c.ep, lay.cp, lay.dp,
                                                      c.micro_steps)
        key = (shape, c.ac, c.every_k)
        bound = memo.get(key)
        if bound is None:
            bound = memo[key] = step_lower_bound(c, ctx)
        bounds.append(bound)
    return bounds


def _memory_key(c: Candidate) -> tuple:
    """Candidates with the same key differ only in micro-batch (a smaller one makes more pipeline micro-batches) and
    checkpointing: a larger micro-batch with no more recomputation needs at least as much memory."""
    return c.layout.with_checked(pp_microbatches=0), c.switched  # (the switched: the memory tiers)


def _dominated(c: Candidate, miss_micro_batch: int, miss_ac: CheckpointMode) -> bool:
    """c needs at least the memory of a miss with the same `_memory_key`: a micro-batch no smaller and no more
    recomputation."""
    if c.micro_batch < miss_micro_batch:
        return False
    return c.ac.stores_at_least(miss_ac)


def _lower_bound_exceeds(r: Result, ctx: Context, opts: Options) -> bool:
    """A lower bound of the worst rank's peak already over the usable memory: rejected without walking the step.
    The bound is the rank's exact model states (with FSDP under a pipeline, also its gathered parameters and unsharded
    gradients), plus what its blocks store for one micro-batch times the most micro-batches the rank holds at once (a
    pipeline's schedule), plus a pipeline's receive buffers; the real peak holds at least that."""

    lay, a, c = r.cand.layout, ctx.args, r.cand
    limit = usable_bytes(ctx.hw.memory_bytes, opts.headroom)
    ranks = range(lay.pp) if lay.pp <= 4 else sorted({0, 1, lay.pp - 1, lay.stage_owner(lay.num_stages - 1)})
    layers = rank_blocks(ctx, lay).layers  # (rank_layers, once per pipeline shape)
    # (act_dims reads tp, cp, sequence parallelism, FSDP and loss parallelism of the layout)
    d = cached(ctx, ("act_dims", id(a), lay.tp, lay.cp, lay.sp, lay.uses_fsdp, lay.uses_loss_parallel, c.micro_batch,
                     ctx.precision, ctx.seq_len, ctx.hw.device),
               lambda: A.act_dims(a, lay, ctx.precision, "paratrain", c.micro_batch, ctx.seq_len, ctx.hw.device))
    moe = A.moe_dims(a, lay, c.micro_batch, ctx.seq_len, 1.0) if a.moe_experts else None
    modes = cached(ctx, ("block modes", a.n_layers, c.ac, c.every_k),
                   lambda: c.ac.block_checkpointing(a.n_layers, c.every_k))
    moe_layers = cached(ctx, ("moe layer indices", id(a)), lambda: [l for l in range(a.n_layers) if a.is_moe_layer(l)])
    # (the stages of the ranks bounded only: a stage's checkpoints group its own blocks)
    stages = cached(ctx, ("bounded stages", id(a), pipeline_key(lay)), lambda: [
        blocks for stage, blocks in enumerate(stage_blocks(lay, a)) if lay.stage_owner(stage) in ranks])
    kept = cached(ctx, ("kept", id(a), d, c.ac, c.every_k, pipeline_key(lay), moe, c.recipe.capabilities), lambda:
                  A.stored_by_block(d, modes, stages, {l: moe for l in moe_layers}, c.recipe.capabilities))
    # A pipelined FSDP stage holds its blocks gathered (compute dtype) with their gradients accumulated unsharded
    # (fp32) through the step (Layout.fsdp_all_gathers): at least that much on top of the sharded states.
    unsharded = ctx.precision.value_bytes + 4 if (lay.pipelined and lay.uses_fsdp) else 0

    def recv_buffers(rank: int) -> int:
        # torch.distributed.pipelining allocates a receive buffer per micro-batch for each stage input and each
        # stage output's gradient that comes from another stage
        received = cached(ctx, ("received", pipeline_key(lay), rank), lambda: sum(
            (s > 0) + (s < lay.num_stages - 1) for s in range(lay.num_stages) if lay.stage_owner(s) == rank))
        return received * lay.pp_microbatches * A.block_input(d)

    best = None
    # (activation offload: these blocks' saved tensors are in host memory)
    offloaded = {b for cap in c.switched for b in (cap.host_activations(a.n_layers) or ((), 0))[0]}
    on_host = any(cap.states_on_host for cap in c.switched)  # (CPU offload: the model states are in host memory)
    shape = lay.with_checked(pp_microbatches=0)  # (the model states do not depend on the micro-batches)
    for s in ranks:
        states = cached(ctx, ("states", shape, s, on_host), lambda: sum(
            _states(state_bytes(a, lay, ctx.precision, ctx.optimizer, "paratrain", s, layers, ctx.lora))
            if not on_host else ())
            + unsharded * cached(ctx, ("gathered params", id(a), lay.tp, lay.ep, pipeline_key(lay), s),
                                 lambda: sum(_rank_block_params(a, lay, l) for l in layers[s])))
        stored = (sum(kept[l] - (A.offloaded(d, modes[l], moe if a.is_moe_layer(l) else None) if l in offloaded
                                 else 0) for l in layers[s]) if offloaded else sum(map(kept.__getitem__, layers[s])))
        acts = int(in_flight(lay, s) * stored) + recv_buffers(s)
        if best is None or states + acts > sum(best):
            best = (states, acts)
    if sum(best) <= limit:
        return False
    r.total_bytes, r.bound = sum(best), {"states": best[0], "activations": best[1]}
    r.reason = (f"does not fit: at least {fmt_bytes(sum(best))} per rank (model states {fmt_bytes(best[0])}, stored "
                f"activations and pipeline buffers {fmt_bytes(best[1])}) of {ctx.hw.name} {fmt_bytes(ctx.hw.memory_bytes)} "
                f"({limit_text(ctx.hw.memory_bytes, opts.headroom)})")
    return True


def _rank_block_params(a, lay: Layout, layer: int) -> int:
    """The parameters of block `layer` one rank holds gathered: its tp share, and of an MoE block's routed experts
    (replicated over tp) the E/ep of its expert-parallel rank."""
    experts = routed_expert_params(a) if a.is_moe_layer(layer) else 0
    return (block_param_count(a, layer) - experts) // lay.tp + experts // lay.ep


def _states(st) -> tuple[int, ...]:
    return (st.params, st.frozen, st.grads, st.optimizer, st.master)


def _check(r: Result, ctx: Context, opts: Options) -> None:
    r.cand, est = saving_in_the_background(r.cand, ctx, memory(r.cand, ctx))
    r.estimate, r.total_bytes = est, est.total_bytes
    r.reason = memory_reason(est, ctx, opts.headroom)


def rank_all(ctx: Context, world: int, opts: Options | None = None) -> list[Result]:
    """Every candidate with its prediction and memory verdict, fastest first (for benchmarks and --explain)."""
    opts = opts or Options()
    out = [evaluate(c, ctx, opts.headroom) for c in candidates(ctx, world, opts)]
    ok = sorted((r for r in out if r.ok), key=lambda r: r.pred.step_s)
    return ok + [r for r in out if not r.ok]


def no_fit_message(ctx: Context, world: int, opts: Options, results: list[Result], rejected: list[Result]) -> str:
    if not results:
        why = rejected[0].reason if rejected else "no candidate layouts"
        return f"no layout of {world} GPUs can run {ctx.model_name}: e.g. {why}"
    checked = [r for r in results + rejected if r.total_bytes is not None]
    if not checked:
        why = rejected[0].reason if rejected else "no candidate layouts"
        return f"no layout of {world} GPUs can run {ctx.model_name}: e.g. {why}"
    best = min(checked, key=lambda r: r.total_bytes)
    if best.reason and best.reason.startswith("does not fit in host memory"):  # the device would hold it
        return (f"no layout fits {ctx.model_name} on {world} x {ctx.hw.name}: the nearest, {best.cand.name}, fits "
                f"the GPUs ({fmt_bytes(best.total_bytes)} per rank) but {best.reason}: more host memory per node "
                "(--host-memory), more GPUs, or fewer GPUs per node")
    limit = usable_bytes(ctx.hw.memory_bytes, opts.headroom)
    short = best.total_bytes - limit
    factor = best.total_bytes / limit
    if best.estimate is not None:
        at = best.estimate.at_peak
        states = sum(at.get(k, 0) for k in ("parameters", "gradients", "optimizer", "master", "autocast_copies"))
        acts = sum(at.get(k, 0) for k in ("activations", "pipeline", "logits_loss"))
    else:  # only its lower bound was computed
        states, acts = best.bound["states"], best.bound["activations"]
    what = (f"model states alone take {fmt_bytes(states)} per rank: about {math.ceil(factor * world)} GPUs or GPUs "
            f"with {fmt_bytes(best.total_bytes / (1 - opts.headroom))}" if states >= acts else
            f"activations take {fmt_bytes(acts)} per rank: a shorter --seq, or more GPUs for tp/pp/cp")
    return (f"no layout fits {ctx.model_name} on {world} x {ctx.hw.name}: nearest miss {best.cand.name} needs "
            f"{fmt_bytes(best.total_bytes)} per rank, {fmt_bytes(short)} more than the {fmt_bytes(limit)} usable "
            f"({opts.headroom:.0%} headroom); it lacks memory: {what}")


# -- names <-> candidates ------------------------------------------------------------------------------------------

def parse_layout(text: str, ctx: Context, world: int) -> Candidate:
    """A layout's name as `paratrain plan` prints it ('fsdp,tp=2,pp=2,sched=1f1b,ac=full,mb=2',
    paratrain/layout_grammar.py) -> a Candidate, its pipeline micro-batches from the global batch. UserError on bad
    syntax; ConfigError (a UserError) when the text names no layout paratrain can run."""
    named = parse_layout_name(text, "--explain")
    if any(value is False for value in named.options.values()):  # sp=off, lp=off
        raise UserError(f"--explain '{text}': the planner predicts tensor parallelism with sequence and loss "
                        "parallelism only (no sp=off or lp=off)")
    mb = named.settings.get("micro_batch", 1)
    o = named.options
    dp = max(1, world // (o["tp"] * o["pp"] * o["cp"]))  # Layout.resolve says when tp x pp x cp does not divide it
    layout = named.layout(world, pp_microbatches=max(1, ctx.global_seqs // (dp * mb)))
    for capability in named.switched:
        if capability.plan_problem():
            raise UserError(f"--explain '{text}': {capability.plan_problem()}")
    return ctx.candidate(layout, **{**named.settings, "micro_batch": mb}).switching(named.switched)


def explain(text: str, ctx: Context, world: int, opts: Options) -> str:
    try:
        c = parse_layout(text, ctx, world)
    except ConfigError as e:  # no layout paratrain can run
        return f"layout {text} on {world} x {ctx.hw.name}:\n  rejected: {e}"
    r = evaluate(c, ctx, opts.headroom)
    head = f"layout {c.name} ({c.describe()}) on {world} x {ctx.hw.name}:"
    if r.reason:
        lines = [head, f"  rejected: {r.reason}"]
        if r.pred is not None:
            lines.append(f"  (were it to fit: {r.pred.tokens_per_s:,.0f} tokens/s, MFU {r.pred.mfu:.1%}; "
                         f"{r.pred.breakdown()})")
        return "\n".join(lines)
    everything = rank_all(ctx, world, opts) if _small(ctx, world, opts) else None
    lines = [head, f"  fits: {fmt_bytes(r.total_bytes)} per rank of {fmt_bytes(ctx.hw.memory_bytes)} "
             f"({100 * r.total_bytes / ctx.hw.memory_bytes:.0f}%, {limit_text(ctx.hw.memory_bytes, opts.headroom)})",
             f"  predicted step {r.pred.step_s * 1e3:.1f} ms, {r.pred.tokens_per_s:,.0f} tokens/s, MFU {r.pred.mfu:.1%}",
             f"  {r.pred.breakdown()}"]
    if r.pred.comm:
        lines.append("  exposed communication: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r.pred.comm.items()))
    if r.pred.phases:  # an optimizer's kinds of steps (ranked by the last)
        lines.append(f"  {ctx.optimizer} by phase: " + "; ".join(
            f"{name} {step * 1e3:.1f} ms, {sent / 2**20:,.1f} MiB sent" for name, step, sent in r.pred.phases))
    if c.cp > 1:
        lines.append("  " + ring_line(c, ctx))
    p = plan(ctx, world, opts, top=1)
    best = p.ranked[0]
    if best.cand == c:
        lines.append("  ranks 1st: the planner's choice")
    else:
        slower = r.pred.step_s / best.pred.step_s - 1
        if everything is not None:
            ok = [x for x in everything if x.ok]
            pos = next((i for i, x in enumerate(ok) if x.cand == c), None)
            if pos is not None:
                lines.append(f"  ranks {pos + 1} of {len(ok)} layouts that fit")
        lines.append(f"  {slower:+.1%} step time against the best, {best.cand.name}: " + _diff(r.pred, best.pred))
    return "\n".join(lines)


def _small(ctx, world, opts) -> bool:
    return len(candidates(ctx, world, opts)) <= 200


def _diff(p: Prediction, best: Prediction) -> str:
    parts = []
    for label, a, b in (("compute", p.compute_s, best.compute_s), ("exposed comm", p.comm_exposed_s, best.comm_exposed_s),
                        ("bubble", p.bubble_s, best.bubble_s), ("recompute", p.recompute_s, best.recompute_s),
                        ("optimizer", p.optimizer_s, best.optimizer_s)):
        if abs(a - b) > 0.01 * best.step_s:
            parts.append(f"{label} {(a - b) * 1e3:+.1f} ms")
    return ", ".join(parts) or "about the same"


def ring_line(c: Candidate, ctx: Context) -> str:
    """What ring attention costs a context-parallel layout: its point-to-point traffic and how much the attention
    compute hides (cost.ring_time)."""

    a, lay = ctx.args, c.layout
    tokens = c.micro_batch * ctx.seq_len // lay.cp
    pred = predict(c, ctx)
    total, exposed = ring_time(ctx, c, tokens, attention_time(ctx, c))
    link = group_link(ctx, c.tp, lay.cp)
    shape = attention_shape(a)
    kv = tokens * shape.kv_heads * (shape.qk_dim + shape.v_dim) / c.tp * ctx.precision.value_bytes
    return (f"context-parallel ring over {lay.cp} ranks ({link.name}): per block, {lay.cp - 1} point-to-point steps "
            f"of a {kv / 2**20:.1f} MiB K/V block forward, {lay.cp - 1} + {lay.cp} (fp32 dK/dV) backward; "
            f"{total * 1e3:.1f} ms per step, {exposed * 1e3:.1f} ms exposed after overlapping the attention "
            f"({ctx.hw.overlap:.0%} overlap); {exposed / pred.step_s:.1%} of the step")


def saving_in_the_background(c: Candidate, ctx: Context, est):
    """(candidate, its estimate), with background checkpoints (checkpoint.async_save) dropped where their staging copy
    of the rank's state is what overflows the node's host memory: that candidate saves synchronously (the plan writes
    `checkpoint.async_save = false` and says so, `staging_dropped_line`). Otherwise (c, est) as they are."""
    if est.host_fits is not False or not c.recipe.async_save:
        return c, est
    synchronous = c.replace(async_save=False)
    without = memory(synchronous, ctx)
    return (synchronous, without) if without.host_fits else (c, est)


def staging_dropped_line(best: Result, ctx: Context) -> str | None:
    """The plan's line when its first choice saves synchronously although the run asked for background saves."""
    if not ctx.run.async_save or best.cand.recipe.async_save:
        return None
    staging = memory(best.cand.replace(async_save=True), ctx)
    return (f"checkpoint.async_save = false in the written config: with the staging copy of background checkpoints "
            f"a node would need {fmt_bytes(staging.host_node_bytes)} of host memory (of "
            f"{fmt_bytes(ctx.host_memory_bytes)}, {staging.host_limit_text.split(':')[0]}), so checkpoints are saved "
            "synchronously (training waits for each save)")
