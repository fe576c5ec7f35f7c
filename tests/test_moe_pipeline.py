"""Mixture of experts under pipeline parallelism: the balance loss trains through the MoE output's backward
(`AuxLossScaler`, no second root a schedule could not take), counted once under activation checkpointing; the expert
loads are recorded per stage and gathered over the stages for the metrics; the pipelined layouts match one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from paratrain.config import load_config
from paratrain.distributed.expert_parallel import MoEMeter
from paratrain.models.llama import FeedForward
from paratrain.models.moe import MoE, set_aux_loss_scale

from conftest import fast_overrides

DIM, HIDDEN, COEF = 16, 24, 0.1


def _moe() -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, 4, 2, HIDDEN, shared=FeedForward(DIM, HIDDEN), aux_loss_coef=COEF)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5)
    return moe


def _grads(moe: MoE) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("recompute", [False, True])
def test_the_balance_loss_trains_through_the_output_as_a_second_root_would(recompute):
    moe, x = _moe(), torch.randn(3, 8, DIM)
    torch.autograd.backward([moe(x).square().sum(), COEF * moe.aux_loss * 0.5])  # the old way: a second root
    expected = _grads(moe)

    set_aux_loss_scale([moe], 0.5)  # e.g. 1/accum with two micro-batches
    y = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)  # recomputation must not count it again
    y.square().sum().backward()
    for got, want in zip(_grads(moe), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)

    set_aux_loss_scale([moe], None)  # off: a bare forward's backward has no balance-loss term
    moe(x).square().sum().backward()
    assert not torch.allclose(_grads(moe)[0], expected[0], rtol=1e-3, atol=0)  # the router's lost the term


def test_the_meter_records_training_forwards_once_each():
    moe, x = _moe(), torch.randn(2, 8, DIM)
    meter = MoEMeter(moe, torch.device("cpu"))
    moe(x)  # not recording: evaluation
    assert meter.tokens is None
    meter.recording = True
    for _ in range(2):
        checkpoint(moe, x, use_reentrant=False).sum().backward()  # the recomputation in backward is not counted
    stats = meter.step_metrics()
    assert sum(stats["moe_tokens_per_expert"][0]) == 2 * 2 * 8 * 2  # 2 forwards x 16 tokens x top-2
    assert stats["moe_aux_loss"] == pytest.approx(moe.aux_loss.item(), rel=1e-6)


def test_pipelined_moe_layouts_match_one_process(char_data):
    from test_distributed import check_matrix

    check_matrix(["moe-pp2-1f1b", "ep2xpp2"], char_data, steps=4)  # (MLA's MoE on pp2-1f1b: the DeepSeek journey's)


def test_pipelined_metrics_gather_every_stages_expert_loads(char_data, tmp_path):
    """The expert loads of a 2-stage pipeline (each stage an MoE layer of 4 blocks) are the single process's, layer by
    layer, on every step."""
    from paratrain.api import train

    metrics = {}
    for name, nproc, layout in (("one", 1, []), ("pp2", 2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"])):
        cfg = load_config(None, fast_overrides(char_data, tmp_path, name, "model.preset=tiny-moe", "model.n_layers=4",
                                               "training.steps=2", "checkpoint.save_final=false", *layout))
        train(cfg, nproc=nproc)
        metrics[name] = [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open()) if "loss" in r]
    for one, pp in zip(metrics["one"], metrics["pp2"], strict=True):
        assert len(one["moe_tokens_per_expert"]) == 3  # blocks 1, 2, 3
        assert pp["moe_tokens_per_expert"] == one["moe_tokens_per_expert"]
        assert pp["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], rel=1e-5)
