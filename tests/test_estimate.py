"""The memory estimator: exact model-state bytes per layout, activations and peaks against measurement,
`paratrain estimate` output, and one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from paratrain.cli import main
from paratrain.config import ParallelConfig
from paratrain.estimate import Target, estimate, gpu_memory, inputs_for, parse_memory
from paratrain.recipe import Recipe
from paratrain.estimate.core import forward_end_bytes, in_flight
from paratrain.estimate.model_states import model_params, state_bytes, zero_table, zero1_worst_numel
from paratrain.errors import UserError
from paratrain.layout import Layout
from paratrain.models import ModelArgs, count_params, preset_args
from memory_measure import MeasureSpec, inputs_for_spec, measure  # bench/ (tests/conftest.py)

TINY = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=64)
LLAMA8B_PARAMS = 8_030_261_248


def llama8b():
    return preset_args("llama3-8b")


# -- model states -----------------------------------------------------------------------------
def test_param_list_matches_count_params():
    for name in ("llama3-8b", "llama3.2-1b", "llama3-70b"):
        args = preset_args(name)
        assert sum(p.numel for p in model_params(args)) == count_params(args)
    assert count_params(llama8b()) == LLAMA8B_PARAMS


def test_classic_breakdown_llama3_8b_and_zero_division():
    rows = {r["row"]: r for r in zero_table(llama8b(), ranks=8)}
    n = LLAMA8B_PARAMS
    assert rows["parameters (bf16)"]["one_rank"] == 2 * n == 16_060_522_496  # 16.06 GB
    assert rows["gradients (bf16)"]["one_rank"] == 2 * n
    assert rows["optimizer moments (fp32)"]["one_rank"] == 8 * n == 64_242_089_984  # 64.24 GB
    assert rows["master weights (fp32)"]["one_rank"] == 4 * n == 32_121_044_992  # 32.12 GB
    assert rows["total"]["one_rank"] == 16 * n
    # ZeRO-1 divides moments + master, ZeRO-2 also gradients, ZeRO-3 also parameters.
    assert rows["optimizer moments (fp32)"]["zero1"] == n and rows["master weights (fp32)"]["zero1"] == n // 2
    assert rows["gradients (bf16)"]["zero1"] == 2 * n and rows["gradients (bf16)"]["zero2"] == n // 4
    assert rows["parameters (bf16)"]["zero2"] == 2 * n and rows["parameters (bf16)"]["zero3"] == n // 4
    assert rows["total"]["zero3"] == 2 * n

    # The same numbers in the estimate's table, one rank, classic accounting.
    est = estimate(inputs_for(llama8b(), Recipe(Layout.resolve(1), precision="bf16"), accounting="classic"),
                   suggest=False)
    assert est.at_peak["parameters"] == 2 * n and est.at_peak["gradients"] == 2 * n
    assert est.at_peak["optimizer"] == 8 * n and est.at_peak["master"] == 4 * n
    text = est.format_table("GB")
    assert "16.06 GB" in text and "64.24 GB" in text and "32.12 GB" in text


@pytest.mark.parametrize("mode, replicate", [("fsdp", 1), ("zero2", 1), ("hsdp", 2)])
def test_classic_zero_stages_in_the_estimate(mode, replicate):
    n = LLAMA8B_PARAMS
    lay = Layout.resolve(8, dp_mode=mode, dp_replicate=replicate)
    st = state_bytes(llama8b(), lay, "bf16", "adamw", "classic")
    shards = 8 // replicate
    assert st.optimizer == 8 * math.ceil(n / shards) and st.master == 4 * math.ceil(n / shards)
    assert st.grads == 2 * math.ceil(n / shards)
    assert st.params == (2 * n if mode == "zero2" else 2 * math.ceil(n / shards))


def test_paratrain_states_exact_per_dp_mode():
    args = ModelArgs(**TINY)
    P = count_params(args)
    tensors = len(model_params(args))
    one = state_bytes(args, Layout.resolve(1), "bf16", "adamw", "paratrain")
    assert (one.params, one.grads, one.optimizer, one.master) == (4 * P, 4 * P, 8 * P + 4 * tensors, 0)
    matmul = sum(p.numel for p in model_params(args) if p.matmul)  # autocast's bf16 weight copies
    assert one.autocast_copies == 2 * matmul
    ddp = state_bytes(args, Layout.resolve(4, dp_mode="ddp"), "bf16", "adamw", "paratrain")
    assert (ddp.params, ddp.optimizer) == (one.params, one.optimizer)
    # ZeRO-1: whole parameters, greedy, largest first: the worst rank holds more than a quarter.
    z1 = state_bytes(args, Layout.resolve(4, dp_mode="zero1"), "bf16", "adamw", "paratrain")
    shapes = [(p, p.numel) for p in model_params(args)]
    assert z1.optimizer == 8 * zero1_worst_numel(shapes, 4) + 4 * math.ceil(tensors / 4)
    assert zero1_worst_numel(shapes, 4) >= P / 4
    # FSDP: dim 0 in ceil(rows / 4) chunks on every rank; fp32 params are the master weights, no autocast.
    f4 = state_bytes(args, Layout.resolve(4, dp_mode="fsdp"), "bf16", "adamw", "paratrain")
    sharded = sum(math.ceil(p.shape[0] / 4) * math.prod(p.shape[1:]) for p in model_params(args))
    assert (f4.params, f4.grads, f4.autocast_copies, f4.master) == (4 * sharded, 4 * sharded, 0, 0)
    assert f4.optimizer == 8 * sharded + 4 * tensors
    # HSDP shards over dp_shard only; tp splits first.
    h = state_bytes(args, Layout.resolve(4, dp_mode="hsdp", dp_replicate=2), "fp32", "adamw", "paratrain")
    assert h.params == 4 * sum(math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) for p in model_params(args))
    t = state_bytes(args, Layout.resolve(2, tp=2), "fp32", "sgd", "paratrain")
    norms = sum(p.numel for p in model_params(args) if len(p.shape) == 1)
    assert t.params == 4 * ((P - norms) // 2 + norms) and t.optimizer == t.params  # sgd: one momentum buffer


def test_pipeline_in_flight_per_schedule():
    def lay(schedule, m=8):  # interleaved schedules and zbv: 2 stages per rank
        return Layout.resolve(4, pp=4, pp_schedule=schedule, pp_microbatches=m)

    assert [in_flight(lay("1f1b"), s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(lay("gpipe"), 0) == 8 and in_flight(lay("gpipe"), 3) == 8
    # interleaved (v = 2): (v-1)p + 2(p-1-r) + 1 chunk-forwards of half the rank's blocks: 1 + (p-1)/(pv) more than 1f1b
    assert in_flight(lay("interleaved_1f1b"), 0) == (4 + 6 + 1) / 2
    assert in_flight(lay("zbv"), 2) == 4
    e = estimate(inputs_for(llama8b(), Recipe(lay("1f1b"), seq_len=4096)), suggest=False)
    assert e.stage == 0 and len(e.stages) == 4  # the first stage holds the most micro-batches
    assert e.stages[0]["tensor_peak_bytes"] > e.stages[1]["tensor_peak_bytes"] > e.stages[2]["tensor_peak_bytes"]
    # With full checkpointing the in-flight activations shrink and the last stage's logits are the worst.
    e = estimate(inputs_for(llama8b(), Recipe(lay("1f1b"), seq_len=4096, checkpointing="full")), suggest=False)
    assert e.stage == 3 and e.phase.startswith("loss backward") and e.at_peak["logits_loss"] > 0


@pytest.mark.parametrize("schedule, mode, dp_mode", [
    ("gpipe", "full", "fsdp"), ("1f1b", "selective", "zero2"), ("interleaved_1f1b", "none", "fsdp"),
    ("interleaved_zero_bubble", "none", "fsdp"), ("zbv", "none", "ddp"), (None, "none", "ddp")])
def test_schedule_walk_by_groups_equals_action_by_action(schedule, mode, dp_mode):
    """The estimator walks a rank's schedule by groups of like backwards (`schedule_by_events`): the same peak,
    phase, bytes and sizes as walking it action by action, on every rank (and without a pipeline, with
    accumulation)."""
    from paratrain.estimate.core import rank_walk

    pp = 1 if schedule is None else 4
    lay = Layout.resolve(8, pp=pp, dp_mode="fsdp" if pp > 1 else dp_mode,
                         **({"pp_schedule": schedule, "pp_microbatches": 8} if pp > 1 else {}))
    i = inputs_for(llama8b(), Recipe(lay, seq_len=1024, checkpointing=mode, micro_batch=1,
                                     accum_steps=1 if pp > 1 else 4))
    for rank in range(pp):
        fast, slow = rank_walk(i, rank).schedule_by_events(), rank_walk(i, rank).schedule_in_order()
        assert fast.peak() == slow.peak() and fast.sizes == slow.sizes
        assert list(fast.sizes) == list(slow.sizes)


def test_moe_expert_parallel_divides_experts():
    from paratrain.models.presets import PRESETS

    if "mixtral-8x7b" not in PRESETS:
        pytest.skip("no MoE presets in this tree")
    args = preset_args("mixtral-8x7b")
    one = state_bytes(args, Layout.resolve(8, dp_mode="fsdp"), "bf16", "adamw", "paratrain")
    ep = state_bytes(args, Layout.resolve(8, dp_mode="fsdp", ep=8), "bf16", "adamw", "paratrain")
    assert ep.params == pytest.approx(one.params, rel=0.02)  # fsdp over 8 vs experts over ep=8: same share
    e = estimate(inputs_for(args, Recipe(Layout.resolve(8, dp_mode="fsdp", ep=8), seq_len=4096,
                                       checkpointing="full")), suggest=False)
    assert e.peak_bytes > ep.params + ep.optimizer


# -- against measurement --------------------------------------------------------------------
def _spec(tp: int = 1, **kw) -> MeasureSpec:
    base = dict(model=TINY, precision="fp32", checkpointing="none", micro_batch=2, seq_len=32)
    return MeasureSpec.of(parallel=ParallelConfig(dp_mode="fsdp", tp=tp), **{**base, **kw})


def _check(rows, spec, world, tol_total=0.05, tol_acts=0.10):
    est = estimate(inputs_for_spec(spec, world), suggest=False)
    worst = max(rows, key=lambda r: r["peak"])
    assert abs(est.peak_bytes - worst["peak"]) <= tol_total * worst["peak"], (spec.name, est.phase, worst, est.at_peak)
    predicted = forward_end_bytes(est.inputs)["activations"]
    measured = worst["forward_end"]["activations"]
    assert abs(predicted - measured) <= tol_acts * measured, (spec.name, predicted, measured)
    for key in ("parameters", "optimizer", "gradients"):  # model states are exact (to the loss scalars)
        assert abs(est.sizes.get(key, 0) - worst["model_states"][key]) <= 64, (key, est.sizes, worst)


@pytest.mark.parametrize("kw", [
    dict(precision="fp32", checkpointing="none"),
    dict(precision="bf16", checkpointing="selective", micro_batch=1, seq_len=64),
    dict(precision="fp32", checkpointing="every_k"),
    dict(precision="bf16", checkpointing="full", accum_steps=2),
    # Qwen3-shaped: per-head q/k norms (their saved tensors), q/k/v/o biases (autocast copies), head_dim != dim / heads
    dict(precision="bf16", checkpointing="none", model=dict(TINY, head_dim=32, family="qwen3-bias")),
], ids=["fp32", "bf16-selective", "fp32-every_k", "bf16-full-accum2", "qwen3-bf16"])
def test_one_process_matches_measurement(kw):
    spec = _spec(**kw)
    [rows] = measure([spec], 1)
    _check(rows, spec, 1)


def test_two_ranks_fsdp_and_tp_match_measurement():
    specs = [_spec(name="fsdp2 bf16", precision="bf16"),
             _spec(name="tp2+sp selective", tp=2, checkpointing="selective")]
    results = measure(specs, 2)
    for spec, rows in zip(specs, results):
        assert len(rows) == 2
        _check(rows, spec, 2)


# -- the command line ---------------------------------------------------------------------------
def test_cli_fits_and_does_not_fit(capsys):
    assert main(["estimate", "--model", "llama3-8b", "--gpu", "H100", "--dp-shard", "8", "--seq-len", "4096",
                 "--checkpointing", "full"]) == 0
    out = capsys.readouterr().out
    assert "=> FITS" in out and "ZeRO-1" in out and "logits and loss" in out and "GiB" in out
    assert main(["estimate", "--model", "llama3-8b", "--gpu", "RTX4090"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "would fit:" in out


def test_cli_suggests_the_cheapest_change(capsys):
    # 8 x H100 with no checkpointing at 8k tokens does not fit; selective checkpointing is the cheapest fix.
    assert main(["estimate", "--model", "llama3-8b", "--gpu", "H100", "--dp-shard", "8", "--micro-batch", "2",
                 "--seq-len", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["suggestion"]["change"].startswith("--checkpointing")
    assert data["suggestion"]["total_bytes"] <= data["gpu_bytes"]


def test_cli_json_and_memory_string(capsys):
    assert main(["estimate", "--model", "llama3.2-1b", "--gpu-memory", "24GiB", "--dp-mode", "ddp", "--world-size", "2",
                 "--precision", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_bytes"] == 24 * 2**30 and data["layout"]["world_size"] == 2
    assert data["at_peak_bytes"]["comm_buffers"] > 0  # DDP buckets
    assert data["total_bytes"] == data["tensor_peak_bytes"] + data["overhead_bytes"]


@pytest.mark.parametrize("dp_mode, note", [("ddp", "autocast caches each matmul weight's fp16 copy"),
                                           ("fsdp", "fp16 copies are all-gathered per block")])
def test_cli_notes_name_the_runs_16_bit_format(dp_mode, note, capsys):
    """An fp16 run's notes speak of fp16 copies and compute, never of bf16 (issue 35)."""
    assert main(["estimate", "--model", "tiny", "--vocab-size", "65", "--precision", "fp16", "--world-size", "2",
                 "--dp-mode", dp_mode]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if "note:" in x]
    assert any(note in x for x in notes) and any("activations: " in x and "fp16" in x for x in notes)
    assert not any("bf16" in x for x in notes), notes


@pytest.mark.parametrize("argv, match", [
    (["--gpu", "H1000"], "unknown GPU 'H1000'"),
    (["--gpu-memory", "lots"], "cannot read memory size 'lots'"),
    (["--tp", "3", "--world-size", "3"], "n_heads=32 is not divisible by parallel.tp=3"),
    (["--world-size", "6", "--tp", "4"], "does not divide the world size 6"),
    (["--dp-shard", "3", "--world-size", "8"], "but the world size is 8"),
    (["--pp", "64", "--world-size", "64"], "64 pipeline stages, but the model has only 32 blocks"),
    (["--ep", "2", "--world-size", "2"], "needs a mixture-of-experts model"),
    (["--model", "llama9"], "unknown model preset 'llama9'"),
    (["--checkpointing", "some"], "--checkpointing 'some' is not one of"),
    (["--seq-len", "100000"], "longer than the model's max_seq_len"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_bad_inputs_are_one_line(argv, match, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1, err


def test_memory_strings_and_gpu_names():
    assert parse_memory("24GiB") == 24 * 2**30 and parse_memory("80GB") == 80 * 10**9
    assert parse_memory("24576MiB") == 24 * 2**30 and parse_memory("80G") == 80 * 2**30
    for bad in ("24", "GiB", "-1GB", "1.2.3GB", "24 parsecs"):
        with pytest.raises(UserError):
            parse_memory(bad)
    assert gpu_memory("h100")[0] == "H100-SXM" and gpu_memory("a100_40gb")[0] == "A100-40GB"
    assert gpu_memory("H200")[1] > gpu_memory("H100")[1] > gpu_memory("A100-40GB")[1] > gpu_memory("RTX4090")[1]


def test_estimate_for_run_and_device_peak(char_data, tmp_path):
    from conftest import fast_config

    from paratrain.estimate import estimate_for_run
    from paratrain.observe.sysmetrics import device_peak_bytes
    from paratrain.spec import resolve_run

    plan = resolve_run(fast_config(char_data, tmp_path, "est", "training.precision=bf16"), 1)
    est = estimate_for_run(plan, device="cpu")
    assert est.overhead_bytes == 0 and est.total_bytes == est.peak_bytes > 0
    assert "activations" in est.format_table() and est.inputs.recipe.optimizer_impl == "fused"
    assert device_peak_bytes("cpu") > 0
    assert "measured" in est.compare_line(est.peak_bytes)


def test_cli_reads_a_run_config_as_the_trainer_does(char_data, tmp_path, capsys):
    """A run's config.toml: [parallel], [training] and [activation_checkpoint] as the trainer resolves them (the same
    estimate as estimate_for_run of the resolved run), the vocabulary from its prepared data; flags win."""
    from conftest import fast_config

    from paratrain.config import dump_toml
    from paratrain.estimate import estimate_for_run, target_device
    from paratrain.spec import resolve_run

    cfg = fast_config(char_data, tmp_path, "est", "parallel.dp_shard=2", "parallel.cp=2", "training.precision=bf16",
                      "training.global_batch=8", "training.micro_batch=2", "activation_checkpoint.mode=selective")
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    # (estimated where the config trains: fast_config's training.device=cpu, estimate.target_device)
    trainer = estimate_for_run(resolve_run(cfg, 4), device=target_device(cfg.training), gpu_bytes=24 * 2**30)
    assert main(["estimate", "--model", str(path), "--gpu-memory", "24GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["world_size"] == 4 and data["layout"]["cp"] == 2 and data["accum_steps"] == 2
    assert data["checkpointing"] == "selective" and data["precision"] == "bf16" and data["micro_batch"] == 2
    assert data["total_bytes"] == trainer.total_bytes
    assert main(["estimate", "--model", str(path), "--cp", "1", "--dp-shard", "4", "--accum-steps", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["cp"] == 1 and data["layout"]["dp_shard"] == 4 and data["accum_steps"] == 1


def test_estimator_and_planner_read_parameters_by_role_not_by_name():
    """A model family's parameter names are its own (hf/names.py maps them): the estimator and the planner find a
    block's parameters through the family's table (roles, sublayer kinds), never by a name like `...w2.weight`, and
    build a model through the registry (`build_model`), never one family's module."""
    import ast
    import re
    from pathlib import Path

    named = re.compile(r"(\.(weight|bias)$)|feed_forward\.|attention\.w|experts\.w")
    root = Path(__file__).resolve().parents[1] / "paratrain"
    found = [f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}"
             for folder in ("estimate", "planner") for path in sorted((root / folder).glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and named.search(node.value)
             or isinstance(node, ast.ImportFrom) and node.module == "paratrain.models.llama"]
    assert not found, "parameter names or a family's module in the estimator or planner:\n" + "\n".join(found)
