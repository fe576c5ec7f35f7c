"""What would fit: the cheapest change to a layout, checkpointing, micro-batch or memory tier (chunked loss, activation
offloading, CPU offload) that brings an estimate within the GPU's memory, and the host's where --host-memory is given
(`paratrain estimate` prints it below a DOES NOT FIT).

The cheapest is the cheapest in time where the GPU has a planner profile (`--gpu NAME`): the planner's cost model
(paratrain/estimate/step_time.py, with its PCIe/C2C transfers and the host's optimizer step) predicts each change's GPU
time per token, its matmuls at the rate of the run's precision and TF32 setting (`--tf32`), against the layout as asked
(more GPUs cost their GPU time too). Without one (`--gpu-memory`), a fixed order of rough costs ranks them."""

from __future__ import annotations

from paratrain import capabilities
from paratrain.errors import ConfigError, UserError
from paratrain.estimate.inputs import EstimateInputs
from paratrain.layout import Layout
from paratrain.modes import FLAT_DP_MODES
from paratrain.estimate.hardware import gpu_profile
from paratrain.estimate.step_time import Candidate, Context, predict


def _changed(lay: Layout, **changes) -> Layout | None:
    """The layout with `changes` (checked again), or None where that is no layout paratrain can run."""
    try:
        return lay.replace(**changes)
    except ConfigError:
        return None


def _shard_ranks(lay: Layout) -> int:
    """Ranks FSDP would shard over if this layout's data parallelism became FSDP (hsdp: within a replica)."""
    return lay.dp_shard if lay.hybrid else lay.dp


def _sharded(lay: Layout, n: int) -> Layout | None:
    """The layout with FSDP over n ranks (hsdp keeps its replicas, other modes become fsdp); tp and pp kept."""
    if lay.hybrid:
        return _changed(lay, dp_shard=n)
    return _changed(lay, dp_mode="fsdp", dp_replicate=1, dp_shard=n)


def candidates(i: EstimateInputs) -> list[tuple[float, str, str, EstimateInputs]]:
    """(cost, change, why, inputs) for single changes that keep the number of GPUs, then ones that add GPUs."""
    lay, out = i.layout, []
    world = lay.world_size

    def add(cost, change, why, layout):
        if layout is not None:
            out.append((cost, change, why, i.with_recipe(layout=layout)))

    if lay.dp > 1 and lay.zero_stage < 3:
        for step, mode in enumerate(FLAT_DP_MODES[lay.zero_stage + 1:]):  # (by ZeRO stage: what they shard)
            add(0.5 + 0.1 * step, f"--dp-mode {mode}", "more sharding over the same GPUs, more communication",
                _changed(lay, dp_mode=mode, dp_replicate=1, dp_shard=lay.dp))
    if lay.hybrid:
        add(0.6, "--dp-mode fsdp (shard over all data-parallel ranks)", "sharding across nodes",
            _changed(lay, dp_mode="fsdp", dp_replicate=1, dp_shard=lay.dp))
    if i.recipe.checkpointing.keeps_some_blocks_whole:
        out.append((1.0, "--checkpointing selective", "recomputes element-wise ops (a few % slower)",
                    i.with_recipe(checkpointing="selective")))
    for cls in capabilities.switches():  # the memory tiers (the chunked loss, activation offload, CPU offload)
        if cls.suggestion and cls.runs_on(lay) and not any(isinstance(c, cls) for c in i.recipe.capabilities):
            out.append((*cls.suggestion, i.with_recipe(capabilities=(*i.recipe.capabilities, cls()))))
    if i.recipe.micro_batch > 1 and lay.pp == 1:
        out.append((1.5, f"--micro-batch {i.recipe.micro_batch // 2} (accumulation x2, same global batch)",
                    "smaller matmuls",
                    i.with_recipe(micro_batch=i.recipe.micro_batch // 2, accum_steps=i.recipe.accum_steps * 2)))
    if not i.recipe.checkpointing.every_block_whole:
        out.append((2.0, "--checkpointing full", "recomputes each block's forward (~1/3 more compute)",
                    i.with_recipe(checkpointing="full")))
    if lay.tp * 2 <= 8 and lay.uses_fsdp and lay.dp_shard % 2 == 0:
        add(2.5, f"--tp {lay.tp * 2} (dp_shard {lay.dp_shard // 2})", "tensor-parallel communication per block",
            _changed(lay, tp=lay.tp * 2, dp_shard=lay.dp_shard // 2))
    if lay.dp_shard % 2 == 0 and lay.dp_shard > 1:
        add(3.0, f"--pp {lay.pp * 2} (dp_shard {lay.dp_shard // 2})", "pipeline bubble",
            _changed(lay, pp=lay.pp * 2, dp_shard=lay.dp_shard // 2, pp_split=None,
                     pp_microbatches=max(lay.pp_microbatches, lay.pp * 2)))
    # More GPUs.
    new = _sharded(lay, _shard_ranks(lay) * 2)
    if new is not None:
        add(4.0, f"--dp-mode {new.dp_mode} --dp-shard {new.dp_shard} ({new.world_size} GPUs instead of {world})",
            "more GPUs", new)
    if lay.tp * 2 <= 8 and not lay.uses_ddp:
        new = _changed(lay, tp=lay.tp * 2)
        if new is not None:
            add(4.5, f"--tp {lay.tp * 2} ({new.world_size} GPUs instead of {world})", "more GPUs", new)
    return out


def suggest_changes(i: EstimateInputs, estimate) -> tuple[dict | None, list[dict]]:
    """The cheapest change that fits on the same GPUs (a single change, else a pair), else with more GPUs; plus the
    others that fit. `estimate`: the estimate of changed inputs (core.estimate without suggestions)."""
    i = i.with_target(ranks_per_node=i.node_ranks)  # more GPUs are more nodes of the same size
    cost_of = _time_cost(i)

    def fits(c):
        try:
            e = estimate(c)
        except UserError:
            return None
        return e if e.fits else None

    def entry(change, why, cost, c, e):
        slowdown = cost_of(c) if cost_of else None
        return {"change": change, "why": why, "cost": cost if slowdown is None else slowdown, "slowdown": slowdown,
                "total_bytes": e.total_bytes, "host_bytes": e.host_bytes, "inputs": _describe_inputs(c)}

    world = i.layout.world_size
    found = []
    singles = candidates(i)
    for cost, change, why, c in singles:
        e = fits(c)
        if e is not None:
            found.append(entry(change, why, cost, c, e))
    if not any(f["inputs"]["world_size"] == world for f in found):  # pairs, for one on these GPUs
        for cost, change, why, c in singles:
            for cost2, change2, why2, c2 in candidates(c):
                if change2 == change:
                    continue
                e = fits(c2)
                if e is not None:
                    found.append(entry(f"{change} and {change2}", f"{why}; {why2}", cost + cost2, c2, e))
    if not found:
        # How many GPUs would it take? FSDP over more ranks (keeping tp and pp), then also full checkpointing.
        lay = i.layout
        for ckpt in (i.recipe.checkpointing, "full"):
            for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
                more = _sharded(lay, n) if n > _shard_ranks(lay) else None
                if more is None:
                    continue
                c = i.with_recipe(layout=more, checkpointing=ckpt)
                e = fits(c)
                if e is not None:
                    change = f"--dp-mode {more.dp_mode} --dp-shard {n} ({more.world_size} GPUs)" + (
                        f" --checkpointing {ckpt}" if ckpt != i.recipe.checkpointing else "")
                    found.append(entry(change, "more GPUs", 10.0, c, e))
                    break
            if found:
                break
    if not found:
        return None, []
    # On the GPUs asked about first (the cheapest there), then with more GPUs; one entry per resulting configuration.
    found.sort(key=lambda f: (f["inputs"]["world_size"] > world, f["cost"], f["total_bytes"]))
    seen, unique = set(), []
    for f in found:
        key = tuple(sorted(f["inputs"].items()))
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique[0], unique[1:]


def _time_cost(i: EstimateInputs):
    """inputs -> GPU seconds per token relative to `i`'s, from the planner's cost model on `i.target.gpu_name`'s datasheet
    profile; None when the GPU has none (the fixed costs rank the changes then)."""

    if not i.target.gpu_name:
        return None
    try:
        hw = gpu_profile(i.target.gpu_name)
    except UserError:
        return None

    def gpu_seconds_per_token(c: EstimateInputs) -> float:
        lay = c.layout
        steps = lay.pp_microbatches if lay.pipelined else c.recipe.accum_steps
        seqs = c.recipe.micro_batch * steps * lay.dp
        ctx = Context(c.model_args, c.recipe, seqs, hw, c.node_ranks)
        return predict(Candidate.of(c.recipe), ctx).step_s * lay.world_size / (seqs * c.recipe.seq_len)

    base = gpu_seconds_per_token(i)
    return lambda c: gpu_seconds_per_token(c) / base


def _describe_inputs(c: EstimateInputs) -> dict:
    lay = c.layout
    return {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
            "pp": lay.pp, "ep": lay.ep, "checkpointing": c.recipe.checkpointing, "micro_batch": c.recipe.micro_batch,
            "accum_steps": c.recipe.accum_steps, "world_size": lay.world_size,
            **capabilities.switched_on(c.recipe.capabilities)}
