"""Communication: gradient compression (rules, bytes, exact resume), and `paratrain profile`'s measured split.

Several short runs share one launch of the ranks (`_runs`), so the suite pays the start-up once per test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paratrain.api import run_rank
from paratrain.config import load_config
from paratrain.distributed.launch import launch
from paratrain.errors import ConfigError
from paratrain.capabilities.grad_compression import Compression, grad_compression_site
from paratrain.modes import CompressionSite
from paratrain.layout import Layout

from conftest import assert_plan_rejected, fast_overrides

BASE = ["training.global_batch=8", "training.micro_batch=4", "training.eval_every=0", "optimizer.warmup_steps=2",
        "optimizer.lr=3e-3", "resilience.collective_timeout_s=60"]


def _runs(*cfgs):
    """Every config trained one after the other by the same launched ranks (one process group); rank 0's results."""
    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def _config(data, out, name, *extra):
    return load_config(None, fast_overrides(data, out, name, *BASE, *extra))


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"loss"' in line]


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["parallel.dp_mode=fsdp", "parallel.grad_compression=sign_ef"],
     "dp_mode=fsdp reduce-scatters its gradients, where only bf16 applies"),
    (2, ["parallel.dp_mode=zero2", "parallel.grad_compression=powersgd"], "use dp_mode=ddp or zero1, or hsdp"),
    (4, ["parallel.dp_mode=hsdp", "parallel.dp_replicate=2", "parallel.grad_compression=powersgd"],
     "use sign_ef or bf16 with hsdp, or powersgd with dp_mode=ddp or zero1"),
    (2, ["parallel.pp=2", "parallel.grad_compression=bf16"], "has no data parallelism"),
    (2, ["parallel.tp=2", "parallel.grad_compression=sign_ef"], "has no data parallelism"),
    (4, ["parallel.pp=2", "parallel.dp_mode=fsdp", "parallel.grad_compression=sign_ef"], "only bf16 applies"),
    (8, ["parallel.dp_mode=hsdp", "parallel.dp_replicate=2", "parallel.tp=2", "parallel.grad_compression=sign_ef"],
     "supports no tp, pp, ep or cp yet"),
])
def test_compression_rejected_where_it_cannot_apply(char_data, tmp_path, world, overrides, message):
    assert_plan_rejected(char_data, tmp_path, world, overrides, message, micro_batch=2)


def test_where_compression_applies():
    site = grad_compression_site
    assert site(Layout.resolve(2, dp_mode="ddp"), "none") is CompressionSite.NONE
    assert {site(Layout.resolve(2, dp_mode=m), c) for m in ("ddp", "zero1") for c in ("bf16", "powersgd", "sign_ef")} \
        == {CompressionSite.DDP_HOOK}
    assert site(Layout.resolve(4, dp_mode="hsdp", dp_replicate=2), "sign_ef") is CompressionSite.REPLICATE_HOOK
    for layout in (Layout.resolve(2, dp_mode="fsdp"), Layout.resolve(4, dp_mode="hsdp", dp_replicate=2),
                   Layout.resolve(4, dp_mode="fsdp", pp=2), Layout.resolve(4, dp_mode="zero2", tp=2)):
        assert site(layout, "bf16") is CompressionSite.REDUCE_DTYPE  # MixedPrecisionPolicy(reduce_dtype=bf16)
    with pytest.raises(ConfigError, match="parallel.powersgd_warmup_steps must be >= 2"):
        load_config(None, ["parallel.powersgd_warmup_steps=1"])


def test_sign_ef_resume_is_bitwise_and_sends_a_thirtieth(char_data, tmp_path):
    """10 + resume + 10 steps with sign_ef on ddp2 give the losses of 20 straight steps, bit for bit: the error
    feedback residuals are in the checkpoint (here after a 3-step uncompressed warm-up). PowerSGD's state likewise (warm-up 2, resumed at step 4 of 8)."""
    sign = ["parallel.dp_mode=ddp", "parallel.grad_compression=sign_ef", "training.steps=20",
            "parallel.sign_ef_warmup_steps=3"]  # 3 uncompressed steps, then compressed
    power = ["parallel.dp_mode=ddp", "parallel.grad_compression=powersgd", "parallel.powersgd_warmup_steps=2",
             "parallel.powersgd_rank=2", "training.steps=8"]
    cfgs = (_config(char_data, tmp_path, "sign", *sign, "checkpoint.every=10"),
            _config(char_data, tmp_path, "sign-resumed", *sign,
                    f"checkpoint.resume={tmp_path / 'sign' / 'checkpoints' / 'step-10'}"),
            _config(char_data, tmp_path, "power", *power, "checkpoint.every=4"),
            _config(char_data, tmp_path, "power-resumed", *power,
                    f"checkpoint.resume={tmp_path / 'power' / 'checkpoints' / 'step-4'}"))
    # two launches: a PowerSGD run's gloo groups keep two worker threads (paratrain/distributed/gloo_workers.py), and
    # the runs of one launch share the first run's groups
    sign_ef, sign_resumed = launch(_runs, cfgs[:2], 2)
    powersgd, power_resumed = launch(_runs, cfgs[2:], 2)
    assert sign_resumed.losses == sign_ef.losses[10:] and sign_resumed.val_loss == sign_ef.val_loss  # ==: bitwise
    assert power_resumed.losses == powersgd.losses[4:] and power_resumed.val_loss == powersgd.val_loss
    records = _records(sign_ef.run_dir)
    assert [r["compression_ratio"] for r in records[:3]] == [1.0] * 3  # the warm-up's plain all-reduce
    assert all(r["compression_ratio"] < 0.05 and r["comm_bytes"] > 0 for r in records[3:])  # ~1/32 of fp32
    # the planner's and estimator's model of the same reduction (pieces are padded to whole bytes at run time)
    from paratrain.data import read_meta
    from paratrain.estimate.model_states import model_params
    from paratrain.spec import model_args_from

    shapes = [q.shape for q in model_params(model_args_from(cfgs[0], read_meta(char_data)["vocab_size"]))]
    predicted = Compression("sign_ef").cost(shapes, 2).wire_fraction
    assert abs(records[-1]["compression_ratio"] - predicted) < 0.05 * predicted
    power_ratios = [r["compression_ratio"] for r in _records(powersgd.run_dir)]
    assert power_ratios[:2] == [1.0, 1.0] and max(power_ratios[2:]) < 0.5  # plain all-reduce while warming up


def test_profile_ddp2_and_fsdp2(char_data, tmp_path):
    """Profiled steps write Chrome traces per rank that parse, with a compute / exposed-communication split that
    adds up; profiling, and prefetching two blocks ahead, leave the losses bitwise those of an unprofiled run with
    FSDP2's own prefetching."""
    steps = ["training.steps=4", "checkpoint.save_final=false", "sample.max_new_tokens=0"]
    profiled = ["metrics.profile_steps=3", "metrics.profile_start=1"]
    plain_fsdp = ["parallel.fsdp_forward_prefetch=0", "parallel.fsdp_backward_prefetch=1"]
    cfgs = (_config(char_data, tmp_path, "ddp", "parallel.dp_mode=ddp", *steps, *profiled),
            _config(char_data, tmp_path, "fsdp", "parallel.dp_mode=fsdp", *steps, *profiled,
                    "parallel.fsdp_forward_prefetch=2", "parallel.fsdp_backward_prefetch=2"),
            _config(char_data, tmp_path, "ddp-plain", "parallel.dp_mode=ddp", *steps),
            _config(char_data, tmp_path, "fsdp-plain", "parallel.dp_mode=fsdp", *steps, *plain_fsdp))
    ddp, fsdp, ddp_plain, fsdp_plain = launch(_runs, cfgs, 2)
    assert ddp.losses == ddp_plain.losses and fsdp.losses == fsdp_plain.losses
    for run in (ddp, fsdp):
        folder = run.run_dir / "profile"
        for rank in (0, 1):
            trace = json.loads((folder / f"rank{rank}.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert {"paratrain.step#1", "paratrain.step#3"} <= names
            assert any(n.startswith("gloo:") for n in names)
        summary = json.loads((folder / "summary.json").read_text())
        assert [r["rank"] for r in summary["ranks"]] == [0, 1]
        for row in summary["ranks"]:
            assert len(row["steps"]) == 3 and row["top_operators"]
            for s in [row["mean"], *row["steps"]]:
                for key in ("compute_fraction", "comm_fraction", "exposed_comm_fraction", "overlapped_fraction"):
                    assert 0.0 <= s[key] <= 1.0, (key, s)
                assert s["compute_fraction"] + s["exposed_comm_fraction"] <= 1.0 + 1e-9
                assert s["exposed_comm_fraction"] <= s["comm_fraction"] + 1e-9
                assert s["compute_fraction"] > 0.05 and s["comm_fraction"] > 0.0
        records = _records(run.run_dir)
        assert [r.get("comm_measured_by") for r in records] == [None, "profiler", "profiler", "profiler"]
        by_step = {s["step"]: s for s in summary["ranks"][0]["steps"]}
        for r in records[1:]:
            assert r["comm_time_s"] == by_step[r["step"] - 1]["exposed_comm_s"]
            assert abs(r["compute_time_s"] + r["comm_time_s"] + r["data_time_s"] - r["step_time_s"]) < 1e-9


def test_profile_command(char_data, tmp_path):
    """`paratrain profile` (here one process; the ranks' side is the test above) prints the table and writes nothing
    but the run's log and the profile: no checkpoint."""
    args = [sys.executable, "-m", "paratrain", "profile", "--steps", "2",
            *[f"--{o}" for o in fast_overrides(char_data, tmp_path, "p", *BASE)], "--training.micro_batch=8"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile of steps 1-2" in proc.stdout and "exposed %" in proc.stdout and "top operators, rank 0" in proc.stdout
    assert (tmp_path / "p" / "profile" / "rank0.json").is_file() and not (tmp_path / "p" / "checkpoints").exists()
    bad = subprocess.run([sys.executable, "-m", "paratrain", "profile", "--steps", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --steps must be >= 1"


def test_planner_and_estimator_know_compression():
    """Bytes times the wire fraction plus the compress/decompress compute in the planner; the error-feedback state
    in the estimator."""
    from paratrain.commands.estimate import inputs_from_argv
    from paratrain.estimate.core import estimate
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import predict

    shapes = [(512, 256), (256,), (64, 64), (8, 8)]
    numel = 512 * 256 + 256 + 64 * 64 + 64
    sign = Compression("sign_ef").cost(shapes, 4)
    assert sign.wire_fraction == (numel / 8 + 4 * len(shapes) * 4) / (4 * numel)
    assert sign.state_bytes == 4 * numel + numel  # worker residual + this rank's quarter (server residual)
    blocks = Compression("sign_ef", sign_ef_block=64).cost(shapes, 4)
    assert blocks.wire_fraction == 1 / 32 + 1 / 64
    power = Compression("powersgd", powersgd_rank=4).cost(shapes, 4)
    # 512x256 and 64x64 compressed at rank 4; the vector and the 8x8 matrix sent as they are
    assert power.wire_fraction == (4 * (512 + 256) + 4 * (64 + 64) + 256 + 64) / numel
    assert Compression("bf16").cost(shapes, 4).wire_fraction == 0.5

    preds = {}
    for method in ("none", "bf16", "powersgd", "sign_ef"):
        ctx = plan_context(PlanRequest("llama3.2-1b", gpus=16, gpu="H100", inter="eth25", seq=2048,
                                       global_batch_tokens=1048576, parallel={"grad_compression": method})).ctx
        preds[method] = predict(ctx.candidate(Layout.resolve(16, dp_mode="ddp"), checkpointing="none", micro_batch=4), ctx)
    assert preds["none"].compress_s == 0 and all(preds[m].compress_s > 0 for m in ("bf16", "powersgd", "sign_ef"))
    exposed = {m: p.comm_exposed_s for m, p in preds.items()}
    assert exposed["sign_ef"] < exposed["powersgd"] < exposed["bf16"] < exposed["none"]
    assert preds["sign_ef"].step_s < preds["none"].step_s  # 25 Gb/s between nodes: compression pays

    est = {m: estimate(inputs_from_argv(["--model", "llama3.2-1b", "--dp-mode", "ddp", "--dp-shard", "8",
                                         "--gpu", "H100", "--grad-compression", m])[0], suggest=False)
           for m in ("none", "sign_ef")}
    grads = est["none"].sizes["gradients"]
    assert "compression" not in est["none"].sizes
    assert est["sign_ef"].sizes["compression"] == grads + grads // 8
    with pytest.raises(ConfigError, match="only bf16 applies"):
        estimate(inputs_from_argv(["--model", "llama3.2-1b", "--dp-shard", "8", "--grad-compression", "sign_ef"])[0])


def test_none_leaves_ddp_and_fsdp_as_they_were():
    """grad_compression = none (the default) registers no DDP hook, no FSDP all-reduce hook and no prefetching, and
    keeps FSDP's fp32 reduction: the runs are those of paratrain before compression existed (verify's 1e-6 checks
    every layout with it)."""
    from types import SimpleNamespace

    import torch

    from paratrain.config import ParallelConfig
    from paratrain.distributed.compression import GradComm

    class Untouchable(torch.nn.Module):
        def __getattr__(self, name):
            if name.startswith(("register_comm_hook", "set_")):
                raise AssertionError(f"grad_compression=none called {name}")
            return super().__getattr__(name)

    for mode in ("ddp", "zero1", "fsdp", "zero2"):
        comm = GradComm(ParallelConfig(), SimpleNamespace(layout=Layout.resolve(2, dp_mode=mode)), torch.device("cpu"))
        assert comm.site is CompressionSite.NONE and comm.reduce_dtype == torch.float32
        if mode in ("ddp", "zero1"):
            comm.attach_ddp(Untouchable())
        else:
            comm.attach_fsdp(Untouchable(), [Untouchable()] * 3)
        assert comm.compressor is None and comm.state_dict() == {}

