"""fp8 training (torchao's float8 linear layers, emulated on a CPU) and torch.compile as training (Inductor), each
against one process (issue 37); the combinations they refuse, in one line."""

from __future__ import annotations

import pytest
import torch

from paratrain.capabilities.float8 import float8_linears
from paratrain.cli import main
from paratrain.config import load_config
from paratrain.errors import ConfigError, UserError
from paratrain.models import build_model
from paratrain.models.presets import preset_args
from paratrain.verify import CAPABILITY_MATRICES, COMPILE_MATRIX, run_verify

# the fp8 rows the suite runs here (verify's selective-checkpointing row and the compiled one are available by name;
# fp8-fsdp2, fp8-tp2 and fp8-pp2 run as docs/precision.md's verify line in tests/test_journeys.py::test_journey_verify)
DOCS_LINE_ROWS = ("fp8-fsdp2", "fp8-tp2", "fp8-pp2")
FP8_MATRIX = [r for r in CAPABILITY_MATRICES["float8"]
              if r not in ("fp8-fsdp2+selective", "compile-fp8-fsdp2", *DOCS_LINE_ROWS)]

from conftest import assert_plan_rejected, fast_overrides

TOL = 1e-5


def _check(matrix: list[str], steps: int, char_data) -> None:
    rows, _ = run_verify(matrix, steps=steps, tolerance=TOL, extra_args=[f"data.dir={char_data}"],
                         echo=lambda line: None, share_launches=True)
    report = "\n".join(f"{r.layout}: dloss {r.max_loss_diff:.2e} dweight {r.max_weight_diff:.2e} "
                       f"dval {r.val_diff:.2e} {r.note}" for r in rows)
    assert [r.layout for r in rows] == matrix
    for r in rows:
        assert len(r.losses) == steps and r.passed, report


def test_verify_fp8_rows(char_data):
    """fp8 on fsdp2 x tp2, hsdp, ep2, full checkpointing, rowwise scales, float8 all-gathers (fsdp2, tp2 and pp2: the
    docs' line): against one fp8 process within
    capabilities.float8.FP8_TOLERANCE (docs/precision.md says why it is not 1e-5)."""
    _check(FP8_MATRIX, 8, char_data)


def test_verify_compile_rows(char_data):
    """Compiled blocks (Inductor) on one process, fsdp2, fsdp2 with full checkpointing, tp2 with sp, pp2 and fp8 x
    fsdp2 against one eager process at 1e-5 (fp8's row at its own tolerance)."""
    _check(COMPILE_MATRIX, 4, char_data)


def test_a_shared_launch_compiles_each_layout_afresh(monkeypatch):
    """The compile rows share one launch (share_launches): each layout starts from a reset dynamo, as in a process of
    its own. Without it the blocks' forward kept every earlier layout's compiled entries, and from the fourth compiled
    layout on dynamo hit its recompile limit and ran the blocks eager (compile-pp2 and compile-fp8-fsdp2 passed
    uncompiled)."""
    import types

    import torch._dynamo

    from paratrain import verify

    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(verify, "run_rank", lambda cfg, *a, **k: calls.append(cfg) or types.SimpleNamespace(val_loss=0))
    verify.train_and_evaluate_all([("train1", "eval1"), ("train2", "eval2")])
    assert calls == ["reset", "train1", "eval1", "reset", "train2", "eval2"]


def test_float8_layers_are_the_blocks_projections():
    """Which linear layers multiply in float8: the blocks' projections with dimensions divisible by 16, less the ones
    kept in bf16; never the embedding, the output projection, a router or a routed expert."""
    args = preset_args("tiny-moe", vocab_size=64)
    names = {p.name.rsplit(".", 1)[0] for p in float8_linears(args)}
    assert names and all(n.startswith("layers.") for n in names)
    assert not any("router" in n or "gate" in n or ".experts" in n for n in names), names
    kept = {p.name.rsplit(".", 1)[0] for p in float8_linears(args, ("w2", "layers.0.attention.wq"))}
    assert kept == {n for n in names if not n.endswith(".w2") and n != "layers.0.attention.wq"}
    odd = preset_args("tiny", vocab_size=64, ffn_hidden=40)  # 40 is not a multiple of 16: the MLP stays bf16
    assert not any(p.name.split(".")[2] == "feed_forward" for p in float8_linears(odd))

    from torchao.float8.float8_linear import Float8Linear

    from paratrain.capabilities.float8 import Float8Config, apply_float8

    model = build_model(preset_args("tiny", vocab_size=64))
    chosen = apply_float8(model, Float8Config(), torch.device("cpu"), uses_fsdp=False)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == chosen and "output" not in converted


@pytest.mark.parametrize("overrides, message", [
    (["training.precision=fp8", "lora.rank=4"], "training.precision=fp8 with lora.rank > 0"),
    (["training.cuda_graphs=true"], "it needs training.compile=true"),
    (["training.cuda_graphs=true", "training.compile=true", "training.device=cpu"], "needs a CUDA device"),
    (["float8.recipe=columnwise"], "float8.recipe: 'columnwise' is not one of tensorwise, rowwise"),
], ids=["fp8-lora", "graphs-no-compile", "graphs-cpu", "recipe"])
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layout_refusals(char_data, tmp_path):
    assert_plan_rejected(char_data, tmp_path, 2, ["parallel.pp=2", "parallel.dp_shard=1", "training.compile=true",
                                                  "training.cuda_graphs=true", "training.device=auto"],
                         "training.cuda_graphs with parallel.pp > 1")


def test_cuda_graphs_refuse_document_packing():
    from paratrain.layout import Layout
    from paratrain.spec import check_packing

    cfg = load_config(None, ["training.compile=true", "training.cuda_graphs=true", "data.packing=documents"])
    with pytest.raises(ConfigError, match="training.cuda_graphs replays one batch shape"):
        check_packing(cfg.data, {}, Layout.resolve(1), cfg.training.cuda_graphs)


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    from paratrain.capabilities import float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as e:
        float8.check_float8_device(torch.device("cuda", 0))
    assert "NVIDIA A100-SXM4-80GB is 8.0" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_float8_device(torch.device("cuda", 0))  # an H100: no refusal


def test_plan_fp8(capsys):
    """fp8 on an H100 is faster than bf16 (float8 GEMMs), refused on an A100 (no FP8 tensor cores); the written
    config trains fp8."""
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import predict
    from paratrain.layout import Layout

    plan = ["--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--global-batch-tokens", "1048576"]
    contexts = {p: plan_context(PlanRequest("llama3-8b", gpus=8, seq=8192, global_batch_tokens=1048576, gpu="H100",
                                            precision=p)).ctx for p in ("bf16", "fp8")}
    steps = {p: predict(ctx.candidate(Layout.resolve(8, dp_mode="fsdp"), checkpointing="full", micro_batch=1),
                        ctx).step_s for p, ctx in contexts.items()}
    assert steps["fp8"] < steps["bf16"]
    assert main(["plan", *plan, "--gpu", "A100", "--precision", "fp8", "--no-write"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--precision fp8 needs FP8 tensor cores" in err and "\n" not in err


def test_fp8_trains_through_the_cli(char_data, tmp_path, capsys):
    """`paratrain train --training.precision=fp8` on a CPU: the run trains, evaluates and saves (emulated float8)."""
    code = main(["train", *[f"--{o}" for o in fast_overrides(char_data, tmp_path, "fp8", "training.precision=fp8")]])
    assert code == 0
    assert (tmp_path / "fp8" / "checkpoints" / "step-4").is_dir()


def test_estimate_counts_float8_copies():
    """Without FSDP a bf16 run's autocast keeps a bf16 copy of every matmul weight from forward to backward; an fp8
    run keeps that only for the layers that stay bf16 (the output head) and casts each float8 layer's weight per
    matmul: at most two 1-byte copies of the largest (and their scales) at once."""
    from paratrain.estimate.model_states import state_bytes
    from paratrain.layout import Layout
    from paratrain.models.registry import parameters

    args = preset_args("tiny", vocab_size=64)
    layout = Layout.resolve(1)
    bf16 = state_bytes(args, layout, "bf16", "adamw", "paratrain")
    fp8 = state_bytes(args, layout, "fp8", "adamw", "paratrain")
    float8 = float8_linears(args)
    head = sum(p.numel for p in parameters(args) if p.matmul and p not in float8)
    assert bf16.autocast_copies == 2 * (head + sum(p.numel for p in float8))
    assert fp8.autocast_copies == 2 * head + 2 * (max(p.numel for p in float8) + 4)
    assert any("fp8: " in note for note in fp8.notes)


def _losses(run_dir):
    import json

    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "loss" in r}


def test_float8_all_gather_checkpoint_resumes_and_exports(char_data, tmp_path):
    """fp8 with float8 all-gathers on 2 FSDP ranks: parameters and optimizer states are torchao's weight wrappers,
    which the checkpoint stores as plain tensors (a weights-only load reads it); a run stopped at step 2 and resumed
    trains the uninterrupted run's losses, and the checkpoint exports to Hugging Face."""
    def train(name, *extra):
        flags = [f"--{o}" for o in fast_overrides(char_data, tmp_path, name, "training.precision=fp8",
                                                  "float8.fsdp_float8_all_gather=true", "training.micro_batch=2",
                                                  "training.global_batch=4", *extra)]
        assert main(["train", "--nproc", "2", *flags]) == 0

    train("whole")
    train("parts", "training.steps=2")
    train("parts", "checkpoint.resume=auto")
    whole, parts = _losses(tmp_path / "whole"), _losses(tmp_path / "parts")
    assert sorted(parts) == sorted(whole) == [1, 2, 3, 4]
    assert all(abs(parts[s] - whole[s]) <= 1e-6 for s in whole), (parts, whole)
    assert main(["export", str(tmp_path / "parts"), "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype",
                 "fp32"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
