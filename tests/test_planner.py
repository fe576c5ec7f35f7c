"""`paratrain plan`: cost-model formulas, enumeration constraints, outputs that load, one-line errors, --explain."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.config import load_config
from paratrain.errors import UserError
from paratrain.layout import CONFIG_KEYS, Layout
from paratrain.estimate.planner import PlanRequest, plan_context
from paratrain.estimate.step_time import (all_gather_time, all_reduce_time, bubble_fraction, predict,
                                          step_lower_bound)
from paratrain.calibration import fit_alpha_beta
from paratrain.estimate.hardware import gpu_profile, resolve_hardware
from paratrain.estimate.profile import Hardware, Link
from paratrain.estimate.search import Result, candidates, fastest_first, structural_reason, tier_variants


def test_collective_formulas():
    link = Link("x", bandwidth=100e9, latency=5e-6)
    n = 1e9
    assert all_reduce_time(n, 1, link) == 0.0
    assert all_reduce_time(n, 4, link) == pytest.approx(2 * 3 * 5e-6 + 2 * 3 / 4 * n / 100e9)
    assert all_gather_time(n, 8, link) == pytest.approx(7 * 5e-6 + 7 / 8 * n / 100e9)
    assert link.p2p_time(n) == pytest.approx(5e-6 + n / 100e9)
    # all-reduce = reduce-scatter + all-gather
    assert all_reduce_time(n, 8, link) == pytest.approx(2 * all_gather_time(n, 8, link))


def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(4, 12, 2) == pytest.approx(3 / 15 / 2)


def test_alpha_beta_fit_recovers_line():
    alpha, bw = 50e-6, 2e9
    pts = [(n, 6 * alpha + 1.5 * n / bw) for n in (2**12, 2**16, 2**20, 2**24)]
    a, b = fit_alpha_beta(pts, steps=6, volume=1.5)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_gpu_table_and_links():
    for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "L40S", "RTX4090", "RTX3090"):
        hw = gpu_profile(name)
        assert hw.memory_bytes > 20 * 2**30 and hw.peak_flops > 50e12
    assert gpu_profile("H100").peak_flops == 989e12
    assert gpu_profile("A100", intra="nvlink").intra.bandwidth < gpu_profile("H100", intra="nvlink").intra.bandwidth
    assert gpu_profile("H100", inter="eth25").inter.bandwidth < gpu_profile("H100").inter.bandwidth


def test_profile_saved_and_loaded_by_name(tmp_path):
    hw = gpu_profile("L40S")
    hw.name = "mybox"
    (tmp_path / "mybox.json").write_text(json.dumps(hw.to_json()))
    back = resolve_hardware("mybox", profile_dir=tmp_path)
    assert isinstance(back, Hardware) and back.peak_flops == hw.peak_flops and back.intra == hw.intra
    assert back.gemm_rate(1e12) == pytest.approx(hw.gemm_rate(1e12))


def test_enumeration_respects_constraints():
    ctx, world, opts = plan_context(PlanRequest("llama3-8b", gpus=16, gpus_per_node=8, gpu="H100", seq=4096,
                                                global_batch_tokens=4096 * 64))
    cands = candidates(ctx, world, opts)
    assert cands
    assert {c.tp for c in cands} <= {1, 2, 4, 8}  # within a node
    for c in cands:
        assert c.dp * c.cp * c.tp * c.pp == world
        assert ctx.global_seqs % (c.dp * c.micro_batch) == 0
        if c.layout.uses_ddp:
            assert c.tp == 1 and c.pp == 1
        if structural_reason(c, ctx) is None:
            assert 32 % c.tp == 0 and 8 % c.tp == 0  # heads and kv heads divisible
    big = ctx.candidate(Layout.resolve(world, tp=16), micro_batch=1)
    assert "crosses nodes" in structural_reason(big, ctx)
    odd = ctx.candidate(Layout.resolve(world, dp_shard=16), micro_batch=3)
    assert "does not divide" in structural_reason(odd, ctx)


def test_prediction_is_sane():
    ctx = plan_context(PlanRequest("llama3-8b", gpus=8, gpu="H100", seq=8192, global_batch_tokens=8192 * 64)).ctx
    base = ctx.candidate(Layout.resolve(8, dp_shard=8), checkpointing="none", micro_batch=1)  # 8 accumulation steps
    p = predict(base, ctx)
    assert 0.2 < p.mfu < 0.8
    assert p.step_s == pytest.approx(p.compute_s + p.comm_exposed_s + p.bubble_s + p.recompute_s + p.optimizer_s)
    full = predict(ctx.candidate(Layout.resolve(8, dp_shard=8), checkpointing="full", micro_batch=1), ctx)
    assert full.recompute_s > 0.2 * p.compute_s and full.step_s > p.step_s
    piped = predict(ctx.candidate(Layout.resolve(8, dp_shard=4, pp=2, pp_schedule="1f1b", pp_microbatches=16)), ctx)
    assert piped.bubble_s > 0


def test_plan_writes_config_that_loads(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "H100",
                 "--seq", "8192", "--global-batch-tokens", "1048576", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU" in text and "torchrun" in text
    cfg = load_config(out / "config.toml")
    assert cfg.model.preset == "llama3-8b" and cfg.training.seq_len == 8192 and cfg.training.global_batch == 128
    assert cfg.training.precision == "bf16"


def test_multi_node_plan_writes_sbatch(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "A100-80GB",
                 "--inter", "ib200", "--seq", "4096", "--global-batch-tokens", str(4096 * 128), "--out", str(out),
                 "--checkpointing", "selective,full", "--micro-batches", "1,2"]) == 0
    script = (out / "plan.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "--nnodes 2" in script and "paratrain train --config" in script
    import re

    assert re.search(r"^#SBATCH --job-name=paratrain-[A-Za-z0-9._-]+$", script, re.M), script
    load_config(out / "config.toml")


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "H900", "--gpus", "8"], "unknown GPU"),
    (["--gpu", "H100", "--gpus", "12", "--gpus-per-node", "8"], "not divisible by --gpus-per-node"),
    (["--gpu", "RTX3090", "--gpus", "1", "--model", "llama3-8b", "--seq", "4096", "--global-batch-tokens", "65536"],
     "nearest miss"),
    (["--gpu", "H100", "--gpus", "8", "--seq", "1000", "--global-batch-tokens", "1500"], "not a multiple"),
])
def test_bad_inputs_one_line(argv, words, capsys, tmp_path):
    assert main(["plan", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and words in err and "\n" not in err


def test_explain_rejected_and_ranked():
    planning = plan_context(PlanRequest("llama3-8b", gpus=16, gpus_per_node=8, gpu="H100", seq=4096,
                                        global_batch_tokens=4096 * 64, checkpointing=("none", "full"),
                                        micro_batches=(1, 2)))
    assert "crosses nodes" in planning.explain("fsdp,tp=16")
    text = planning.explain("ddp,ac=none,mb=2")
    assert "rejected: does not fit" in text and "largest" in text
    ranked = planning.explain("fsdp,tp=2,ac=full,mb=1")
    assert "fits" in ranked and ("against the best" in ranked or "planner's choice" in ranked)
    with pytest.raises(UserError):
        planning.explain("fsdp,xx=3")


def test_calibrate_saves_a_profile_plans_can_use(tmp_path, capsys):
    from paratrain.calibration import calibrate

    from paratrain.models import preset_args

    # with a model: also at its shapes (its GEMMs, its attention, one of its blocks timed eagerly)
    hw, path = calibrate("cpu-test", 2, tmp_path, seconds=0.02, model=preset_args("tiny", vocab_size=128), seq=32,
                         micro_batches=(1,))
    assert path == tmp_path / "cpu-test.json" and path.is_file()
    assert hw.device == "cpu" and hw.intra.bandwidth > 0 and hw.compute_scale >= 1.0
    assert all(rate > 0 for _, rate in hw.gemm)
    assert hw.attention and hw.modes["eager"] > 0 and any(k.startswith("block eager") for k in hw.shapes)
    assert not hw.fp8_gemm  # no FP8 tensor cores on a CPU
    back = resolve_hardware("cpu-test", profile_dir=tmp_path)
    assert back.gemm == hw.gemm and back.compute_scale == hw.compute_scale
    assert back.attention == hw.attention and back.modes == hw.modes
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "cpu-test",
                 "--profile-dir", str(tmp_path), "--seq", "32", "--global-batch-tokens", "256",
                 "--out", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert "paratrain train --nproc 2" in out
    cfg = load_config(tmp_path / "plan" / "config.toml")
    assert cfg.training.device == "cpu" and cfg.training.precision == "fp32"


# -- one layout, one answer: plan -> estimate -----------------------------------------------------------------------
PLAN_8B = ["--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "H100", "--seq", "8192",
           "--global-batch-tokens", "1048576"]
REQUEST_8B = PlanRequest("llama3-8b", gpus=8, gpus_per_node=8, gpu="H100", seq=8192, global_batch_tokens=1048576)
PLAN_70B = ["--model", "llama3-70b", "--gpus", "64", "--gpu", "H100", "--intra", "nvlink", "--inter", "ib400",
            "--seq", "8192", "--global-batch-tokens", "4194304"]
PLAN_HSDP = ["--model", "llama3-8b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "A100-80GB", "--seq", "4096",
             "--global-batch-tokens", str(4096 * 64), "--dp-modes", "hsdp", "--max-cp", "1", "--max-tp", "1"]


def _plan_json(capsys, out, argv):
    assert main(["plan", *argv, "--out", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]


@pytest.mark.parametrize("argv, gpu, expect", [
    (PLAN_8B, "H100", {"cp": 2, "pp": 1, "tp": 1}),
    (PLAN_70B, "H100", {"cp": 2, "pp": 4, "tp": 4}),
    (PLAN_HSDP, "A100-80GB", {"dp_mode": "hsdp", "cp": 1}),
], ids=["8b-8xh100-cp2", "70b-64xh100-pp4-tp4", "8b-16xa100-hsdp"])
def test_estimate_of_the_plans_config_matches_the_plan(argv, gpu, expect, tmp_path, capsys):
    """`paratrain plan` then `paratrain estimate --model plan/config.toml`: the same layout, the same memory per rank."""
    best = _plan_json(capsys, tmp_path / "plan", argv)
    assert {k: best[k] for k in expect} == expect
    assert main(["estimate", "--model", str(tmp_path / "plan" / "config.toml"), "--gpu", gpu, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    lay = est["layout"]
    for key in ("dp_mode", "dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"):
        assert lay[key] == best[key], key
    assert lay["world_size"] == int(argv[argv.index("--gpus") + 1])
    assert est["checkpointing"] == best["activation_checkpoint"] and est["fits"] is True
    assert abs(est["total_bytes"] - best["memory_bytes_per_rank"]) <= 0.01 * best["memory_bytes_per_rank"]
    if best["pp"] > 1:
        return  # (the table of a 256-micro-batch pipeline: walked again, a few seconds)
    assert main(["estimate", "--model", str(tmp_path / "plan" / "config.toml"), "--gpu", gpu]) == 0
    text = capsys.readouterr().out
    assert "=> FITS:" in text and "limit 90%" in text and "single process" not in text


def test_estimate_flags_win_over_the_config(tmp_path, capsys):
    best = _plan_json(capsys, tmp_path / "plan", PLAN_8B)
    assert best["cp"] == 2
    config = str(tmp_path / "plan" / "config.toml")
    assert main(["estimate", "--model", config, "--gpu", "H100", "--cp", "1", "--dp-shard", "8", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["layout"]["cp"] == 1 and est["layout"]["dp_shard"] == 8 and est["layout"]["world_size"] == 8
    assert est["total_bytes"] > best["memory_bytes_per_rank"]  # each rank holds the whole sequence's activations
    # --cp on a preset is the same layout as the plan's config
    assert main(["estimate", "--model", "llama3-8b", "--gpu", "H100", "--dp-mode", "zero2", "--dp-shard", "4", "--cp",
                 "2", "--seq-len", "8192", "--global-batch", "128", "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert flags["layout"]["cp"] == 2 and flags["total_bytes"] == best["memory_bytes_per_rank"]


# Plans whose best layouts set every layout field (through the pinned [parallel] values, the layout flags, which fix
# them): zero2 x cp x tp x an interleaved pipeline with 3 stages per rank and fixed micro-batches; hsdp with sign_ef;
# experts; ddp with PowerSGD.
SMALL = dict(gpus_per_node=8, gpu="H100", seq=4096, global_batch_tokens=4096 * 64)
TINY = dict(gpu="H100", seq=256, global_batch_tokens=256 * 16)
PINNED = {
    "zero2-cp2-tp2-pp2-v3": PlanRequest("llama3-8b", gpus=16, **SMALL, checkpointing=["every_k"], parallel=dict(
        dp_mode="zero2", cp=2, tp=2, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=3, pp_microbatches=8)),
    "hsdp-sign_ef": PlanRequest("llama3-8b", gpus=16, **SMALL, checkpointing=["full"], parallel=dict(
        dp_mode="hsdp", dp_replicate=2, grad_compression="sign_ef", sign_ef_block=64)),
    "fsdp-ep4": PlanRequest("tiny-moe", gpus=8, **TINY, parallel=dict(dp_mode="fsdp", ep=4, dp_shard=8)),
    "ddp-powersgd": PlanRequest("tiny", gpus=4, **TINY, checkpointing=["selective"], parallel=dict(
        dp_mode="ddp", grad_compression="powersgd", powersgd_rank=2)),
}


@pytest.mark.parametrize("req", PINNED.values(), ids=PINNED.keys())
def test_plan_and_estimate_of_its_config_agree_on_every_layout_field(req, tmp_path, capsys):
    """The pinned values fix what the plan chooses; `paratrain estimate --model plan/config.toml` reads back every
    field of the planned layout (degrees, dp mode, sequence parallelism, schedule, stages per rank, micro-batches,
    blocks per stage), its checkpointing, micro-batch, precision and gradient compression, and the same memory."""
    import dataclasses

    from paratrain.layout import Batch
    from paratrain.commands.plan import write_outputs

    ctx, world, _ = planning = plan_context(req)
    best = planning.plan(top=1).ranked[0]
    lay = best.cand.layout.validate(ctx.args, world, Batch(ctx.global_seqs, best.cand.micro_batch, ctx.seq_len))
    field_of = {key: field for field, key in CONFIG_KEYS.items()}
    for key, value in req.parallel.items():
        if key in field_of:
            assert getattr(lay, field_of[key]) == value, key
    assert ctx.compression.method == req.parallel.get("grad_compression", "none")
    config, _, _ = write_outputs(best, ctx, world, tmp_path / "plan", None, req.model)
    vocab = ["--vocab-size", "128"] if req.model.startswith("tiny") else []  # (tiny presets: the plan's vocab_size)
    assert main(["estimate", "--model", str(config), *vocab, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert {k: est["layout"][k] for k in dataclasses.asdict(lay)} == json.loads(json.dumps(dataclasses.asdict(lay)))
    assert est["layout"]["world_size"] == world
    assert (est["checkpointing"], est["every_k"], est["micro_batch"]) == (best.cand.ac, best.cand.every_k,
                                                                        best.cand.micro_batch)
    assert est["precision"] == ctx.precision and est["compression"] == ctx.compression.wire_settings()
    assert abs(est["total_bytes"] - best.total_bytes) <= 0.01 * best.total_bytes


def test_plan_layout_flags_one_line_errors(capsys):
    for argv, words in ((["--dp-mode", "fsdp", "--dp-modes", "ddp"], "give --dp-mode or --dp-modes, not both"),
                        (["--pp-schedule", "zbw"], "--pp-schedule 'zbw' is not one of"),
                        (["--tp", "0"], "--tp must be >= 1, got 0"),
                        (["--tp", "3"], "no layout of 8 GPUs"),
                        (["--pp-split", "4,4"], "unrecognized arguments: --pp-split"),
                        (["--explain", "fsdp,tp=2,sp=off"], "no sp=off or lp=off")):
        assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--no-write", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, words", [
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--cp", "3", "--world-size", "8"], "does not divide the world size 8"),
    (["--cp", "2", "--world-size", "2", "--seq-len", "1001"], "not divisible by 2 x parallel.cp"),
    (["--headroom", "1.5"], "--headroom must be in [0, 1)"),
])
def test_estimate_layout_flags_bad_input_one_line(argv, words, capsys):
    assert main(["estimate", "--model", "llama3-8b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("parallel, words", [
    ('dp_mode = "zero9"', "parallel.dp_mode"),
    ("cp = 0", "parallel.cp must be >= 1"),
    ('cp = "two"', "parallel.cp"),
    ("tp = 3\ndp_shard = 1", "not divisible by parallel.tp=3"),
])
def test_estimate_config_with_a_bad_parallel_section_one_line(parallel, words, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(f'[model]\npreset = "llama3-8b"\n\n[parallel]\n{parallel}\n')
    assert main(["estimate", "--model", str(path), "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_one_headroom_rule_for_estimate_and_plan(capsys):
    """A layout at 95% of the GPU's memory does not fit in either; at 85% it fits in both (limit 90%)."""
    import dataclasses

    from paratrain.estimate.gpus import HEADROOM, fits
    from paratrain.estimate.search import evaluate, parse_layout

    ctx, world, opts = plan_context(REQUEST_8B)
    assert opts.headroom == HEADROOM == 0.10
    c = parse_layout("zero2,cp=2,ac=none,mb=1", ctx, world)
    total = evaluate(c, ctx, opts.headroom).total_bytes
    est_argv = ["estimate", "--model", "llama3-8b", "--dp-mode", "zero2", "--dp-shard", "4", "--cp", "2",
                "--seq-len", "8192", "--global-batch", "128", "--no-suggest"]
    for fraction, ok in ((0.95, False), (0.85, True)):
        gpu = int(total / fraction)
        assert fits(total, gpu) is ok
        small = dataclasses.replace(ctx, hw=dataclasses.replace(ctx.hw, memory_bytes=gpu))
        r = evaluate(c, small, opts.headroom)
        assert r.total_bytes == total and (r.reason is None) is ok, r.reason
        if not ok:
            assert "(95%, limit 90%" in r.reason and "NCCL buffers" in r.reason
        assert main([*est_argv, "--gpu-memory", f"{gpu}B", "--json"]) == 0
        est = json.loads(capsys.readouterr().out)
        assert est["total_bytes"] == total and est["fits"] is ok and est["usable_bytes"] == int(gpu * 0.9)
        assert main([*est_argv, "--gpu-memory", f"{gpu}B"]) == 0
        text = capsys.readouterr().out
        assert ("=> FITS:" if ok else "=> DOES NOT FIT:") in text and "limit 90%" in text


def test_slurm_job_names_are_short_and_valid():
    import re

    from paratrain.commands.plan import job_name

    cases = {
        Layout.resolve(64, dp_mode="zero2", tp=4, pp=4, cp=2, pp_microbatches=256): "paratrain-pp4-zero2x2-cp2-tp4",
        Layout.resolve(16, dp_mode="hsdp", dp_replicate=2): "paratrain-hsdp2x8",
        Layout.resolve(16, dp_mode="ddp"): "paratrain-ddpx16",
        Layout.resolve(1): "paratrain-1rank",
        Layout.resolve(64, dp_mode="fsdp", ep=8, tp=8): "paratrain-fsdpx8-tp8-ep8",
    }
    for layout, name in cases.items():
        assert job_name(layout) == name and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name)


def test_balanced_split_is_the_min_max_partition_cut():
    """balanced_split's bisection makes the cut of the plain dynamic programme (min_max_partition), ties included."""
    from paratrain.stage_split import balanced_split, min_max_partition
    from paratrain.models import preset_args
    from paratrain.models.presets import block_param_count

    for name in ("llama3-405b", "llama3-8b", "tiny", "tiny-moe", "deepseek-moe-16b"):
        a = preset_args(name, vocab_size=128)
        cost = [block_param_count(a, i, active=True) for i in range(a.n_layers)]  # a token's compute
        cost[0] += a.vocab_size * a.dim
        cost[-1] += a.vocab_size * a.dim + a.dim
        prefix = [0]
        for c in cost:
            prefix.append(prefix[-1] + c)
        for k in sorted({1, 2, 3, 4, 7, 8, 16, 31, 32, a.n_layers // 2, a.n_layers - 1, a.n_layers} - {0}):
            if k <= a.n_layers:
                assert balanced_split(a, k) == min_max_partition(a.n_layers, k, lambda s, j, i: prefix[i] - prefix[j])


def test_predictions_follow_a_changed_context_sharing_its_cache():
    """dataclasses.replace(ctx, ...) shares ctx.cache: the cached per-shape terms are keyed by what they read."""
    import dataclasses

    from paratrain.estimate.step_time import Context

    ctx, world, opts = plan_context(PlanRequest("llama3-8b", gpus=16, gpu="H100", seq=4096))
    cands = [c for c in candidates(ctx, world, opts) if structural_reason(c, ctx) is None][::37]
    for c in cands:
        predict(c, ctx)
    for changes in ({"run": ctx.run.replace(compile=True)}, {"hw": gpu_profile("A100")},
                    {"run": ctx.run.replace(seq_len=2048), "global_seqs": 256}):
        other = dataclasses.replace(ctx, **changes)
        fresh = Context(**{**{f.name: getattr(other, f.name) for f in dataclasses.fields(Context)}, "cache": {}})
        for c in cands:
            if structural_reason(c, fresh) is None:
                assert predict(c, other) == predict(c, fresh), (changes, c.name)


@pytest.mark.parametrize("req", [
    PlanRequest("llama3-8b", gpus=16, gpu="H100", seq=8192, global_batch_tokens=8192 * 64,  # tp, pp, cp, hsdp
                micro_batches=(1, 4)),
    PlanRequest("deepseek-moe-16b", gpus=16, gpu="A100", seq=4096, global_batch_tokens=4096 * 32,  # ep
                micro_batches=(1, 2)),
    PlanRequest("llama3-8b", gpus=8, gpu="H100", seq=4096, global_batch_tokens=4096 * 64, optimizer="onebit_adam"),
], ids=["dense", "moe", "phases"])
def test_fastest_first_ranks_as_predicting_every_layout(req):
    """The planner predicts layouts lazily, in the order of their step-time floor (search.fastest_first): it yields
    them in exactly the order of predicting every one and sorting (stably) by step time, and no floor is above its
    layout's prediction, bit for bit (the memory tiers' variants included)."""
    ctx, world, opts = plan_context(req)
    cands = [c for c in candidates(ctx, world, opts) if structural_reason(c, ctx) is None]
    cands += [v for c in cands[::7] for v in tier_variants(c, ctx) if structural_reason(v, ctx) is None]
    exhaustive = sorted((Result(c, pred=predict(c, ctx)) for c in cands), key=lambda r: r.pred.step_s)
    assert all(step_lower_bound(r.cand, ctx) <= r.pred.step_s for r in exhaustive)
    lazy = [Result(c) for c in cands]
    assert [id(r.cand) for r in fastest_first(lazy, ctx)] == [id(r.cand) for r in exhaustive]


def test_layout_with_schedule_is_replace():
    """The planner's `Layout.with_schedule` (no degrees resolved again) gives what `Layout.replace` gives: the same
    layout or the same one-line error, for every schedule and stages per rank."""
    from paratrain.errors import ConfigError
    from paratrain.modes import Schedule

    def outcome(make):
        try:
            return make()
        except ConfigError as e:
            return str(e)

    for pp, mode, rep in ((1, "fsdp", 1), (2, "zero2", 1), (4, "hsdp", 2), (2, "fsdp", 1)):
        base = Layout.resolve(16, dp_mode=mode, dp_replicate=rep, pp=pp)
        for split in ((None,) if pp == 1 else (None, (1,) * pp * 2)):
            lay = base.with_checked(pp_split=split)
            for schedule in Schedule:
                for v in (1, 2, 3):
                    assert outcome(lambda: lay.with_schedule(schedule, v, 1)) == outcome(
                        lambda: lay.replace(pp_schedule=schedule, pp_microbatches=1, pp_virtual=v))
