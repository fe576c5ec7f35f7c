"""Muon (paratrain/training/muon.py): torch.optim.Muon's update on one process, one process's losses on every layout
(the verify rows), exact and resharded resume, one-line refusals, and what the estimator and the planner count."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import fast_config
from paratrain.config import OptimizerConfig, load_config
from paratrain.errors import ConfigError
from paratrain.estimate.model_states import hidden_matrix_names, model_params, state_bytes
from paratrain.models import build_model
from paratrain.models.args import ModelArgs
from paratrain.training.optim import build_optimizer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_hidden=160, max_seq_len=32)


def test_one_process_update_is_torch_muon_with_adamw_for_the_rest():
    """The hidden matrices step as torch.optim.Muon (same settings, its bf16 iteration), every other parameter as
    torch's AdamW: bit for bit over three steps."""
    hidden = hidden_matrix_names(ARGS)
    assert hidden == {p.name for p in model_params(ARGS) if p.layer is not None and p.name.endswith(
        ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight"))}
    torch.manual_seed(0)
    ours = build_model(ARGS)
    theirs = copy.deepcopy(ours)
    cfg = OptimizerConfig(name="muon", muon_ns_dtype="bfloat16", muon_adjust_lr="original", weight_decay=0.1)
    opt = build_optimizer(ours, cfg, torch.device("cpu"), hidden=hidden)
    named = dict(theirs.named_parameters())
    rest = [p for n, p in named.items() if n not in hidden]
    reference = [torch.optim.Muon([named[n] for n in named if n in hidden], lr=cfg.lr, weight_decay=0.1,
                                  momentum=0.95, nesterov=True, adjust_lr_fn="original"),
                 torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                    {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                   lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)]
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    for _ in range(3):
        for model in (ours, theirs):
            model.zero_grad()
            model(tokens).float().pow(2).mean().backward()
        opt.step()
        for o in reference:
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    keys = {n: sorted(opt.state[p]) for n, p in ours.named_parameters()}
    assert all(keys[n] == ["momentum_buffer"] for n in hidden)
    assert all(keys[n] == ["exp_avg", "exp_avg_sq", "step"] for n in keys if n not in hidden)


def test_verify_muon_matrix(char_data):
    """ddp2, zero1x2, fsdp2, hsdp2x2, tp2, fsdp2xtp2, pp2, ep2 with Muon against one process's Muon (fp32: the
    iteration in fp32), and each layout loading one process's Muon checkpoint for its val loss."""
    from test_distributed import check_matrix
    from paratrain.verify import CAPABILITY_MATRICES

    MUON_MATRIX = CAPABILITY_MATRICES["muon"]

    assert MUON_MATRIX == ["muon-ddp2", "muon-zero1x2", "muon-fsdp2", "muon-hsdp2x2", "muon-tp2", "muon-fsdp2xtp2",
                           "muon-pp2", "muon-ep2"]
    check_matrix(MUON_MATRIX, char_data)


def _runs(*cfgs):
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def test_muon_resumes_exactly_and_on_another_layout(char_data, tmp_path):
    """fsdp2, 6 steps: resumed from step 3 on fsdp2 it gives the same losses bit for bit; resumed on ddp2 (the
    momenta resharded from FSDP's shards to whole replicas) and on zero1 (each rank its partition's) within 1e-5."""
    from paratrain.distributed.launch import launch

    common = ["training.steps=6", "training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2",
              "optimizer.name=muon", "resilience.collective_timeout_s=60"]
    step3 = f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-3'}"
    cfgs = (fast_config(char_data, tmp_path, "straight", *common, "checkpoint.every=3", "parallel.dp_mode=fsdp"),
            fast_config(char_data, tmp_path, "fsdp", *common, step3, "parallel.dp_mode=fsdp"),
            fast_config(char_data, tmp_path, "ddp", *common, step3, "parallel.dp_mode=ddp"),
            fast_config(char_data, tmp_path, "zero1", *common, step3, "parallel.dp_mode=zero1"))
    straight, fsdp, ddp, zero1 = launch(_runs, cfgs, 2)
    assert fsdp.losses == straight.losses[3:] and fsdp.val_loss == straight.val_loss  # ==: bitwise
    for other in (ddp, zero1):
        assert max(abs(a - b) for a, b in zip(other.losses, straight.losses[3:])) <= 1e-5
        assert abs(other.val_loss - straight.val_loss) <= 1e-5


@pytest.mark.parametrize("overrides, message", [
    (["parallel.grad_compression=sign_ef"], "parallel.grad_compression=sign_ef sends one bit per element"),
    (["optimizer.muon_ns_steps=0"], "optimizer.muon_ns_steps must be >= 1"),
    (["lora.rank=8"], "LoRA freezes"),
    (["optimizer.muon_momentum=1"], "optimizer.muon_momentum must be in [0, 1)"),
])
def test_muon_bad_input_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optimizer.name=muon", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_without_trainable_hidden_matrices_is_one_line():
    model = build_model(ARGS)
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." not in f".{name}")
    with pytest.raises(ConfigError, match="no trainable hidden matrices") as e:
        build_optimizer(model, OptimizerConfig(name="muon"), torch.device("cpu"), hidden=hidden_matrix_names(ARGS))
    assert "\n" not in str(e.value)


def test_muon_in_the_estimator_and_the_planner():
    """State: a momentum (4 bytes) per hidden element, AdamW's moments (8) and a step count per other parameter. The
    plan's step: the Newton-Schulz iterations shared out over the ranks and, on sharded layouts, two
    redistributions of the updates (none under ZeRO-1, whose ranks step their own whole parameters)."""
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.capabilities.muon import REDISTRIBUTION, ns_flops
    from paratrain.estimate.step_time import predict
    from paratrain.layout import Layout

    params = model_params(ARGS)
    hidden = sum(p.numel for p in params if p.hidden_matrix)
    rest = [p for p in params if not p.hidden_matrix]
    lay = Layout.resolve(1)
    assert state_bytes(ARGS, lay, "fp32", "muon", "paratrain").optimizer == \
        4 * hidden + 8 * sum(p.numel for p in rest) + 4 * len(rest)
    assert ns_flops((64, 160)) == 5 * 2 * 64 * 64 * (2 * 160 + 64)
    preds = {}
    for name in ("adamw", "muon"):
        ctx = plan_context(PlanRequest("llama3-8b", gpus=8, optimizer=name)).ctx
        preds[name, "fsdp"] = predict(ctx.candidate(Layout.resolve(8, dp_mode="fsdp"), micro_batch=1), ctx)
        preds[name, "zero1"] = predict(ctx.candidate(Layout.resolve(8, dp_mode="zero1"), micro_batch=1), ctx)
    assert preds["muon", "fsdp"].optimizer_s > preds["adamw", "fsdp"].optimizer_s
    assert preds["muon", "fsdp"].comm[REDISTRIBUTION] > 0 and preds["muon", "zero1"].comm[REDISTRIBUTION] == 0
    assert REDISTRIBUTION not in preds["adamw", "fsdp"].comm


def test_muon_is_named_by_its_capability_its_kernels_and_their_registrations_only():
    """The estimator, the planner, the checkpoint and the optimizer table ask the capability seam (its hooks, its
    optimizer entry, the HIDDEN_STATE group key): the name is its capability module's, its torch module's and the two
    tables' that register them (the capabilities, the builders)."""
    root = Path(__file__).resolve().parents[1]
    found = subprocess.run(["grep", "-rliE", "muon", "paratrain", "--include=*.py"], cwd=root,
                           capture_output=True, text=True).stdout.split()
    assert sorted(found) == ["paratrain/capabilities/__init__.py", "paratrain/capabilities/muon.py",
                             "paratrain/training/muon.py", "paratrain/training/optim.py"]


def test_an_older_checkpoints_group_key_is_read():
    """Checkpoints before 2026-12-07 mark the hidden matrices' group "muon": loaded, it is the HIDDEN_STATE group."""
    from paratrain.optimizers import HIDDEN_STATE

    opt = build_optimizer(build_model(ARGS), OptimizerConfig(name="muon"), torch.device("cpu"),
                          hidden=hidden_matrix_names(ARGS))
    state = opt.state_dict()
    older = {**state, "param_groups": [{("muon" if k == HIDDEN_STATE else k): v for k, v in g.items()}
                                       for g in state["param_groups"]]}
    opt.load_state_dict(older)
    assert [g[HIDDEN_STATE] for g in opt.param_groups] == [True, False, False]
    assert all("muon" not in g for g in opt.param_groups)
