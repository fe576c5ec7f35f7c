"""A dry run (`paratrain train --dry-run --world N`, `paratrain plan --check`): build the real layout of an N-rank run on
this machine, without training.

For one rank of each pipeline stage (pipeline rank s: global rank s x N / pp, the first position on every other
axis, whose FSDP shards are the largest), in this one process:
- a process group of N ranks in which this process is that rank: torch's `fake` backend (a FakeProcessGroup, whose
  collectives return at once and move no data), so the mesh, its sub-groups and every collective of the set-up run
  as they would on the cluster;
- the real `ParallelDims` mesh and the trainer's own step (`build_run_step`: the model on the meta device, laid out
  by `parallelize` or cut into this rank's pipeline stages, gradient communication, the optimizer), on the meta
  device (shapes, no memory), so a 70B model at world 512 builds in seconds;
- each parameter given a gradient of its own sharded shape (what FSDP's reduce-scatter or DDP's all-reduce leaves),
  and one optimizer step on the meta device, which creates the optimizer's real state tensors;
- the bytes of the local shards of those tensors, beside the memory estimator's model states for the same pipeline
  rank (`paratrain/estimate/model_states.py`).
Layout errors that only appear when a model is really sharded (a tensor-parallel plan that does not divide, a mesh
torch refuses) surface here as one `error:` line naming the rank. Nothing is written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
import torch.nn.parallel.distributed as ddp

from paratrain.data.prepare import read_meta
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.errors import UserError
from paratrain.estimate import estimate_for_run, target_device
from paratrain.estimate.model_states import rank_layers, state_bytes
from paratrain.models import count_params, format_params
from paratrain.models.presets import preset_fields
from paratrain.spec import VOCAB_PAD, check, resolve
from paratrain.training.step import build_run_step

TOLERANCE = 0.01  # built and estimated model states per rank must agree within 1%
MIB = 2**20


@dataclass
class RankStates:
    rank: int
    coordinates: dict
    blocks: list[int]
    built: dict  # params, grads, optimizer: bytes of this rank's tensors
    estimated: dict  # the same three from the memory estimator (gradients: of the parameters' shapes)
    seconds: float
    grads_beyond_shards: int = 0  # the estimator's gradient bytes beyond the parameters' shapes (not built here)
    largest_partition: int = 0  # zero1: the data-parallel rank holding the most optimizer state, if not this one

    @property
    def difference(self) -> float:
        """Relative difference of the totals (built vs estimated)."""
        built, est = sum(self.built.values()), sum(self.estimated.values())
        return abs(built - est) / est if est else float(built != est)


@dataclass
class DryRun:
    spec: object  # the RunSpec
    ranks: list[RankStates]
    seconds: float
    notes: list[str]
    memory: str = ""  # the estimate's device and host bytes per rank (Estimate.memory_line), as the trainer prints

    @property
    def agrees(self) -> bool:
        return all(r.difference <= TOLERANCE for r in self.ranks)


def offline_spec(cfg, world: int):
    """The run's RunSpec without preparing data: the vocabulary is the model's own, else the prepared dataset's,
    else a placeholder (said in the notes)."""
    from pathlib import Path


    parts = check(cfg, world)  # every check that needs no data: one line before anything is built
    notes = []
    if (Path(cfg.data.dir) / "meta.json").is_file() and not cfg.data.sources:
        meta = read_meta(cfg.data.dir)
    else:
        meta = {"vocab_size": VOCAB_PAD * parts.layout.tp}
        m = cfg.model
        if parts.source.hf_args is None and m.vocab_size is None and preset_fields(m.preset)["vocab_size"] is None:
            notes.append(f"the vocabulary comes from the data, which is not prepared: a placeholder of "
                         f"{meta['vocab_size']}; set model.vocab_size for the real one")
    return resolve(parts, meta), notes


def stage_ranks(layout) -> list[int]:
    """One global rank per pipeline rank: the first position on every other mesh axis (pp is outermost)."""
    per_stage = layout.world_size // layout.pp
    return [s * per_stage for s in range(layout.pp)]


def dry_run(cfg, world: int) -> DryRun:
    if dist.is_initialized():
        raise UserError("the dry run builds ranks in a process group of its own: run it outside a launched job")
    import dataclasses

    started = time.perf_counter()
    spec, notes = offline_spec(cfg, world)

    estimate = estimate_for_run(spec, device=target_device(cfg.training))
    # AdamW's per-parameter implementation: the same state tensors as foreach or fused, and on the meta device much
    # faster (DTensor plans each op of a parameter shape once; a foreach op over a list of them every time)
    spec = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, optimizer=dataclasses.replace(
        spec.cfg.optimizer, impl="for")))
    estimated = _estimated_states(estimate.inputs)
    ranks = [_build_rank(spec, rank, estimated) for rank in stage_ranks(spec.layout)]
    largest = ranks[0].largest_partition
    if largest:  # zero1 (no pipeline: one stage): the estimate is of the rank with the largest optimizer partition
        ranks = [_build_rank(spec, largest, estimated)]
    return DryRun(spec, ranks, time.perf_counter() - started, notes, estimate.memory_line())


def _estimated_states(i) -> list[dict]:
    """The memory estimator's model states per pipeline rank, from the inputs it estimates this run with."""
    layers = rank_layers(i.layout, i.model_args)
    out = []
    for stage in range(i.layout.pp):
        st = state_bytes(i.model_args, i.layout, i.recipe.precision, i.recipe.optimizer, i.accounting, stage, layers,
                         i.recipe.lora, i.recipe.capabilities)
        # the gradients a backward would make beyond the parameters' shapes (whole where torch returns them whole)
        # are not built here: compared without them, and named
        out.append({"params": st.params + st.frozen, "grads": st.grads - st.grads_beyond_shards, "optimizer": st.optimizer + st.replica_states,
                    "blocks": layers[stage], "beyond": st.grads_beyond_shards})
    return out


def _build_rank(spec, rank: int, estimated: list[dict]) -> RankStates:


    started = time.perf_counter()
    layout = spec.layout
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        dims = ParallelDims.build(layout, "cpu")
        where, pp_rank = dims.coordinates(), dims.pp_rank
        try:
            with _without_ddp_shape_check():
                step = build_run_step(spec, dims, torch.device("meta"))
            for p in step.model.parameters():
                if p.requires_grad:  # (not LoRA's frozen base)
                    p.grad = torch.zeros_like(p)  # a gradient of the parameter's own (sharded) shape
            step.optimizer.step()  # creates the optimizer's state tensors, on the meta device
        except Exception as e:  # noqa: BLE001 - what torch says about this layout, as one line naming the rank
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"dry run: rank {rank} ({_position(where)}) cannot be built: {type(e).__name__}: "
                            f"{text}") from None
        built = step.state_bytes()
        largest = 0
        if spec.layout.zero1:  # ZeroRedundancyOptimizer's partition of the parameters over the data-parallel ranks
            sizes = [sum(p.numel() for group in part for p in group["params"])
                     for part in step.optimizer._partition_parameters()]
            largest = sizes.index(max(sizes))
    finally:
        dist.destroy_process_group()
    est = estimated[pp_rank]
    return RankStates(rank, where, est["blocks"], built, {k: est[k] for k in ("params", "grads", "optimizer")},
                      time.perf_counter() - started, est["beyond"], largest if largest != rank else 0)


@contextlib.contextmanager
def _without_ddp_shape_check():
    """DDP checks at construction that every rank holds the same parameter shapes: it all-gathers them and reads the
    result on the host, which tensors on the meta device cannot give (and a fake process group moves no data to
    compare: each rank is built alone here). Skipped while building."""
    original = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = original


def _position(coordinates: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in coordinates.items()) or "single process"


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f}"


def _blocks(blocks: list[int]) -> str:
    if not blocks:
        return "-"
    runs, start = [], blocks[0]
    for prev, cur in zip(blocks, [*blocks[1:], None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def format_dry_run(d: DryRun) -> str:
    spec, lay = d.spec, d.spec.layout
    lines = [f"dry run: {spec.model_name} ({format_params(count_params(spec.model_args))} parameters) on "
             f"{lay.world_size} ranks, layout {lay.describe()}, {spec.cfg.training.precision}: fake process group "
             f"(torch's 'fake' backend), meta device; one rank per pipeline stage built in {d.seconds:.1f} s",
             "model states per rank, MiB: built from the sharded tensors / estimated (paratrain estimate)",
             f"{'rank':>6} | {'mesh position':<32} | {'blocks':<9} | {'parameters':>23} | {'gradients':>23} | "
             f"{'optimizer':>23} | {'total':>23} | diff"]
    for r in d.ranks:
        cells = [f"{_mib(r.built[k])} / {_mib(r.estimated[k])}" for k in ("params", "grads", "optimizer")]
        total = f"{_mib(sum(r.built.values()))} / {_mib(sum(r.estimated.values()))}"
        lines.append(f"{r.rank:>6} | {_position(r.coordinates):<32} | {_blocks(r.blocks):<9} | "
                     + " | ".join(f"{c:>23}" for c in cells) + f" | {total:>23} | {r.difference:.2%}")
    worst = max(d.ranks, key=lambda r: r.difference)
    lines += [f"note: {n}" for n in d.notes] + ([d.memory] if d.memory else [])
    beyond = [r for r in d.ranks if r.grads_beyond_shards]
    if beyond:
        lines.append(f"note: the estimate also counts {_mib(beyond[0].grads_beyond_shards)} MiB of gradients "
                     f"beyond the parameters' shapes on rank {beyond[0].rank} (tensor parallel without FSDP: torch "
                     "returns the embedding's gradient whole, which only a backward shows); compared without them")
    if d.agrees:
        lines.append(f"built and estimated model states agree within {TOLERANCE:.0%} on every rank built "
                     f"(largest difference {worst.difference:.2%}, rank {worst.rank})")
    else:
        lines.append(f"DIFFERS: rank {worst.rank}'s model states are {worst.difference:.2%} from the estimate "
                     f"(more than {TOLERANCE:.0%}): the estimator does not count this layout as torch lays it out")
    return "\n".join(lines)
