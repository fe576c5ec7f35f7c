"""Pipeline parallelism with `torch.distributed.pipelining`: whole blocks per stage, a named schedule.

The layout (`paratrain/layout.py`) decides the stages: schedule, stages per rank, blocks per stage and
microbatches, checked before any process starts. `build_pipeline` cuts the meta-device model into this
rank's stages, which keep their parameter names (`layers.5.attention.wq.weight` stays `layers.5...` on
whichever stage owns it), so DCP checkpoints reshard between pipelined and plain layouts. Each stage is then
laid out by the same `parallelize()` as a whole model (tensor parallel, activation checkpointing, compile,
FSDP on the data-parallel mesh) and wrapped in a `PipelineStage`. The parameters of all of this rank's stages
are gathered in one "rank model" (`StageGroup`), which the optimizer, gradient clipping and checkpoints see
like any other model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from torch import nn
import torch
import torch.distributed as dist

from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.tensors import full_tensor, not_a_view, right_pad
from paratrain.errors import UserError
from paratrain.estimate.gpus import gpu_from_device_name, gpu_memory
from paratrain.layout import Layout


# -- building ------------------------------------------------------------------------------------

def prune(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """Keep only `layers` (names unchanged), the embedding on the first stage, norm + output (and the side heads'
    modules) on the last."""
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        for name in model.side_heads:
            setattr(model, name, None)
    return model


@dataclass
class Pipeline:
    """This rank's share of a pipelined model: stage modules, PipelineStages and the schedule."""

    layout: Layout
    model: nn.Module  # the rank model (what the optimizer and checkpoints see)
    modules: dict[int, nn.Module]  # stage index -> stage module
    stages: list
    schedule: object
    group: object  # the pp process group
    pp_rank: int
    device: torch.device
    loss_fn: object = None  # the last stage's loss per microbatch (training/step.py ScheduleLoss)
    busy_s: float = 0.0
    step_s: float = 0.0

    @property
    def has_first(self) -> bool:
        return 0 in self.modules

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.modules

    @property
    def last_module(self) -> nn.Module | None:
        """The last stage's module, if this rank holds it."""
        return self.modules.get(self.layout.num_stages - 1)

    @property
    def last_owner(self) -> int:
        return self.layout.stage_owner(self.layout.num_stages - 1)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this data-parallel rank's batch; returns the batch's mean loss on every pp rank.
        `positions`: each token's position in its document (packed windows), given to every stage."""
        losses: list = []
        self.busy_s = 0.0
        start = time.perf_counter()
        target = y if self.has_last else None
        extra = {} if positions is None else {"positions": positions}
        if next(iter(self.modules.values())).side_heads:  # they train on these: see Transformer.forward
            extra["side_targets"] = y
        # return_outputs=False: the last stage would otherwise keep every microbatch's logits to the end of the step
        if self.has_first:
            self.schedule.step(x, target=target, losses=losses, return_outputs=False, **extra)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False, **extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_s = time.perf_counter() - start
        if self.has_last:
            loss = torch.stack([full_tensor(v).detach().float().reshape(()) for v in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        return self._from_last(loss)

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device).contiguous()
        dist.broadcast(value, group=self.group, group_src=self.last_owner)
        return value

    def measured_bubble(self) -> list[float]:
        """Idle fraction of each pp rank in the last step: 1 - compute time / step time (one tiny all-gather)."""
        mine = torch.tensor([1.0 - min(1.0, self.busy_s / self.step_s) if self.step_s > 0 else 0.0])
        out = [torch.zeros(1) for _ in range(self.layout.pp)]
        dist.all_gather(out, mine, group=self.group)
        return [float(o) for o in out]

    # -- forward only: evaluation and generation --------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor | None:
        """Run all stages in order (sends/receives between ranks); the last stage's owner gets the output. `cache`:
        generation's KV cache, which holds the keys of this rank's stages."""
        h = tokens
        extra = {} if positions is None else {"positions": positions}
        if cache is not None:
            extra["cache"] = cache
        p = self.layout
        for s in range(p.num_stages):
            owner = p.stage_owner(s)
            if owner != self.pp_rank:
                continue
            if s > 0 and p.stage_owner(s - 1) != owner:
                h = _recv(p.stage_owner(s - 1), self.group, self.device)
            h = self.modules[s](h, **extra)
            if s < p.num_stages - 1 and p.stage_owner(s + 1) != owner:
                _send(full_tensor(h), p.stage_owner(s + 1), self.group)
        return h if self.has_last else None

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, loss_fn, positions: torch.Tensor | None = None) -> torch.Tensor:
        """loss_fn(logits, targets) -> a float64 scalar, computed on the last stage and sent to every pp rank."""
        out = self.forward(x, positions)
        if self.has_last:
            loss = full_tensor(loss_fn(out, y)).detach().double()
        else:
            loss = torch.zeros((), dtype=torch.float64, device=self.device)
        return self._from_last(loss)

    def from_last_stage(self, tokens: torch.Tensor, fn, shape: tuple[int, ...]) -> torch.Tensor:
        """fn(the last stage's output) -> a float32 tensor of `shape`, computed on the last stage and sent to every pp
        rank."""
        out = self.forward(tokens)
        if self.has_last:
            value = fn(full_tensor(out)).float().contiguous()
        else:
            value = torch.zeros(shape, device=self.device)
        return self._from_last(value)

    def last_logits(self, tokens: torch.Tensor, vocab: int, position: int = -1, cache=None) -> torch.Tensor:
        """(B, 1, V) logits at `position` on every pp rank."""
        out = self.forward(tokens, cache=cache)
        if self.has_last:
            logits = full_tensor(out)[:, position, :].unsqueeze(1).float().contiguous()
        else:
            logits = torch.zeros(tokens.shape[0], 1, vocab, device=self.device)
        return self._from_last(logits)


class PipelineSampler(nn.Module):
    """A callable model for `generate.sample`: last-position logits on every rank, stage by stage."""

    def __init__(self, pipeline: Pipeline, vocab: int, length_multiple: int = 1):
        super().__init__()
        self._pipeline, self._vocab, self._multiple = pipeline, vocab, length_multiple

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self._pipeline.modules.values():
            m.train(mode)
        return self

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:  # (B, T) -> (B, 1, V)
        return self._pipeline.last_logits(right_pad(tokens, self._multiple), self._vocab, tokens.shape[1] - 1, cache)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _send(t: torch.Tensor, dst: int, group) -> None:
    header = torch.zeros(6, dtype=torch.int64)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2:2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(t.device), group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv(src: int, group, device) -> torch.Tensor:
    header = torch.zeros(6, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    header = header.tolist()
    t = torch.empty(header[2:2 + header[0]], dtype=_DTYPES[header[1]], device=device)
    dist.recv(t, group=group, group_src=src)
    return t


SLOWDOWN_ENV = "PARATRAIN_SIM_SLOWDOWN"


def simulated_slowdown(rank: int) -> float:
    """Benchmarks and tests only (bench/heterogeneous.py): PARATRAIN_SIM_SLOWDOWN="1,1,3,3" makes global rank r's
    pipeline compute take that many times as long (it waits (factor - 1) x each chunk's compute time after it),
    standing in for a slower GPU type on CPU ranks. Unset: 1."""
    import os

    text = os.environ.get(SLOWDOWN_ENV, "").strip()
    if not text:
        return 1.0
    factors = [float(x) for x in text.split(",")]
    return factors[rank] if rank < len(factors) else 1.0


def check_stage_gpu(expected: list[str], pp_rank: int, device: torch.device) -> None:
    """`parallel.pp_stage_gpus`: on CUDA, this rank must run on its pipeline stage's GPU type (a node order other than
    the plan's would put the large stages on the slow GPUs). CPU ranks are not checked."""
    if not expected or device.type != "cuda":
        return

    want = expected[pp_rank]
    name = torch.cuda.get_device_name(device)
    have = gpu_from_device_name(name, torch.cuda.get_device_properties(device).total_memory)
    try:  # the same GPU model (H100, A100, ...); a variant (PCIe, 40GB) is not checked
        ok = have is not None and gpu_memory(want)[0].split("-")[0] == have.split("-")[0]
    except UserError:
        ok = want.lower() in name.lower()  # a calibrated profile's name
    if not ok:
        raise UserError(f"pipeline rank {pp_rank} runs on {name}, but parallel.pp_stage_gpus puts a {want} there: "
                        "start the nodes in the plan's order (its launch lines give each node's rank)")


def _timed(pipeline: Pipeline, fn, slowdown: float = 1.0):
    def wrapper(*args, **kwargs):
        if pipeline.device.type == "cuda":
            torch.cuda.synchronize(pipeline.device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if pipeline.device.type == "cuda":
                torch.cuda.synchronize(pipeline.device)
            spent = time.perf_counter() - start
            if slowdown > 1:
                time.sleep((slowdown - 1) * spent)
                spent *= slowdown
            pipeline.busy_s += spent

    return wrapper


class StageGroup(nn.Module):
    """This rank's parameters across its stages, under the names a whole Transformer gives them (no forward: the
    stages run in the schedule)."""

    def __init__(self, modules: dict[int, nn.Module]):
        super().__init__()
        first = modules.get(0)
        last = next((m for m in modules.values() if m.output is not None), None)  # the final stage, if ours
        self.tok_embeddings = first.tok_embeddings if first is not None else None
        owned = {key: block for m in modules.values() for key, block in m.layers.items()}
        self.layers = nn.ModuleDict({k: owned[k] for k in sorted(owned, key=int)})
        self.norm = last.norm if last is not None else None
        self.output = last.output if last is not None else None
        for name in getattr(last, "side_heads", ()):
            setattr(self, name, getattr(last, name))


def build_pipeline(dims, model: nn.Module, activation_checkpoint, precision: str, compile: bool,
                   device: torch.device, seed: int, loss_fn, comm=None, capabilities=()) -> Pipeline:
    """Cut the meta-device `model` into this rank's stages, lay each out with `parallelize` (with the run's
    `capabilities`), wrap them and build the schedule.
    `loss_fn(logits, targets)` is the last stage's loss per microbatch."""

    layout = dims.layout
    pp_rank, group = dims.pp_rank, dims.pp_group
    modules: dict[int, nn.Module] = {}
    for s in layout.local_stages(pp_rank):
        stage = prune(copy.deepcopy(model), layout.stage_layers(s), s == 0, s == layout.num_stages - 1)
        modules[s] = parallelize(stage, dims, activation_checkpoint, precision, compile, device, seed, comm=comm,
                                 capabilities=capabilities)
        if stage.output is not None:  # the last stage returns the logits from FSDP's root module: no view there
            stage.output.register_forward_hook(not_a_view)
    rank_model = next(iter(modules.values())) if len(modules) == 1 else StageGroup(modules)

    # lazy: ~1 s of imports (torch.distributed.pipelining) that every rank's forkserver would pay, pipeline or not
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(modules[s], s, layout.num_stages, device, group=group) for s in sorted(modules)]
    cls = getattr(schedules, layout.pp_schedule.torch_schedule_name)
    # Each microbatch's loss is a mean; scale_grads divides the summed gradients by the microbatch count, so
    # the gradient is the mean over this rank's batch (FSDP then averages over data-parallel ranks).
    schedule = cls(stages if layout.pp_schedule.multi_stage else stages[0],
                   n_microbatches=layout.pp_microbatches, loss_fn=loss_fn, scale_grads=True)
    pipe = Pipeline(layout, rank_model, modules, stages, schedule, group, pp_rank, device, loss_fn)
    slowdown = simulated_slowdown(dist.get_rank())
    for st in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(st, name):
                setattr(st, name, _timed(pipe, getattr(st, name), slowdown))
    return pipe
