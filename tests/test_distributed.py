"""Every parallel layout against one process (gloo ranks on this machine), and layout validation.

The verify matrix is the product's central promise, so the suite runs all of it: ~2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paratrain.config import load_config
from paratrain.verify import DEFAULT_MATRIX, MOE_MATRIX, run_verify

from conftest import assert_plan_rejected, fast_overrides

TOL = 1e-5
VAL_TOL = 1e-6  # one checkpoint's val loss on the layout against one process


# Steps per layout in the test matrices: every step's loss and the final weights are compared, so a few steps with
# warm-up and decay catch what 20 do (`paratrain verify` itself runs 20); the suite's time is the budget.
MATRIX_STEPS = 8


def check_matrix(matrix: list[str], char_data, steps: int = MATRIX_STEPS) -> None:
    rows, _ = run_verify(matrix, steps=steps, tolerance=TOL, extra_args=[f"data.dir={char_data}"], echo=lambda line: None,
                         share_launches=True)
    report = "\n".join(f"{r.layout}: dloss {r.max_loss_diff:.2e} dweight {r.max_weight_diff:.2e} dval {r.val_diff:.2e} "
                       f"{r.note}" for r in rows)
    assert [r.layout for r in rows] == matrix
    for r in rows:
        assert len(r.losses) == steps, report
        assert r.max_loss_diff <= TOL and r.max_weight_diff <= TOL and r.val_diff <= VAL_TOL, report


def test_verify_default_matrix(char_data):
    check_matrix(DEFAULT_MATRIX, char_data)


def test_verify_moe_matrix(char_data):
    """Expert parallelism (ep2, ep4, ep2 x fsdp2, ep2 x tp2) against one process training the same MoE model."""
    check_matrix(MOE_MATRIX, char_data)


def test_fsdp4_holds_a_quarter_of_the_model_state(char_data, tmp_path):
    from paratrain.api import run_rank
    from paratrain.distributed.launch import launch
    from paratrain.api import train_rank as train

    single = train(load_config(None, fast_overrides(char_data, tmp_path, "one", "checkpoint.save_final=false")))
    sharded = launch(run_rank, (load_config(None, fast_overrides(
        char_data, tmp_path, "four", "checkpoint.save_final=false", "training.micro_batch=1",
        "parallel.dp_mode=fsdp")),), 4)
    full = single.memory[0]
    assert len(sharded.memory) == 4
    for row in sharded.memory:
        for key in ("params", "grads", "optimizer"):
            # dim-0 sharding of a few odd-sized tensors leaves ranks within a few rows of a quarter
            assert abs(row[key] - full[key] / 4) <= 0.02 * full[key], (key, row, full)


def _run_cli(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "loss" in r]


def test_nproc_and_torchrun_match_one_process(char_data, tmp_path):
    """`paratrain train --nproc 2` and `torchrun ... -m paratrain train` train to the same losses as one
    process on the same global batch."""
    common = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "x", "training.steps=6", "training.global_batch=8",
                                               "training.micro_batch=4", "checkpoint.save_final=false")]
    one = _run_cli([sys.executable, "-m", "paratrain", "train", *common, "--run.name=one", "--training.micro_batch=8"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run_cli([sys.executable, "-m", "paratrain", "train", "--nproc", "2", *common, "--run.name=nproc",
                    "--verbose"])
    assert two.returncode == 0, two.stderr[-2000:]
    assert "[rank 1]" in two.stdout  # with --verbose every rank introduces itself with a prefix
    torchrun = _run_cli([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "paratrain", "train", *common, "--run.name=torchrun"])
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    reference = _losses(tmp_path / "one")
    for name in ("nproc", "torchrun"):
        got = _losses(tmp_path / name)
        assert len(got) == len(reference) == 6
        assert max(abs(a - b) for a, b in zip(got, reference)) <= TOL, (name, got, reference)


@pytest.mark.parametrize("world, overrides, message", [
    (3, ["parallel.tp=2"], "does not divide the world size 3"),
    (4, ["parallel.dp_mode=fsdp", "parallel.dp_shard=3"], "world size is 4"),
    (8, ["parallel.tp=8"], "n_heads=4 is not divisible by parallel.tp=8"),
    (4, ["parallel.tp=4", "model.n_kv_heads=2"], "n_kv_heads=2 is not divisible by parallel.tp=4"),
    (2, ["parallel.pp=2", "model.n_layers=1"], "= 2 pipeline stages, but the model has only 1 blocks"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=3"], "parallel.pp_microbatches=3 does not divide"),
    (2, ["parallel.ep=2"], "parallel.ep=2 needs a mixture-of-experts model (model.moe_experts > 0)"),
    (4, ["model.preset=tiny-moe", "parallel.ep=4", "model.moe_experts=6"],
     "model.moe_experts=6 is not divisible by parallel.ep=4"),
    (2, ["model.preset=tiny-moe", "parallel.ep=2", "model.moe_top_k=5"],
     "model.moe_top_k=5 must be between 1 and model.moe_experts=4"),
    (4, ["model.preset=tiny-moe", "parallel.ep=3"], "parallel.ep=3 does not fit the mesh"),
    (4, ["model.preset=tiny-moe", "parallel.ep=4", "parallel.tp=2"], "parallel.ep=4 does not fit the mesh"),
    (2, ["model.preset=tiny-moe", "parallel.ep=2", "parallel.dp_mode=ddp"], "parallel.ep=2 needs dp_mode fsdp"),
    (4, ["training.global_batch=6"], "global batch 6 is not divisible"),
    (2, ["parallel.tp=2", "model.tie_embeddings=true"], "tied embeddings do not compose"),
    (4, ["parallel.dp_mode=hsdp"], "needs parallel.dp_replicate > 1"),
    (2, ["parallel.dp_mode=hsdp", "parallel.dp_replicate=2"], "dp_mode=hsdp with dp_shard=1 shards nothing"),
    (4, ["parallel.dp_mode=ddp", "parallel.tp=2", "parallel.dp_replicate=2"], "does not compose with tp"),
    (2, ["parallel.tp=2", "training.seq_len=33"], "not divisible by parallel.tp=2 (sequence parallel)"),
])
def test_bad_layouts_fail_before_launch(char_data, tmp_path, world, overrides, message):
    assert_plan_rejected(char_data, tmp_path, world, overrides, message)


def test_rank_forkserver_preload_touches_no_cuda():
    """Ranks fork from a forkserver that imported PRELOAD and the trainer (paratrain/distributed/launch.py): CUDA does
    not survive a fork once initialised, so those imports must not ask torch.cuda anything (checked in a fresh
    interpreter with torch.cuda's entry points recording their callers)."""
    from paratrain.api import RANK_MODULES
    from paratrain.distributed.launch import PRELOAD

    probe = (
        "import torch, importlib, sys\n"
        "calls = []\n"
        "for name in ('is_available', 'device_count', '_lazy_init', 'init', 'current_device', 'get_device_properties'):\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))\n"
        f"for module in {[*PRELOAD, *RANK_MODULES, 'paratrain.api']!r}:\n"
        "    importlib.import_module(module)\n"
        "sys.exit(f'torch.cuda asked at import: {calls}' if calls else 0)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
