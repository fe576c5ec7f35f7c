"""The optimizer registry (paratrain/optimizers.py): names, one-line refusals, what the estimator and the planner read
from an entry, SGD on the layouts, and checkpoints that name their optimizer."""

from __future__ import annotations

import math

import pytest

from conftest import fast_config
from paratrain.api import train_rank
from paratrain.errors import ConfigError, UserError
from paratrain.capabilities import OPTIMIZER_NAMES, OPTIMIZERS, optimizer_entry


def test_registry_names_are_the_choices_everywhere(capsys):
    from paratrain import cli
    from paratrain.config import config_keys_help, load_config

    assert OPTIMIZER_NAMES[0] == "adamw" and load_config(None, []).optimizer.name == "adamw"
    with pytest.raises(ConfigError, match=r"^optimizer.name: 'lamb' is not one of adamw, sgd") as e:
        load_config(None, ["optimizer.name=lamb"])
    assert "\n" not in str(e.value)
    assert "--optimizer.name='adamw'   (" + " | ".join(OPTIMIZER_NAMES) + ")" in config_keys_help()
    assert cli.main(["estimate", "--model", "llama3-8b", "--optimizer", "adam"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --optimizer 'adam' is not one of {', '.join(OPTIMIZER_NAMES)}")
    from paratrain.training.optim import BUILDERS

    for entry in OPTIMIZERS.values():  # every entry has a builder
        assert callable(BUILDERS[entry.name]) and entry.state_bytes == entry.element_bytes * len(entry.param_state)


def test_estimator_and_planner_read_the_entry():
    from paratrain.estimate.model_states import model_params, state_bytes
    from paratrain.layout import Layout
    from paratrain.models.args import ModelArgs
    from paratrain.models.presets import count_params
    from paratrain.commands.plan import config_for
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import predict

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=64)
    n, tensors = count_params(args), len(model_params(args))
    lay = Layout.resolve(1)
    assert state_bytes(args, lay, "fp32", "adamw", "paratrain").optimizer == 8 * n + 4 * tensors  # moments + steps
    assert state_bytes(args, lay, "fp32", "sgd", "paratrain").optimizer == 4 * n  # one momentum buffer
    plans = {}
    for name in ("adamw", "sgd"):
        ctx = plan_context(PlanRequest("llama3-8b", gpus=8, optimizer=name)).ctx
        cand = ctx.candidate(Layout.resolve(8, dp_mode="fsdp"), micro_batch=1)
        plans[name] = predict(cand, ctx).optimizer_s
        assert config_for(cand, ctx).optimizer.name == name  # the written config runs the planned optimizer
    sgd, adamw = optimizer_entry("sgd"), optimizer_entry("adamw")
    assert plans["sgd"] < plans["adamw"] and (sgd.step_bytes, adamw.step_bytes) == (24, 32)


def test_sgd_on_zero1_and_fsdp_matches_one_process(char_data):
    """SGD with momentum through ZeroRedundancyOptimizer and on FSDP2's DTensor parameters: the verify rows against
    one process (the same checks as AdamW's matrix)."""
    from paratrain.verify import run_verify

    rows, _ = run_verify(["zero1x2", "fsdp2"], steps=5, tolerance=1e-5, share_launches=True, echo=lambda line: None,
                         extra_args=[f"data.dir={char_data}", "optimizer.name=sgd", "optimizer.lr=0.3"])
    assert [r.layout for r in rows] == ["zero1x2", "fsdp2"]
    assert all(r.passed for r in rows), [(r.layout, r.max_loss_diff, r.max_weight_diff, r.note) for r in rows]
    assert rows[0].losses[-1] < rows[0].losses[0]


def test_resume_needs_the_same_optimizer(char_data, tmp_path):
    """SGD resumes bit for bit (its momentum in the checkpoint); resuming it as AdamW is one line, before any load."""
    common = ["training.steps=6", "checkpoint.every=3", "optimizer.name=sgd", "optimizer.lr=0.3"]
    straight = train_rank(fast_config(char_data, tmp_path, "sgd", *common))
    step3 = tmp_path / "sgd" / "checkpoints" / "step-3"
    resumed = train_rank(fast_config(char_data, tmp_path, "sgd-resumed", *common, f"checkpoint.resume={step3}"))
    assert resumed.losses == straight.losses[3:] and resumed.val_loss == straight.val_loss
    with pytest.raises(UserError) as e:
        train_rank(fast_config(char_data, tmp_path, "as-adamw", *common[:2], f"checkpoint.resume={step3}"))
    assert str(e.value) == (f"cannot resume from {step3}: it holds the state of optimizer.name=sgd (this run: adamw); "
                            "resume with optimizer.name=sgd, or give this run another run.name")


def _records(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"loss"' in line]


def _runs(*cfgs):
    """Every config trained one after the other by the same launched ranks (one process group); rank 0's results."""
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def test_exact_resume_on_two_ranks(char_data, tmp_path):
    """10 + resume + 10 steps give the losses of 20 straight steps, bit for bit, on 2 gloo ranks (one launch): SGD
    through ZeRO-1 (3 + 3 steps) (each rank loads its partition's momentum from the name-keyed checkpoint); 1-bit Adam resumed in
    its compressed phase (the frozen variance, the step counts and both residuals in the checkpoint); 0/1 Adam
    resumed inside a window of local steps (each rank's own momentum, accumulator and parameters, saved per rank).
    The bytes follow each schedule."""
    from paratrain.distributed.launch import launch

    def pair(name, *extra, steps=20):
        common = [f"training.steps={steps}", "training.global_batch=8", "training.eval_every=0",
                  "optimizer.warmup_steps=2", "resilience.collective_timeout_s=60", *extra]
        resume = f"checkpoint.resume={tmp_path / name / 'checkpoints' / f'step-{steps // 2}'}"
        return (fast_config(char_data, tmp_path, name, *common, f"checkpoint.every={steps // 2}"),
                fast_config(char_data, tmp_path, f"{name}-resumed", *common, resume))

    cfgs = (*pair("sgd-zero1", "parallel.dp_mode=zero1", "optimizer.name=sgd", "optimizer.lr=0.3", steps=6),
            *pair("onebit", "parallel.dp_mode=ddp", "optimizer.name=onebit_adam", "optimizer.freeze_step=4"),
            # T_v = {1, 2, 4} up to the freeze (3 and 5: 1-bit gradients); then syncs at 6, 7, 8, 12, 16, 20
            *pair("zero-one", "parallel.dp_mode=ddp", "optimizer.name=zero_one_adam", "optimizer.freeze_step=5",
                  "optimizer.var_update_scaler=2", "optimizer.local_step_scaler=2", "optimizer.local_step_clipper=4"))
    results = launch(_runs, cfgs, 2)
    for straight, resumed in zip(results[::2], results[1::2]):
        half = len(straight.losses) // 2
        assert resumed.losses == straight.losses[half:] and resumed.val_loss == straight.val_loss  # ==: bitwise
    ratios = {name: [round(r["compression_ratio"], 2) for r in _records(tmp_path / name)]
              for name in ("onebit", "zero-one")}
    assert ratios["onebit"] == [1.0] * 4 + [0.03] * 16
    assert ratios["zero-one"] == [1.0, 1.0, 0.03, 1.0, 0.03] + [0.03] * 3 + [0.0, 0.0, 0.0, 0.03] * 3


@pytest.mark.parametrize("world, overrides, message", [
    (1, ["optimizer.name=onebit_adam"], "has no data parallelism; use it with dp_mode=ddp (or hsdp)"),
    (2, ["optimizer.name=zero_one_adam", "parallel.dp_mode=zero1"], "dp_mode=zero1 keeps a parameter's optimizer"),
    (2, ["optimizer.name=onebit_adam", "parallel.dp_mode=fsdp"], "dp_mode=fsdp shards every momentum"),
    (4, ["optimizer.name=onebit_adam", "parallel.dp_mode=zero2"], "use dp_mode=ddp, or hsdp with dp_replicate > 1"),
    (8, ["optimizer.name=onebit_adam", "parallel.dp_mode=hsdp", "parallel.dp_replicate=2", "parallel.tp=2"],
     "supports no tp, pp, ep or cp"),
])
def test_onebit_refused_where_it_cannot_apply(char_data, tmp_path, world, overrides, message):
    from conftest import assert_plan_rejected

    assert_plan_rejected(char_data, tmp_path, world, overrides, message, micro_batch=1)


def test_onebit_settings_refused():
    from paratrain.config import load_config

    with pytest.raises(ConfigError, match="compresses its own communication .*: parallel.grad_compression must be none"):
        load_config(None, ["optimizer.name=onebit_adam", "parallel.grad_compression=sign_ef"])
    with pytest.raises(ConfigError, match="needs a warm-up of plain Adam steps"):
        load_config(None, ["optimizer.name=zero_one_adam", "optimizer.warmup_steps=0"])


def test_momentum_schedules():
    """The published policies, step by step (1-based s in the papers; 0-based steps here)."""
    from paratrain.capabilities.onebit import MomentumSchedule
    from paratrain.optimizers import GradientReduction

    onebit = MomentumSchedule(zero_one=False, freeze=3)
    assert [onebit.gradient(t) for t in range(5)] == [GradientReduction.MEAN] * 3 + [GradientReduction.LOCAL] * 2
    assert [onebit.sync(t) for t in range(5)] == [False] * 3 + [True] * 2
    # 0/1 Adam: T_v is 16 steps at interval 1, then 16 at interval 2, 16 at 4, ...: 1..16, 18..48, 52..112, 120..
    zo = MomentumSchedule(zero_one=True, freeze=200, var_update_scaler=16, local_step_scaler=32678)
    variance = [t + 1 for t in range(200) if zo.variance_step(t)]
    assert variance == [*range(1, 17), *range(18, 49, 2), *range(52, 113, 4), *range(120, 201, 8)]
    assert {zo.gradient(t) for t in range(200) if not zo.variance_step(t)} == {GradientReduction.ONE_BIT}
    # after the freeze: local steps whose interval doubles every local_step_scaler steps, up to the clipper
    zo = MomentumSchedule(zero_one=True, freeze=10, local_step_scaler=4, local_step_clipper=4)
    syncs = [t + 1 for t in range(10, 40) if zo.sync(t)]
    assert syncs == [11, 12, 13, 14, 16, 18, 20, 24, 28, 32, 36, 40]
    assert zo.resets_residuals(10) and not zo.resets_residuals(11) and zo.gradient(10) is GradientReduction.LOCAL


def test_onebit_default_warm_up_is_a_share_of_the_run():
    """freeze_step 0: 1-bit Adam warms up for 6.5% of training.steps (130 of 2000 met the goal, the lr warm-up's 100
    did not; bench/RESULTS.md), 0/1 Adam until the lr warm-up's end; a set freeze_step wins."""
    from types import SimpleNamespace

    import torch

    from paratrain.config import ParallelConfig, load_config
    from paratrain.distributed.compression import GradComm
    from paratrain.layout import Layout
    from paratrain.capabilities import gradient_reduction
    from paratrain.capabilities.grad_compression import Compression
    from paratrain.capabilities.onebit import MomentumSchedule

    def freeze(steps, *overrides):
        cfg = load_config(None, [f"training.steps={steps}", "optimizer.warmup_steps=100", *overrides])
        return MomentumSchedule.from_config(cfg.optimizer, cfg.training.steps).freeze

    assert [freeze(s, "optimizer.name=onebit_adam") for s in (2000, 6000, 100, 4)] == [130, 390, 6, 1]
    assert freeze(2000, "optimizer.name=onebit_adam", "optimizer.freeze_step=50") == 50
    assert freeze(2000, "optimizer.name=zero_one_adam") == 100
    # the run's length reaches the schedule the gradient hooks follow
    cfg = load_config(None, ["optimizer.name=onebit_adam"])
    layout = Layout.resolve(2, dp_mode="ddp")
    reduction = gradient_reduction(Compression(), layout, optimizer_entry("onebit_adam"), cfg.optimizer, 2000)
    comm = GradComm(ParallelConfig(), SimpleNamespace(layout=layout), torch.device("cpu"), reduction=reduction)
    assert comm.schedule.freeze == 130


def test_onebit_in_the_estimator_and_the_planner():
    """The estimate counts the moments (0/1 Adam: and its accumulator), the step counts and both residuals; the plan
    predicts each phase and ranks by the compressed one, whose bytes are 1-bit Adam's ~1/32."""
    from paratrain.estimate import Target, estimate, inputs_for
    from paratrain.recipe import Recipe
    from paratrain.capabilities.grad_compression import Compression
    from paratrain.estimate.model_states import model_params, state_bytes
    from paratrain.layout import Layout
    from paratrain.models.args import ModelArgs
    from paratrain.models.presets import count_params
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import predict

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=64)
    n, tensors = count_params(args), len(model_params(args))
    ddp = Layout.resolve(4, dp_mode="ddp")
    assert state_bytes(args, ddp, "fp32", "onebit_adam", "paratrain").optimizer == 8 * n + 8 * tensors
    assert state_bytes(args, ddp, "fp32", "zero_one_adam", "paratrain").optimizer == 12 * n + 12 * tensors
    residuals = Compression("sign_ef").cost([q.shape for q in model_params(args)], 4).state_bytes
    est = estimate(inputs_for(args, Recipe(ddp, precision="fp32", optimizer="onebit_adam",
                                           seq_len=64).replace(loss_chunks=0), Target(device="cpu")),
                   suggest=False)
    assert est.sizes["compression"] == residuals >= 4 * n + math.ceil(4 * n / 4)  # worker + server (per piece)
    with pytest.raises(UserError, match="--grad-compression must be none"):
        plan_context(PlanRequest("llama3-8b", gpus=8, optimizer="onebit_adam", parallel={"grad_compression": "bf16"}))
    for name, kinds in (("onebit_adam", 2), ("zero_one_adam", 4)):
        ctx = plan_context(PlanRequest("llama3.2-1b", gpus=16, optimizer=name, inter="eth25")).ctx
        pred = predict(ctx.candidate(Layout.resolve(16, dp_mode="ddp"), checkpointing="full", micro_batch=1), ctx)
        assert len(pred.phases) == kinds and pred.step_s == pred.phases[-1][1]
        fp32, compressed = pred.phases[0][2], pred.phases[-1][2]
        assert 0.02 < compressed / fp32 < 0.04  # signs + a scale per piece: ~1/32
        assert "1-bit momentum all-reduce" in pred.comm


def test_onebit_adam_on_hsdp_replicas(char_data, tmp_path):
    """hsdp 2 x 2 (one launch of 4 ranks): during its warm-up 1-bit Adam is AdamW (foreach) to the bit; after it the
    replicate all-reduce moves to the momenta of each rank's FSDP shard (the reduce-scatter inside a replica stays
    fp32, so about half the bytes remain), and 3 + resume + 3 steps equal 6 straight."""
    from paratrain.distributed.launch import launch

    common = ["training.steps=6", "training.global_batch=8", "training.micro_batch=2", "training.eval_every=0",
              "optimizer.warmup_steps=2", "resilience.collective_timeout_s=60", "parallel.dp_mode=hsdp",
              "parallel.dp_replicate=2"]
    onebit = [*common, "optimizer.name=onebit_adam", "optimizer.freeze_step=2"]
    cfgs = (fast_config(char_data, tmp_path, "adamw", *common, "optimizer.impl=foreach", "checkpoint.save_final=false"),
            fast_config(char_data, tmp_path, "onebit", *onebit, "checkpoint.every=3"),
            fast_config(char_data, tmp_path, "onebit-resumed", *onebit,
                        f"checkpoint.resume={tmp_path / 'onebit' / 'checkpoints' / 'step-3'}"))
    adamw, straight, resumed = launch(_runs, cfgs, 4)
    assert straight.losses[:2] == adamw.losses[:2] and straight.losses[3:] != adamw.losses[3:]
    assert resumed.losses == straight.losses[3:] and resumed.val_loss == straight.val_loss
    ratios = [r["compression_ratio"] for r in _records(tmp_path / "onebit")]
    assert ratios[:2] == [1.0] * 2 and all(0.45 < x < 0.55 for x in ratios[2:])
