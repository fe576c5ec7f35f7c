"""The optimizer registry (paratrain/optimizers.py): names, one-line refusals, what the estimator and the planner read
from an entry, SGD on the layouts, and checkpoints that name their optimizer."""

from __future__ import annotations

import pytest

from conftest import fast_config
from paratrain.api import train_rank
from paratrain.errors import ConfigError, UserError
from paratrain.optimizers import OPTIMIZER_NAMES, OPTIMIZERS, optimizer_entry


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
    for entry in OPTIMIZERS.values():  # every entry's builder resolves
        assert callable(entry.load_builder()) and entry.state_bytes == 4 * len(entry.param_state)


def test_estimator_and_planner_read_the_entry():
    from paratrain.estimate.model_states import model_params, state_bytes
    from paratrain.layout import Layout
    from paratrain.models.args import ModelArgs
    from paratrain.models.presets import count_params
    from paratrain.planner import context_from_argv
    from paratrain.planner.cli import config_for
    from paratrain.planner.cost import Candidate, predict

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=64)
    n, tensors = count_params(args), len(model_params(args))
    lay = Layout.resolve(1)
    assert state_bytes(args, lay, "fp32", "adamw", "paratrain").optimizer == 8 * n + 4 * tensors  # moments + steps
    assert state_bytes(args, lay, "fp32", "sgd", "paratrain").optimizer == 4 * n  # one momentum buffer
    plans = {}
    for name in ("adamw", "sgd"):
        ctx, *_ = context_from_argv(["--model", "llama3-8b", "--gpus", "8", "--optimizer", name])
        cand = Candidate(Layout.resolve(8, dp_mode="fsdp"), micro_batch=1)
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


def _runs(*cfgs):
    """Every config trained one after the other by the same launched ranks (one process group); rank 0's results."""
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def test_exact_resume_on_two_ranks(char_data, tmp_path):
    """10 + resume + 10 steps give the losses of 20 straight steps, bit for bit, on 2 gloo ranks (one launch): SGD
    through ZeRO-1 (each rank loads its partition's momentum from the name-keyed checkpoint)."""
    from paratrain.distributed.launch import launch

    def pair(name, *extra):
        common = ["training.steps=20", "training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2",
                  "resilience.collective_timeout_s=60", *extra]
        resume = f"checkpoint.resume={tmp_path / name / 'checkpoints' / 'step-10'}"
        return (fast_config(char_data, tmp_path, name, *common, "checkpoint.every=10"),
                fast_config(char_data, tmp_path, f"{name}-resumed", *common, resume))

    cfgs = pair("sgd-zero1", "parallel.dp_mode=zero1", "optimizer.name=sgd", "optimizer.lr=0.3")
    results = launch(_runs, cfgs, 2)
    for straight, resumed in zip(results[::2], results[1::2]):
        assert resumed.losses == straight.losses[10:] and resumed.val_loss == straight.val_loss  # ==: bitwise
