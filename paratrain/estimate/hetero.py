"""Heterogeneous clusters: pipeline stages placed on different GPU types, with uneven blocks per stage.

    paratrain plan --model llama3-8b --gpus 8xH100,8xA100 --seq 4096 --global-batch-tokens 1048576
    paratrain plan --model llama3-8b --cluster cluster.toml ...        # [[group]] gpu = "H100", count = 8, ...

Groups are given in rank order (the first group's nodes take the first ranks). The pipeline axis is the outermost
mesh axis, so pipeline rank r runs on ranks r x (world / pp) ... (r + 1) x (world / pp) - 1: a layout is placed
only when every group holds whole pipeline ranks (each group's GPU count a multiple of dp x tp), and each pipeline
rank runs on its group's GPU type. Data and tensor parallelism stay within a pipeline rank, so they never mix types.

Blocks per stage (`parallel.pp_split`) are chosen for the hardware: the contiguous split minimising the slowest
stage's time per micro-batch (the cost model's per-block forward + backward + recomputation on that stage's profile,
the embedding on the first stage and the output head on the last), within each stage's own memory: a stage the
estimator finds over its GPU's memory (less headroom) gets fewer blocks and the split is searched again. A faster
GPU type gets more blocks, a smaller one fewer. Single-stage schedules only (gpipe, 1f1b): with several stages per
rank a rank's stages would mix into one time per rank that a contiguous split cannot balance separately.

The written config carries the split and `parallel.pp_stage_gpus` (the GPU type of each pipeline rank); on CUDA
each rank checks at start that it runs on its stage's type (a wrong node order would put the large stages on the
slow GPUs).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import UserError
from paratrain.layout import Layout
from paratrain.modes import Schedule
from paratrain.estimate.profile import Hardware
from paratrain.stage_split import min_max_partition
from paratrain.config import read_toml
from paratrain.estimate.gpus import fits
from paratrain.estimate.hardware import resolve_hardware
from paratrain.estimate.search import Plan, Result, candidates, memory, structural_reason
from paratrain.estimate.step_time import block_costs, predict
from paratrain.stage_split import balanced_split


@dataclass(frozen=True)
class GpuGroup:
    count: int
    hw: Hardware
    gpus_per_node: int

    @property
    def name(self) -> str:
        return self.hw.name


def parse_gpus(text: str) -> list[tuple[int, str]] | None:
    """'8xH100,8xA100' -> [(8, 'H100'), (8, 'A100')]; a plain integer -> None (one GPU type)."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return None
    groups = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\d+)\s*[xX*]\s*(\S+)", item)
        if not m or int(m.group(1)) < 1:
            raise UserError(f"--gpus '{text}': each group is COUNTxGPU (e.g. 8xH100,8xA100), got '{item}'")
        groups.append((int(m.group(1)), m.group(2)))
    if not groups:
        raise UserError("--gpus is empty")
    return groups


MAX_GPUS = 1 << 20  # a million GPUs: beyond any cluster, and the layouts of more would not enumerate in bounded time


def read_cluster(path: str) -> list[dict]:
    """A cluster file: [[group]] tables with gpu, count and optionally gpus_per_node, intra (in rank order). Every
    field is checked, one line naming the file, the group and the field."""

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--cluster {path}: no such file")
    groups = read_toml(p).get("group")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise UserError(f"--cluster {path}: needs [[group]] tables (gpu = \"H100\", count = 8)")
    out, total = [], 0
    for i, g in enumerate(groups, 1):
        where = f"--cluster {path}: group {i}"
        unknown = sorted(set(g) - {"gpu", "count", "gpus_per_node", "intra"})
        if unknown:
            raise UserError(f"{where}: unknown key {unknown[0]!r} (a group has gpu, count, gpus_per_node, intra)")
        if not isinstance(g.get("gpu"), str) or not g["gpu"].strip():
            raise UserError(f"{where}: gpu must be a GPU name (e.g. \"H100\") or a saved profile, got {g.get('gpu')!r}")
        for key in ("count", "gpus_per_node"):
            value = g.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        if "intra" in g and not isinstance(g["intra"], str):
            raise UserError(f"{where}: intra must be a link name (e.g. \"nvlink\"), got {g['intra']!r}")
        total += g["count"]
        if total > MAX_GPUS:
            raise UserError(f"--cluster {path}: {total} GPUs is more than {MAX_GPUS} (group {i} has count "
                            f"{g['count']})")
        out.append(g)
    return out


def build_groups(spec: list[tuple[int, str]] | list[dict], gpus_per_node: int, intra: str | None, inter: str | None,
                 profile_dir) -> list[GpuGroup]:
    groups = []
    total = sum(item["count"] if isinstance(item, dict) else item[0] for item in spec)
    if total > MAX_GPUS:
        raise UserError(f"--gpus: {total} GPUs is more than {MAX_GPUS} (a typo?)")
    for item in spec:
        if isinstance(item, dict):
            count, name = item["count"], item["gpu"]
            per_node, link = item.get("gpus_per_node", gpus_per_node), item.get("intra", intra)
        else:
            (count, name), per_node, link = item, gpus_per_node, intra
        per_node = min(per_node, count)
        if count % per_node:
            raise UserError(f"{count} x {name} is not whole nodes of {per_node} GPUs")
        groups.append(GpuGroup(count, resolve_hardware(name, link, inter, profile_dir), per_node))
    devices = {g.hw.device for g in groups}
    if len(devices) > 1:
        raise UserError("a cluster mixes CPU profiles and GPUs; plan them separately")
    return groups


def stage_hardware(groups: list[GpuGroup], pp: int) -> list[Hardware] | None:
    """The hardware of each pipeline rank, or None when some group does not hold whole pipeline ranks."""
    world = sum(g.count for g in groups)
    per_rank = world // pp
    out = []
    for g in groups:
        if g.count % per_rank:
            return None
        out += [g.hw] * (g.count // per_rank)
    return out


def slowest_first(groups: list[GpuGroup]) -> Hardware:
    """The profile the homogeneous parts of the plan (links, overlap) use: the smallest GPU memory."""
    return min((g.hw for g in groups), key=lambda h: h.memory_bytes)


def uneven_split(ctx, c, stage_hw: list[Hardware], caps: list[int] | None = None) -> tuple[int, ...] | None:
    """Blocks per stage minimising the slowest stage's time per micro-batch on its own hardware (contiguous,
    at least one block each, at most caps[r] on stage r); None when the caps leave no split."""

    pp, n = len(stage_hw), ctx.args.n_layers
    caps = caps or [n] * pp
    per_block, fixed = [], []
    for r, hw in enumerate(stage_hw):
        bc = block_costs(ctx, hw, c.tp, c.micro_batch, c.ep, c.ac)
        per_block.append(bc.forward + bc.backward + bc.recompute / c.ac.recompute_period(c.every_k))
        fixed.append(bc.head if r == pp - 1 else 0.0)
    return min_max_partition(n, pp, lambda r, j, k: fixed[r] + (k - j) * per_block[r], caps)


def place(ctx, c, stage_hw: list[Hardware], headroom: float, rounds: int = 6):
    """The candidate with the split for its stages' hardware and memory: (candidate, estimate) or (candidate with
    the last split tried, reason it does not fit)."""

    caps = [ctx.args.n_layers] * len(stage_hw)
    lay = c.layout
    for _ in range(rounds):
        split = uneven_split(ctx, c, stage_hw, caps)
        if split is None:
            return c, "no split of the blocks fits every stage's memory"
        c = c.replace(layout=dataclasses.replace(lay, pp_split=split))
        est = memory(c, ctx, all_ranks=True)
        over = [s["stage"] for s in est.stages
                if not fits(s["total_bytes"], stage_hw[s["stage"]].memory_bytes, headroom)]
        if not over:
            return c, est
        for r in over:  # fewer blocks where the memory is short
            caps[r] = max(1, split[r] - max(1, math.ceil(split[r] * 0.1)))
            if split[r] == 1:
                return c, f"stage {r} does not fit its {stage_hw[r].name} even with one block"
    return c, "no split found within the stages' memory"


def even_split_layout(lay: Layout, args) -> Layout:
    return dataclasses.replace(lay, pp_split=balanced_split(args, lay.num_stages))


def plan_hetero(ctx, opts, top: int = 5):
    """Rank the layouts of a heterogeneous cluster (`ctx.cluster`): each candidate with its stages on their groups'
    GPU types and the split for them; the even split's prediction is kept beside it (`Result.even`)."""

    groups = ctx.cluster
    world = sum(g.count for g in groups)
    # one stage per rank: the uneven split is per pipeline rank
    opts = dataclasses.replace(opts, schedules=tuple(s for s in opts.schedules if not s.multi_stage)
                               or (Schedule.ONE_F_ONE_B,))
    results, rejected = [], []
    considered = 0
    for c in candidates(ctx, world, opts):
        if c.pp < len(groups):
            continue
        considered += 1
        shw = stage_hardware(groups, c.pp)
        if shw is None:
            rejected.append(Result(c, reason=f"pp={c.pp} does not put whole pipeline ranks on each GPU group"))
            continue
        reason = structural_reason(c, ctx)
        if reason:
            rejected.append(Result(c, reason=reason))
            continue
        cctx = dataclasses.replace(ctx, stage_hw=shw, cache=ctx.cache)
        split = uneven_split(cctx, c, shw)
        c = c.replace(layout=dataclasses.replace(c.layout, pp_split=split))
        r = Result(c, pred=predict(c, cctx))
        r.stage_hw = shw
        results.append(r)
    results.sort(key=lambda r: r.pred.step_s)
    ranked, checked = [], 0
    for r in results:
        if len(ranked) >= max(top, 1) or checked >= opts.estimate_limit:
            break
        cctx = dataclasses.replace(ctx, stage_hw=r.stage_hw, cache=ctx.cache)
        c, verdict = place(cctx, r.cand, r.stage_hw, opts.headroom)
        checked += 1
        if isinstance(verdict, str):
            r.cand, r.reason = c, f"does not fit: {verdict}"
            rejected.append(r)
            continue
        r.cand, r.pred, r.estimate = c, predict(c, cctx), verdict
        r.total_bytes = verdict.total_bytes
        even = c.replace(layout=even_split_layout(c.layout, ctx.args))
        r.even = predict(even, cctx)
        ranked.append(r)
    ranked.sort(key=lambda r: r.pred.step_s)
    if not ranked:
        why = rejected[0].reason if rejected else "no layout puts whole pipeline ranks on each group"
        raise UserError(f"no layout of {' + '.join(f'{g.count} x {g.name}' for g in groups)} can run "
                        f"{ctx.model_name}: e.g. {why}")
    return Plan(ctx, opts, ranked, rejected, considered, max(0, len(results) - checked))
