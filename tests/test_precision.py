"""The precision-aware hardware model (issue 37): one table of dense peaks per matmul rate (fp32, TF32, bf16/fp16, FP8)
that the planner's GEMM time and the trainer's MFU both read, and training.tf32."""

from __future__ import annotations

import pytest
import torch

from paratrain.cli import main
from paratrain.commands.estimate import inputs_from_argv
from paratrain.config import load_config
from paratrain.estimate.gpus import GPUS
from paratrain.estimate.hardware import gpu_profile
from paratrain.estimate.planner import PlanRequest, plan_context
from paratrain.estimate.step_time import predict
from paratrain.layout import Layout
from paratrain.modes import MATMUL_MATHS
from paratrain.observe.flops import peak_flops
from paratrain.training.step import apply_tf32

PLAN = ("--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--global-batch-tokens", "1048576")


def _step(gpu: str, precision: str, tf32: bool | None = None):
    """The predicted step of one layout (FSDP over 8 GPUs, full checkpointing, one sequence per micro-step): the same
    layout in every precision, so the ratios are the matmul rates' (GEMMs dominate an 8B model's step)."""
    ctx = plan_context(PlanRequest("llama3-8b", gpus=8, seq=8192, global_batch_tokens=1048576, gpu=gpu,
                                   precision=precision, tf32=tf32)).ctx
    return ctx, predict(ctx.candidate(Layout.resolve(8, dp_mode="fsdp"), checkpointing="full", micro_batch=1), ctx)


def test_fp32_and_tf32_step_times_follow_the_datasheet_rates():
    """A100: 19.5 dense TFLOP/s fp32, 156 TF32, 312 bf16. An fp32 step without TF32 takes at least 10x the bf16 one
    (not the full 16x: element-wise work, communication and the optimizer step do not scale with the matmul rate),
    with TF32 between 1.5x and 3x; unset, TF32 is on for fp32 (Ampere), and the switch does nothing to a bf16 run."""
    bf16_ctx, bf16 = _step("A100", "bf16")
    fp32_ctx, fp32 = _step("A100", "fp32", False)
    tf32_ctx, tf32 = _step("A100", "fp32", True)
    assert (bf16_ctx.math(), fp32_ctx.math(), tf32_ctx.math()) == ("bf16", "fp32", "tf32")
    assert 10 <= fp32.step_s / bf16.step_s < 16
    assert 1.5 <= tf32.step_s / bf16.step_s <= 3
    assert _step("A100", "fp32")[1].step_s == tf32.step_s
    assert _step("A100", "bf16", False)[1].step_s == bf16.step_s
    # MFU against the peak of the run's rate: each within (0, 1), fp32's not 16 times too small
    for pred in (bf16, fp32, tf32):
        assert 0.2 < pred.mfu < 1
    # without TF32 tensor cores (V100) TF32 is plain fp32
    v100, v100_off = _step("V100", "fp32"), _step("V100", "fp32", False)
    assert v100[0].math() == "fp32" and v100[1].step_s == v100_off[1].step_s


def test_one_table_of_dense_peaks():
    """Every GPU has a planner profile and dense peaks in order; FP8 only where the card has FP8 tensor cores (SM 8.9
    and newer, CDNA3); sparse figures are never used (H100 SXM: 989 dense bf16, not the datasheet's 1,979)."""
    for name, gpu in GPUS.items():
        hw = gpu_profile(name)
        assert hw.peaks == gpu.peaks() and hw.peak_flops == gpu.peak("bf16") and hw.memory_bytes == gpu.memory
        rates = [gpu.peak(m) for m in MATMUL_MATHS if gpu.peak(m)]
        assert rates == sorted(rates), name
        assert bool(hw.fp8_gemm) == (gpu.fp8 is not None), name
    with_fp8 = {"H100-SXM", "H100-PCIe", "H100-NVL", "H800", "H200", "GH200", "B200", "L4", "L40", "L40S",
                "RTX4090", "RTX6000-Ada", "RTX5090", "MI300X", "MI325X"}
    assert {name for name, gpu in GPUS.items() if gpu.fp8} == with_fp8
    a100 = GPUS["A100-80GB"]
    assert [a100.peak(m) for m in ("fp32", "tf32", "bf16", "fp8")] == [19.5e12, 156e12, 312e12, None]
    assert GPUS["H100-SXM"].peak("bf16") == 989e12 and GPUS["V100-32GB"].peak("tf32") is None


@pytest.mark.parametrize("device_name, precision, tf32, peak, math", [
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5e12, "fp32"), ("NVIDIA A100-SXM4-80GB", "fp32", True, 156e12, "tf32"),
    ("NVIDIA A100-SXM4-40GB", "bf16", True, 312e12, "bf16"), ("NVIDIA H100 80GB HBM3", "fp32", True, 495e12, "tf32"),
    ("NVIDIA H100 PCIe", "fp16", False, 756e12, "bf16"), ("NVIDIA GeForce RTX 3090", "bf16", False, 71e12, "bf16"),
    ("Tesla V100-SXM2-32GB", "fp32", True, 15.7e12, "fp32"),  # no TF32 tensor cores: the switch does nothing
    ("AMD Instinct MI250X", "bf16", False, 191.5e12, "bf16"),  # one GCD, one rank
    ("NVIDIA H800", "bf16", False, 989e12, "bf16")])
def test_mfu_peak_is_the_runs_rate(device_name, precision, tf32, peak, math, monkeypatch):
    """The trainer's MFU denominator (observe/flops.py) reads the planner's table at the rate the run's matmuls go
    at on the device torch names."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 0}))
    assert peak_flops(torch.device("cuda", 0), 0.0, precision, tf32) == (peak, f"datasheet ({device_name}, {math})")


@pytest.fixture
def tf32_switches():
    """torch's TF32 switches as they were after the test (reading the old ones once the new ones say tf32 raises)."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    yield matmul
    matmul.fp32_precision, conv.fp32_precision = before


@pytest.mark.parametrize("setting, precision, capability, on", [
    (None, "fp32", (8, 0), True), (None, "fp32", (7, 0), False), (None, "bf16", (9, 0), False),
    (False, "fp32", (9, 0), False), (True, "bf16", (8, 6), True), (True, "fp32", (7, 0), True)])
def test_training_tf32_on_cuda(setting, precision, capability, on, tf32_switches, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert apply_tf32(setting, precision, torch.device("cuda", 0)) is on
    assert tf32_switches.fp32_precision == ("tf32" if on else "ieee")
    assert torch.backends.cudnn.conv.fp32_precision == ("tf32" if on else "ieee")


def test_training_tf32_is_cuda_only(tf32_switches):
    before = tf32_switches.fp32_precision
    assert apply_tf32(True, "fp32", torch.device("cpu")) is False and tf32_switches.fp32_precision == before


def test_tf32_flags(tmp_path, capsys):
    """--tf32 true|false on plan and estimate (derived from the recipe's training.tf32); plan writes it."""
    assert inputs_from_argv(["--model", "llama3-8b", "--precision", "fp32", "--tf32", "false"])[0].recipe.tf32 is False
    assert inputs_from_argv(["--model", "llama3-8b"])[0].recipe.tf32 is None
    out = tmp_path / "plan"
    assert main(["plan", *PLAN, "--gpu", "A100", "--precision", "fp32", "--tf32", "false", "--out", str(out)]) == 0
    assert "fp32 (matmuls at the fp32 peak, 19.5 TFLOP/s)" in capsys.readouterr().out
    assert load_config(out / "config.toml").training.tf32 is False
    assert main(["plan", *PLAN, "--gpu", "A100", "--tf32", "maybe", "--no-write"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--tf32: expected true or false" in err and "\n" not in err
