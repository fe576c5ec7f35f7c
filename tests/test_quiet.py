"""What a run prints is the run: no Python warning in a default training on 1, 2, 4 and 8 ranks (each warning is fixed
where it is ours, or filtered with its reason where it asks nothing of the person: paratrain/quiet.py), and the
profiler's start and stop markers are not shown. The documented commands are checked the same way by every journey
(tests/test_journeys.py, `Journey.doc`)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from conftest import noise
from paratrain.distributed.tensors import not_a_view
from paratrain.observe.profile import without_usdt_markers


def test_default_training_prints_no_python_warning(char_data, tmp_path, prewarmed):
    """`paratrain train --nproc N --oversubscribe` (the default layout: one process, then FSDP over N ranks) for two
    short steps. One rank runs as a new interpreter (a warning at import time shows there), the others forked from
    a process that imported torch already (tests/prewarmed.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    for nproc in (1, 2, 4, 8):
        argv = [sys.executable, "-m", "paratrain", "train", "--nproc", str(nproc), "--oversubscribe",
                f"--data.dir={char_data}", f"--run.out_dir={tmp_path}", f"--run.name=ranks{nproc}",
                "--training.steps=2", "--training.seq_len=32", "--training.micro_batch=2",
                "--training.eval_sequences=8", "--sample.max_new_tokens=8"]
        if nproc == 1:
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        else:
            done = prewarmed.run(argv, cwd=tmp_path, env=env, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{nproc} ranks: exit {done.returncode}\n{output[-3000:]}"
        assert "val loss" in output, output[-3000:]
        assert not noise(output), f"{nproc} ranks:\n" + "\n".join(noise(output))  # Python warnings among them


def test_profiler_markers_dropped_other_lines_kept(capfd):
    """Kineto's USDT markers go; whatever else C++ writes to stderr meanwhile (its warnings, errors) stays."""
    with without_usdt_markers():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"W kineto: a real warning\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "a real warning" in err


def test_pipeline_logits_are_no_view():
    """The last pipeline stage's logits under tensor parallelism are to_local()'s view of the DTensor's local tensor;
    FSDP2 warns of a view among its root's outputs (an in-place op on it would drop its pre-backward hook). The hook
    hands them on as a tensor of their own: the same memory, no copy, and the same gradient."""
    class ViewOut(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return y.view_as(y)  # a view, as to_local() returns

    projection = ViewOut(4, 6, bias=False)
    projection.register_forward_hook(not_a_view)
    x = torch.randn(3, 4)
    out = projection(x)
    assert not out._is_view()
    out.square().sum().backward()
    assert torch.allclose(projection.weight.grad, (2 * (x @ projection.weight.T)).T @ x)
