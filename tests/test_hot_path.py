"""The training loop's hot path never waits for the device: outside settle points (log steps, saves, the end) a step
reads no tensor on the host (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`) and calls no synchronize.

On a CPU every tensor is host memory, so the test counts every read and names where each came from; the only reads
allowed outside log steps are the ones that are host memory on a GPU too:
- `torch.optim`'s foreach/for AdamW reads its own step counters, which torch keeps on the CPU for them on any device;
- with those optimizers the step reads its `finite` flag once to skip a non-finite update (torch's foreach and for
  AdamW cannot skip on the device; optimizer.impl=auto picks fused AdamW, which can: no read at all, apart from fp16
  on a CPU);
- the preemption flag is all-reduced over a gloo group in CPU memory (multi-process runs).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys

import torch

from conftest import fast_config

STEPS = 6
RUN = [f"training.steps={STEPS}", "training.log_every=1000", "training.eval_every=0", "checkpoint.every=0",
       "checkpoint.save_final=false", "training.global_batch=8", "training.micro_batch=4"]
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
HERE = os.path.abspath(__file__)


def _origin() -> str:
    """Where a read came from: the calling frame, as file:function (paratrain) or torch/path:function."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == HERE:
        frame = frame.f_back
    path = frame.f_code.co_filename
    if os.sep + "torch" + os.sep in path:
        return "torch/" + path.split(os.sep + "torch" + os.sep, 1)[1] + ":" + frame.f_code.co_name
    return f"{os.path.basename(path)}:{frame.f_code.co_name}"


@contextlib.contextmanager
def counting_reads():
    """Yields {iteration: Counter(origin)} of host reads and synchronizes, per loop iteration (counted from each
    call of ResilienceGuard.at_boundary, the loop's first call), with the iterations that settled in `settled`."""
    from paratrain.training.loop import Trainer
    from paratrain.training.resilience import ResilienceGuard

    seen = {"iteration": -1, "settled": set(), "reads": collections.defaultdict(collections.Counter), "busy": False}
    patched = []

    def patch(owner, name, wrap):
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, wrap(original))

    def counted(original, label):
        def wrapper(*args, **kwargs):
            if not seen["busy"] and seen["iteration"] >= 0:
                seen["busy"] = True  # a read inside a read (DTensor, printing) is not another one
                try:
                    seen["reads"][seen["iteration"]][f"{label} {_origin()}"] += 1
                finally:
                    seen["busy"] = False
            return original(*args, **kwargs)
        return wrapper

    def at_boundary(original):
        def wrapper(self, *args):
            seen["iteration"] += 1
            return original(self, *args)
        return wrapper

    def settle(original):
        def wrapper(self, *args):
            seen["settled"].add(seen["iteration"])
            return original(self, *args)
        return wrapper

    for name in READS:
        patch(torch.Tensor, name, lambda f, n=name: counted(f, n))
    patch(torch.cuda, "synchronize", lambda f: counted(f, "cuda.synchronize"))
    patch(torch.cuda.Event, "synchronize", lambda f: counted(f, "Event.synchronize"))
    patch(ResilienceGuard, "at_boundary", at_boundary)
    patch(Trainer, "_settle", settle)
    try:
        yield seen
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def hot_reads(seen) -> dict:
    """Reads of the iterations that are not settle points: {origin: count}."""
    total = collections.Counter()
    for iteration, counter in seen["reads"].items():
        if iteration not in seen["settled"]:
            total.update(counter)
    return dict(total)


def _counted_run(cfg):
    from paratrain.api import run_rank

    with counting_reads() as seen:
        run_rank(cfg)
    return hot_reads(seen), sorted(seen["settled"])


def test_no_host_reads_outside_log_steps(char_data, tmp_path):
    from paratrain.api import train_rank

    # optimizer.impl=fused is what `auto` picks on CUDA: nothing at all is read between log steps, also with the
    # numerics watch on (its statistics are read with the step's other numbers at the settle point)
    with counting_reads() as seen:
        result = train_rank(fast_config(char_data, tmp_path, "fused", *RUN, "optimizer.impl=fused",
                                        "metrics.numerics_every=2"))
    watched = [r["step"] for r in map(json.loads, (result.run_dir / "metrics.jsonl").open()) if "numerics" in r]
    assert watched == [2, 4, 6]
    assert len(result.losses) == STEPS and sorted(seen["settled"]) == [0, STEPS - 1]  # the first and the last step
    assert hot_reads(seen) == {}
    # foreach (the default for fp16 on a CPU): torch.optim's CPU step counters, and the one read of the finite flag
    with counting_reads() as seen:
        train_rank(fast_config(char_data, tmp_path, "foreach", *RUN, "optimizer.impl=foreach"))
    reads = hot_reads(seen)
    flag = reads.pop("__bool__ step.py:update")
    assert flag == STEPS - 2
    assert all(origin.startswith("item torch/optim/") for origin in reads), reads


def test_no_host_reads_outside_log_steps_fsdp2(char_data, tmp_path):
    from paratrain.distributed.launch import launch

    cfg = fast_config(char_data, tmp_path, "fsdp2", *RUN, "optimizer.impl=fused", "parallel.dp_mode=fsdp")
    reads, settled = launch(_counted_run, (cfg,), 2)  # rank 0's
    assert settled == [0, STEPS - 1]
    # the stop and save flags: one all-reduce of a CPU tensor per step (gloo on every backend)
    assert reads == {"tolist resilience.py:at_boundary": STEPS - 2}, reads


def test_build_train_step_keeps_its_grad_comm():
    """The step carries the GradComm it laid the model out with: the trainer checkpoints its state (error feedback,
    PowerSGD's Q and step count), tells it each step's index (sign_ef's warm-up) and logs its bytes through it."""
    from paratrain.distributed.compression import GradComm
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.layout import Layout
    from paratrain.models import preset_args
    from paratrain.training.step import build_train_step

    step = build_train_step(preset_args("tiny", vocab_size=64), ParallelDims(Layout.resolve(1)))
    assert isinstance(step.comm, GradComm)
