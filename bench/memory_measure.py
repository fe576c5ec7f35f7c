"""Measure what the estimator predicts: live tensor bytes per rank, by category, at the peak of a training step.

Benchmark machinery (bench/memory_accuracy.py, bench/gpu.py and the estimator's tests), not part of the package: it
launches ranks to measure memory. The trainer's own measured peak is `paratrain.observe.sysmetrics.device_peak_bytes`.

`StorageTracker` is a TorchDispatchMode that sees every tensor the step creates (DTensors are
unwrapped to their local shards), follows each storage until it is freed (weak references, plus
`UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate unsharded parameters), and keeps
the running total, its peak and the breakdown at the peak. A storage's category at the peak is its
identity when it has one (a parameter, a gradient, an optimizer state, an FSDP unsharded parameter or
all-gather output, a DDP bucket, an autocast copy of a weight) and otherwise the phase in which it
was allocated (block forward = activations, the output layer and loss = logits/loss, backward =
temporaries, ...).

`measure_step(spec)` builds the step exactly as the trainer does (`training.step.build_train_step`),
runs steps that mirror `Trainer._forward_backward` + clipping + the optimizer step, and returns a
`Measurement`. It runs in the calling process; `measure(spec, world_size)` launches gloo ranks and
returns every rank's measurement. This is test/bench machinery for CPU ranks; on a GPU, the number to
compare with is `torch.cuda.max_memory_allocated()` (`device_step_peaks`, `paratrain.observe.sysmetrics.device_peak_bytes`).

PARATRAIN_MEM_DEBUG=1 prints, on rank 0, the storages live at the end of the forward and at the peak, with the
op, shapes and call site that allocated each (slow; for finding what a formula misses).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from paratrain.config import Config, ParallelConfig

# Categories (shared with the estimator's rows).
PARAMS = "parameters"
GRADS = "gradients"
OPTIM = "optimizer"
AUTOCAST = "autocast_copies"
ACTS = "activations"
LOGITS = "logits_loss"
COMM = "comm_buffers"
TEMP = "temporaries"
OTHER = "other"
CATEGORIES = (PARAMS, GRADS, OPTIM, AUTOCAST, ACTS, LOGITS, COMM, TEMP, OTHER)
HOST = "host"  # host memory (activation offloading's copies): counted apart from the device's total and peak


def _storages(t: torch.Tensor):
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class StorageTracker(TorchDispatchMode):
    """Live bytes of every storage created while active; the peak total and its breakdown by category."""

    def __init__(self, identify=None):
        super().__init__()
        self.label = OTHER
        self.identify = identify  # () -> {id(storage): category}, evaluated at each new peak
        self._info = WeakIdKeyDictionary()  # storage -> [nbytes, label, weakref]
        self.live: dict[str, int] = dict.fromkeys((*CATEGORIES, HOST), 0)
        self.total = 0
        self.host_total = self.host_peak = 0  # host bytes (HOST), beside the device's
        self.peak = 0
        self.peak_breakdown: dict[str, int] = {}
        self.peak_label = ""
        self.recording = False  # peaks are recorded only while True
        self._orig_resize = None
        self.debug = False
        self.param_storages: set[int] = set()  # ids of parameter storages (DTensor parameters' local shards)
        self._func = ""

    # -- bookkeeping -------------------------------------------------------------------------
    def _add(self, st: torch.UntypedStorage, label: str) -> None:
        if st.device.type == "meta":
            return
        info = self._info.get(st)
        if info is not None:
            self._resize(st, info)
            return
        n = st.nbytes()
        info = [n, label, None, self._func] if self.debug else [n, label, None]
        info[2] = weakref.ref(st, partial(self._freed, info))
        self._info[st] = info
        self._count(label, n)

    def _count(self, label: str, n: int) -> None:
        self.live[label] += n
        if label == HOST:
            self.host_total += n
            if self.recording:
                self.host_peak = max(self.host_peak, self.host_total)
        else:
            self.total += n

    def _freed(self, info, _ref) -> None:
        self._count(info[1], -info[0])

    def _resize(self, st, info) -> None:
        n = st.nbytes()
        if n != info[0]:
            self._count(info[1], n - info[0])
            info[0] = n

    def track(self, t: torch.Tensor, label: str) -> None:
        """Register a tensor created outside the tracker (e.g. before it was entered)."""
        for st in _storages(t):
            self._add(st, label)

    def relabel(self, t: torch.Tensor, label: str) -> None:
        for st in _storages(t):
            info = self._info.get(st)
            if info is None:
                self._add(st, label)
            elif info[1] != label:
                self._count(info[1], -info[0])
                self._count(label, info[0])
                info[1] = label

    def _update_peak(self) -> None:
        if not self.recording or self.total <= self.peak:
            return
        self.peak = self.total
        self.peak_label = self.label
        identity = self.identify() if self.identify else {}
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for st, (n, label, *_) in list(self._info.items()):
            if n and label != HOST:
                breakdown[identity.get(id(st), label)] += n
        self.peak_breakdown = breakdown
        if self.debug:
            self.peak_debug = sorted((identity.get(id(st), info[1]), info[0], info[3] if len(info) > 3 else "")
                                     for st, info in list(self._info.items()) if info[0])

    def reset_peak(self) -> None:
        self.peak, self.peak_breakdown, self.peak_label = 0, {}, ""
        self.host_peak = self.host_total

    def snapshot(self) -> dict[str, int]:
        identity = self.identify() if self.identify else {}
        out = dict.fromkeys(CATEGORIES, 0)
        for st, (n, label, *_) in list(self._info.items()):
            if n and label != HOST:
                out[identity.get(id(st), label)] += n
        return out

    # -- mode --------------------------------------------------------------------------------
    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        def resize_(st, size):
            out = orig(st, size)
            info = tracker._info.get(st)
            if info is not None:
                tracker._resize(st, info)
                tracker._update_peak()
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which we see
        out = func(*args, **(kwargs or {}))
        label = self.label
        if func is torch.ops.aten._to_copy.default and self.label not in (TEMP, COMM):
            src = args[0]
            is_weight = (src.is_leaf and src.requires_grad) or id(src.untyped_storage()) in self.param_storages
            if is_weight and (kwargs or {}).get("dtype") in (torch.bfloat16, torch.float16):
                label = AUTOCAST  # autocast's (cached) low-precision copy of a weight
        if self.debug:
            import traceback
            outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
            where = " < ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=8)[:-1][::-1][:4])
            self._func = f"{func} {[(tuple(t.shape), str(t.dtype)) for t in outs][:2]} @ {where}"
        tree_map_only(torch.Tensor, lambda t: [self._add(st, label) for st in _storages(t)], out)
        self._update_peak()
        return out


# ---------------------------------------------------------------------------------------------
def measure_config() -> Config:
    """A measured run's defaults where they are not a run's: fp32 on a CPU, sequences of 64, two of them per
    micro-step, torch's foreach AdamW kernels (what the estimator's CPU rows assume), seed 0, clipping at 1.0."""
    cfg = Config()
    cfg.training.device, cfg.training.precision, cfg.training.micro_batch, cfg.training.seq_len = "cpu", "fp32", 2, 64
    cfg.training.accum_steps, cfg.training.seed, cfg.training.grad_clip = 1, 0, 1.0
    cfg.optimizer.impl = "foreach"
    return cfg


def recipe_keys() -> dict[str, str]:
    """{a setting as the Recipe names it: its config key}: those a recipe reads from a config
    (paratrain.recipe.setting_keys), and the two a run resolves (the accumulation from the batch, the optimizer's
    kernels on the device)."""
    from paratrain.recipe import setting_keys

    return {**setting_keys(), "accum_steps": "training.accum_steps", "optimizer_impl": "optimizer.impl"}


@dataclass
class MeasureSpec:
    """One configuration to run: model dimensions and a run's config (its `[parallel]` layout, precision,
    checkpointing, batch, memory tiers and optimizer: each setting declared once, in paratrain.config), measured at
    the last of `steps` steps (the first creates the optimizer state). A pipeline runs pp_microbatches of
    training.micro_batch."""

    model: dict  # ModelArgs fields
    config: Config = field(default_factory=measure_config)
    steps: int = 2
    name: str = ""

    @classmethod
    def of(cls, model: dict, parallel: ParallelConfig | None = None, *, steps: int = 2, name: str = "",
           **settings) -> "MeasureSpec":
        """A spec from `measure_config` with `parallel` and `settings` named as the Recipe names them (precision=,
        checkpointing=, every_k=, segment_blocks=, micro_batch=, seq_len=, accum_steps=, optimizer=,
        optimizer_impl=, loss_chunks=, activation_offload=, activation_offload_every_k=: `recipe_keys`)."""
        cfg, keys = measure_config(), recipe_keys()
        cfg.parallel = parallel if parallel is not None else ParallelConfig()
        for setting, value in settings.items():
            section, key = keys[setting].split(".")
            setattr(getattr(cfg, section), key, value)
        return cls(model, cfg, steps, name)

    @property
    def training(self):
        return self.config.training  # (the batch's shape: micro_batch, seq_len, accum_steps)

    def layout(self, world_size: int):
        """The spec's parallel layout on `world_size` ranks (paratrain.layout.Layout; ConfigError if it cannot run)."""
        from paratrain.layout import Layout

        return Layout.from_config(self.config.parallel, world_size)

    def recipe(self, layout, compile: bool | str = False):
        """The run's recipe on `layout` (paratrain.recipe.Recipe: what `build_train_step` and the estimator read)."""
        from paratrain.recipe import Recipe

        t = self.training
        return Recipe.from_config(self.config, layout, t.micro_batch, t.accum_steps, "cpu").replace(compile=compile)

    def step_options(self):
        """`build_train_step`'s options for this spec (its seed, clipping and `[optimizer]`; the rest is its recipe's)."""
        from paratrain.training.step import StepOptions

        t = self.config.training
        return StepOptions(seed=t.seed, grad_clip=t.grad_clip, optimizer=self.config.optimizer)

    def batch(self, world_size: int):
        """The batch the spec's layout must divide (a pipeline: micro_batch x pp_microbatches per data rank)."""
        from paratrain.layout import Batch

        lay, t = self.layout(world_size), self.training
        steps = lay.pp_microbatches if lay.pipelined else t.accum_steps
        return Batch(t.micro_batch * steps * lay.dp, t.micro_batch, t.seq_len)


@dataclass
class Measurement:
    rank: int
    peak: int
    peak_phase: str
    at_peak: dict
    forward_end: dict  # live bytes by category right after the loss of the last micro-step's forward
    model_states: dict  # exact bytes: parameters (+buffers), gradients, optimizer
    spec: dict = field(default_factory=dict)
    fsdp_all_gathers: int = 0  # FSDP all-gathers (foreach_all_gather calls) this rank ran in the measured step
    fsdp_groups: int = 0  # FSDP parameter groups with parameters on this rank (blocks, experts, roots)
    host_peak: int = 0  # host bytes at their peak in the measured step (activation offloading's copies)


def _identity_map(model, optimizer, ddp_buckets, extra=None, pipelined: bool = False) -> dict[int, str]:
    from paratrain.training.optim import inner_optimizer

    ids: dict[int, str] = {}

    def put(t, cat):
        if t is not None:
            for st in _storages(_local(t)):
                ids.setdefault(id(st), cat)

    for t, cat in (extra() if extra else []):
        put(t, cat)
    for b in model.buffers():
        put(b, PARAMS)
    # FSDP2: unsharded parameters and all-gather outputs are communication buffers; gradients accumulated
    # unsharded between micro-batches (a pipeline step) are gradients.
    for mod in model.modules():
        state = getattr(mod, "_get_fsdp_state", None)
        if state is None:
            continue
        group = state()._fsdp_param_group
        if group is None:
            continue
        for fp in group.fsdp_params:
            for t in getattr(fp, "all_gather_outputs", []):
                put(t, COMM)
            put(getattr(fp, "unsharded_accumulated_grad", None), GRADS)
            if hasattr(fp, "_unsharded_param"):
                put(fp._unsharded_param, COMM)
                if fp._unsharded_param.grad is not None:  # accumulated over a pipeline step's micro-batches
                    put(fp._unsharded_param.grad, GRADS if pipelined else TEMP)
    opt = inner_optimizer(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            put(p, PARAMS)
            put(p.grad, GRADS)
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                put(v, OPTIM)
    for ref in ddp_buckets:
        st = ref()
        if st is not None:
            ids.setdefault(id(st), COMM)
    return ids


def _nbytes_unique(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        for st in _storages(_local(t)):
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
    return total


@contextlib.contextmanager
def _labelled_methods(tracker: StorageTracker, cls, labels: dict[str, str]):
    """While active, what `cls`'s methods named in `labels` allocate is counted under their label."""
    saved = {}
    for name, label in labels.items():
        orig = saved[name] = getattr(cls, name)

        def wrapped(self, *a, __orig=orig, __label=label, **k):
            prev, tracker.label = tracker.label, __label
            try:
                return __orig(self, *a, **k)
            finally:
                tracker.label = prev

        setattr(cls, name, wrapped)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(cls, name, orig)


def _fsdp_labels(tracker: StorageTracker):
    """Allocations made inside FSDP's unshard / post-backward are communication buffers."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return _labelled_methods(tracker, FSDPParamGroup, dict.fromkeys(("unshard", "wait_for_unshard", "post_backward"),
                                                                    COMM))


def _offload_labels(tracker: StorageTracker):
    """Activation offloading's host copies are host memory; the copies it brings back are activations again."""
    from paratrain.distributed.offload import ActivationOffloader

    return _labelled_methods(tracker, ActivationOffloader, {"_to_host": HOST, "_fetch": ACTS})


def _labeller(tracker: StorageTracker, label: str):
    """A hook that sets the tracker's label (allocations from then on are counted under it)."""
    def hook(*_):
        tracker.label = label
    return hook


def _head_done(tracker: StorageTracker):
    """A forward hook on the final norm: when the gradient reaches its input (the last block's output), the loss and
    the output layer's backward are done and what follows is temporaries."""
    def hook(mod, inp, out):
        if inp[0].requires_grad:
            inp[0].register_hook(_labeller(tracker, TEMP))
    return hook


class _PhaseLabels:
    """Probe for the shared TrainStep: labels allocations by phase (activations during forward, logits/loss from
    the final norm to the end of the loss backward) and snapshots what is live at the end of the measured forward."""

    def __init__(self, tracker: StorageTracker, model, accum_steps: int):
        self.tracker, self.model, self.accum = tracker, model, accum_steps
        self.micro, self.measuring, self.forward_end = 0, False, {}

        set_label = partial(_labeller, tracker)
        self.hooks = [model.tok_embeddings.register_forward_pre_hook(set_label(ACTS)),
                      model.norm.register_forward_pre_hook(set_label(LOGITS)),
                      model.norm.register_forward_hook(_head_done(tracker))]

    def micro_start(self, x, y) -> None:
        self.tracker.label = ACTS
        self.tracker.track(x, ACTS)
        self.tracker.track(y, ACTS)

    def forward_done(self) -> None:
        self.micro += 1
        if self.measuring and self.micro % self.accum == 0:  # the last micro-step of the measured step
            self.forward_end = self.tracker.snapshot()
        self.tracker.label = LOGITS  # loss backward, until the gradient reaches the last block

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class _PipelinePhases:
    """The probe for a pipelined step: a stage's forward is activations (its final norm, output and loss:
    logits/loss), a backward chunk is temporaries (the last stage's: logits/loss until the gradient reaches the
    last block). The schedule runs the micro-batches itself, so micro_start/forward_done are not called."""

    def __init__(self, tracker: StorageTracker, pipeline):
        self.tracker, self.forward_end, self.hooks = tracker, {}, []

        set_label = partial(_labeller, tracker)
        for module in pipeline.modules.values():
            self.hooks.append(module.register_forward_pre_hook(set_label(ACTS)))
            if module.norm is not None:
                self.hooks += [module.norm.register_forward_pre_hook(set_label(LOGITS)),
                               module.norm.register_forward_hook(_head_done(tracker))]
        for stage in pipeline.stages:
            label = LOGITS if stage.is_last else TEMP
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._labelled(getattr(stage, name), TEMP if "weight" in name else label))

    def _labelled(self, fn, label):
        def wrapper(*a, **k):
            self.tracker.label = label
            return fn(*a, **k)
        return wrapper

    def micro_start(self, x, y) -> None:
        self.tracker.label = ACTS
        self.tracker.track(x, ACTS)
        self.tracker.track(y, ACTS)

    def forward_done(self) -> None:
        pass

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _pipeline_buffers(pipeline):
    """The stages' preallocated receive buffers (activations forward, gradients backward): communication."""
    out = []
    for stage in pipeline.stages:
        for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if torch.is_tensor(buf):
                    out.append((buf, COMM))
    return out


@contextlib.contextmanager
def _count_fsdp_all_gathers(counter: list):
    """Counts FSDP2's parameter all-gathers (one `foreach_all_gather` per parameter group and gather)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    orig = group_mod.foreach_all_gather

    def counted(*a, **k):
        counter[0] += 1
        return orig(*a, **k)

    group_mod.foreach_all_gather = counted
    try:
        yield
    finally:
        group_mod.foreach_all_gather = orig


def _fsdp_group_count(model) -> int:
    n = 0
    for mod in model.modules():
        state = getattr(mod, "_get_fsdp_state", None)
        if state is not None and state()._fsdp_param_group is not None:
            n += 1
    return n


def measure_step(spec: MeasureSpec, mesh_cache: dict | None = None) -> Measurement:
    """Build the step for `spec` as the trainer does (`build_train_step`) on this process (a rank of an
    initialised gloo group, or alone), run `spec.steps` steps of the trainer's own TrainStep with the tracker on,
    and return the last step's peak and breakdown."""
    import torch.distributed as dist

    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.distributed.parallelize import unwrap
    from paratrain.models import ModelArgs
    from paratrain.training.step import build_train_step

    import gc

    gc.collect()  # what earlier configurations left for the collector is not this one's memory
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    args = ModelArgs(**spec.model)
    layout = spec.layout(world).validate(args, world, spec.batch(world))
    key = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    if mesh_cache is not None and key in mesh_cache:
        dims = dataclasses.replace(mesh_cache[key], layout=layout)
    else:
        dims = ParallelDims.build(layout, "cpu")
        if mesh_cache is not None:
            mesh_cache[key] = dims
    device = torch.device("cpu")
    ddp_buckets: list = []  # weak references to DDP's flat bucket storages
    tracker = StorageTracker()
    tracker.debug = bool(os.environ.get("PARATRAIN_MEM_DEBUG"))
    gathers = [0]
    with tracker, _fsdp_labels(tracker), _offload_labels(tracker), _count_fsdp_all_gathers(gathers):
        tracker.label = PARAMS
        step = build_train_step(args, dims, spec.recipe(layout), device, spec.step_options())  # the trainer's
        model, optimizer, pipeline = step.model, step.optimizer, step.pipeline
        if hasattr(model, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):  # the default all-reduce, remembering each bucket's flat buffer
                for st in _storages(bucket.buffer()):
                    if not any(ref() is st for ref in ddp_buckets):
                        ddp_buckets.append(weakref.ref(st))
                return allreduce_hook(state, bucket)

            model.register_comm_hook(dims.dp_group, hook)
        extra = (lambda: _pipeline_buffers(pipeline)) if pipeline is not None else None
        tracker.identify = lambda: _identity_map(unwrap(model), optimizer, ddp_buckets, extra, pipeline is not None)
        tracker.param_storages = {id(st) for p in unwrap(model).parameters() for st in _storages(_local(p))}
        inner = unwrap(model)
        probe = (_PipelinePhases(tracker, pipeline) if pipeline is not None
                 else _PhaseLabels(tracker, inner, spec.training.accum_steps))
        step.probe = probe
        gen = torch.Generator().manual_seed(1234)
        rows = spec.training.micro_batch * (layout.pp_microbatches if pipeline is not None else 1)
        chunks = 1 if pipeline is not None else spec.training.accum_steps
        # DDP rebuilds its buckets (in gradient-ready order) in the second iteration: measure after that.
        steps = max(spec.steps, 3) if hasattr(model, "register_comm_hook") else spec.steps
        for i in range(steps):
            if i == steps - 1:
                tracker.reset_peak()
                tracker.recording = probe.measuring = True
                gathers[0] = 0
            if pipeline is None:
                tracker.label = ACTS  # the batch is part of the forward's inputs
            micro = [(torch.randint(0, args.vocab_size, (rows, spec.training.seq_len), generator=gen),
                      torch.randint(0, args.vocab_size, (rows, spec.training.seq_len), generator=gen))
                     for _ in range(chunks)]
            if pipeline is not None:
                probe.micro_start(*micro[0])
            step.forward_backward(micro)
            del micro
            tracker.label = TEMP
            step.clip()
            step.update(finite=True)
            grad_bytes = _nbytes_unique([p.grad for g in optimizer.param_groups for p in g["params"]
                                         if p.grad is not None])
            step.zero_grad()
            tracker.recording = False
        probe.remove()
        # Exact model-state bytes on this rank: parameters (+ buffers), optimizer state, and the gradients
        # the optimizer saw in the measured step.
        from paratrain.training.optim import inner_optimizer

        opt = inner_optimizer(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        states = {
            PARAMS: _nbytes_unique([*params, *inner.buffers()]),
            GRADS: grad_bytes,
            OPTIM: _nbytes_unique([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]),
        }
    if tracker.debug and rank == 0:
        from collections import Counter
        for (cat, n, f), c in sorted(Counter(tracker.peak_debug).items()):
            if cat in (TEMP, LOGITS, GRADS, COMM) or os.environ.get("PARATRAIN_MEM_DEBUG") == "all":
                print("PEAK", cat, n, f, "x", c)
    roots = list(pipeline.modules.values()) if pipeline is not None else [inner]  # a pipeline: each stage's root
    result = Measurement(rank, tracker.peak, tracker.peak_label, tracker.peak_breakdown, probe.forward_end, states,
                         asdict(spec), gathers[0], sum(_fsdp_group_count(m) for m in roots), tracker.host_peak)
    del model, optimizer, step, pipeline
    return result


def _rank_measure(specs: list[MeasureSpec]):
    import torch.distributed as dist

    from paratrain.distributed.env import init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    cache: dict = {}
    out = []
    for spec in specs:
        m = measure_step(spec, cache)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, asdict(m))
        out.append(rows)
    return out


def measure(specs: list[MeasureSpec], world_size: int) -> list[list[dict]]:
    """Run each spec on `world_size` CPU ranks (gloo); returns, per spec, every rank's Measurement as a dict."""
    if world_size == 1:
        return [[asdict(measure_step(s))] for s in specs]
    from paratrain.distributed.launch import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(_rank_measure, (specs,), world_size, preload=("paratrain.training.step",))  # imported once


def device_step_peaks(spec: MeasureSpec, device, compile: bool | str = False, steps: int = 3) -> dict:
    """One process: the trainer's own step (`build_train_step`, the spec's optimizer_impl) for a 1-rank spec on `device`,
    without the tracker; the peak of the last step. On CUDA torch.cuda.max_memory_allocated and
    max_memory_reserved above what was allocated before; on a CPU (no caching allocator) the tracker's peak of live
    tensor bytes (`measure_step`) and no reserved figure."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"allocated": measure_step(spec).peak, "reserved": None}
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.models import ModelArgs
    from paratrain.training.step import build_train_step

    torch.cuda.empty_cache()
    base, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    args = ModelArgs(**spec.model)
    layout = spec.layout(1)
    step = build_train_step(args, ParallelDims(layout), spec.recipe(layout, compile), device, spec.step_options())
    gen = torch.Generator(device=device).manual_seed(0)
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t = spec.training
        micro = [tuple(torch.randint(0, args.vocab_size, (t.micro_batch, t.seq_len), device=device, generator=gen)
                       for _ in range(2)) for _ in range(t.accum_steps)]
        step.forward_backward(micro)
        step.clip()
        step.update(finite=True)
        step.zero_grad()
    torch.cuda.synchronize(device)
    out = {"allocated": torch.cuda.max_memory_allocated(device) - base,
           "reserved": torch.cuda.max_memory_reserved(device) - base_reserved}
    del step
    torch.cuda.empty_cache()
    return out


def inputs_for_spec(spec: MeasureSpec, world_size: int):
    """The estimator's inputs for a measured configuration (CPU: no runtime overhead, the spec's optimizer kernels);
    loss_chunks 0 (automatic) is resolved by the estimator with the model's vocabulary (`ChunkedLoss.resolved`)."""
    from paratrain.estimate.inputs import Target, inputs_for
    from paratrain.models.args import ModelArgs

    return inputs_for(ModelArgs(**spec.model), spec.recipe(spec.layout(world_size)),
                      Target(device="cpu", overhead_bytes=0), model_name=spec.name or "bench")
