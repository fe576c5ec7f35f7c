"""What would fit: the cheapest change to a layout, checkpointing or micro-batch that brings an estimate within the
GPU's memory (`paratrain estimate` prints it below a DOES NOT FIT)."""

from __future__ import annotations

from paratrain.errors import ConfigError, UserError
from paratrain.layout import Layout
from paratrain.modes import FLAT_DP_MODES, every_block_whole, keeps_some_blocks_whole


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
            out.append((cost, change, why, i.replace(layout=layout)))

    if lay.dp > 1 and lay.zero_stage < 3:
        for step, mode in enumerate(FLAT_DP_MODES[lay.zero_stage + 1:]):  # (by ZeRO stage: what they shard)
            add(0.5 + 0.1 * step, f"--dp-mode {mode}", "more sharding over the same GPUs, more communication",
                _changed(lay, dp_mode=mode, dp_replicate=1, dp_shard=lay.dp))
    if lay.hybrid:
        add(0.6, "--dp-mode fsdp (shard over all data-parallel ranks)", "sharding across nodes",
            _changed(lay, dp_mode="fsdp", dp_replicate=1, dp_shard=lay.dp))
    if keeps_some_blocks_whole(i.checkpointing):
        out.append((1.0, "--checkpointing selective", "recomputes element-wise ops (a few % slower)",
                    i.replace(checkpointing="selective")))
    if i.micro_batch > 1 and lay.pp == 1:
        out.append((1.5, f"--micro-batch {i.micro_batch // 2} (accumulation x2, same global batch)",
                    "smaller matmuls", i.replace(micro_batch=i.micro_batch // 2, accum_steps=i.accum_steps * 2)))
    if not every_block_whole(i.checkpointing):
        out.append((2.0, "--checkpointing full", "recomputes each block's forward (~1/3 more compute)",
                    i.replace(checkpointing="full")))
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
    """The cheapest single change that fits, else the cheapest pair; plus other single changes that fit. `estimate`:
    the estimate of changed inputs (core.estimate without suggestions)."""
    def fits(c):
        try:
            e = estimate(c)
        except UserError:
            return None
        return e if e.fits else None

    found = []
    singles = candidates(i)
    for cost, change, why, c in singles:
        e = fits(c)
        if e is not None:
            found.append({"change": change, "why": why, "cost": cost, "total_bytes": e.total_bytes,
                          "inputs": _describe_inputs(c)})
    if not found:
        for cost, change, why, c in singles:
            for cost2, change2, why2, c2 in candidates(c):
                if change2 == change:
                    continue
                e = fits(c2)
                if e is not None:
                    found.append({"change": f"{change} and {change2}", "why": f"{why}; {why2}", "cost": cost + cost2,
                                  "total_bytes": e.total_bytes, "inputs": _describe_inputs(c2)})
    if not found:
        # How many GPUs would it take? FSDP over more ranks (keeping tp and pp), then also full checkpointing.
        lay = i.layout
        for ckpt in (i.checkpointing, "full"):
            for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
                more = _sharded(lay, n) if n > _shard_ranks(lay) else None
                if more is None:
                    continue
                c = i.replace(layout=more, checkpointing=ckpt)
                e = fits(c)
                if e is not None:
                    change = f"--dp-mode {more.dp_mode} --dp-shard {n} ({more.world_size} GPUs)" + (
                        f" --checkpointing {ckpt}" if ckpt != i.checkpointing else "")
                    found.append({"change": change, "why": "more GPUs", "cost": 10.0, "total_bytes": e.total_bytes,
                                  "inputs": _describe_inputs(c)})
                    break
            if found:
                break
    if not found:
        return None, []
    found.sort(key=lambda f: (f["cost"], f["total_bytes"]))
    best = found[0]
    others = [f for f in found[1:] if f["change"] != best["change"]]
    return best, others


def _describe_inputs(c: EstimateInputs) -> dict:
    lay = c.layout
    return {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
            "pp": lay.pp, "ep": lay.ep, "checkpointing": c.checkpointing, "micro_batch": c.micro_batch,
            "accum_steps": c.accum_steps, "world_size": lay.world_size}
