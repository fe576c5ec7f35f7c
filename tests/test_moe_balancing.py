"""Auxiliary-loss-free balancing (`[moe]`, paratrain/capabilities/moe_balancing.py): the routing bias chooses but never
weighs, moves toward the mean load, is the same on every layout (the verify rows) and resumes exactly, on another
layout too; its settings' one-line refusals."""

from __future__ import annotations

import pytest
import torch

from paratrain.api import run_rank, train_rank
from paratrain.capabilities.moe_balancing import ROW, MoEBalancing
from paratrain.config import load_config
from paratrain.distributed.launch import launch
from paratrain.errors import ConfigError
from paratrain.models.moe import MoE
from paratrain.verify import CAPABILITY_MATRICES, base_overrides, layout_overrides, run_verify

BIAS = "layers.1.feed_forward.expert_bias"  # tiny-moe with 4 layers: block 0 dense, 1-3 MoE


def test_the_bias_chooses_and_the_scores_weigh():
    torch.manual_seed(0)
    moe = MoE(dim=16, n_experts=4, top_k=2, hidden=8, expert_bias=True)
    x = torch.randn(10, 16)
    scores = moe.router(x).softmax(-1)
    moe.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # experts 0 and 1 win every choice
    _, idx, gates = moe.route(x)
    assert (idx.sort(-1).values == torch.tensor([0, 1])).all()
    picked = scores.gather(-1, idx)
    torch.testing.assert_close(gates, picked / picked.sum(-1, keepdim=True))  # unbiased scores, renormalised
    assert "expert_bias" in moe.state_dict() and "expert_bias" not in MoE(16, 4, 2, 8).state_dict()


def test_the_update_moves_toward_the_mean_load():
    moe = MoE(dim=16, n_experts=4, top_k=2, hidden=8, expert_bias=True)
    loads = torch.tensor([[6.0, 2.0, 4.0, 4.0]], dtype=torch.float64)  # mean 4
    MoEBalancing("aux_free", 0.5).after_expert_loads(moe, loads, True)
    assert moe.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    MoEBalancing("aux_free", 0.5).after_expert_loads(moe, loads, torch.tensor(False))  # a skipped step
    MoEBalancing("aux_loss", 0.5).after_expert_loads(moe, loads, True)
    assert moe.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("overrides, message", [
    (["moe.balancing=aux"], "moe.balancing: 'aux' is not one of auto, aux_loss, aux_free, none"),
    (["moe.bias_update_rate=-1"], "moe.bias_update_rate must be a number in (0, 1]"),
    (["model.preset=tiny-moe", "moe.balancing=aux_free"], "set model.moe_expert_bias=true"),
])
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_auto_and_none():
    assert MoEBalancing.from_config(load_config(None, ["model.preset=tiny-moe"])) is None  # the balance loss alone
    assert MoEBalancing.from_config(load_config(None, ["model.preset=tiny-moe", "model.moe_expert_bias=true"])) == \
        MoEBalancing("auto", 1e-3)
    model = torch.nn.Sequential(MoE(16, 4, 2, 8))
    MoEBalancing("none").before_parallelize(model, None)
    assert model[0].aux_loss_coef == 0.0
    with pytest.raises(ConfigError, match="set model.moe_expert_bias=true"):
        MoEBalancing("aux_free").before_parallelize(model, None)


def test_rows_match_one_process(char_data):
    """ep2 against one process: losses and final weights, the bias among them, within 1e-5. The capability's other
    rows (fsdp2, ep2 x tp2) run in `paratrain verify`; the DeepSeek journey (tests/test_journeys.py) verifies
    tiny-deepseek, aux-free too, on fsdp2, tp2, pp2-1f1b, ep2, ep2 x tp2 and resumed from ep2 on fsdp2."""
    assert list(CAPABILITY_MATRICES["moe"]) == ["aux_free-fsdp2", "aux_free-ep2", "aux_free-ep2xtp2"]
    from test_distributed import check_matrix

    check_matrix(["aux_free-ep2"], char_data, steps=4)


def _config(char_data, out, name: str, layout: str, *extra: str):
    _, overrides = layout_overrides(layout) if layout != "single" else (1, ["training.micro_batch=8", *ROW])
    return load_config(None, [*base_overrides(4, str(out), "fp32"), *overrides, f"data.dir={char_data}",
                              f"run.name={name}", *extra])


def test_the_bias_resumes_exactly_on_another_layout(char_data, tmp_path):
    """2 steps on ep2, checkpointed; resumed on fsdp2 for the last 2: the losses and final weights (the bias
    among them) of one process's uninterrupted 4 steps, within 1e-5; the bias moved and changed the routing."""
    straight = train_rank(_config(char_data, tmp_path, "straight", "single"), want_final_weights=True)
    launch(run_rank, (_config(char_data, tmp_path, "ep2", "aux_free-ep2", "checkpoint.every=2"),), 2)
    resumed = launch(run_rank, (_config(char_data, tmp_path, "fsdp2", "aux_free-fsdp2",
                                        f"checkpoint.resume={tmp_path / 'ep2' / 'checkpoints' / 'step-2'}"), True), 2)
    assert len(resumed.losses) == 2
    assert max(abs(a - b) for a, b in zip(resumed.losses, straight.losses[2:])) <= 1e-5
    for key, ref in straight.final_weights.items():
        assert (resumed.final_weights[key] - ref).abs().max() <= 1e-5, key
    bias = straight.final_weights[BIAS]
    assert torch.equal(resumed.final_weights[BIAS], bias) and bias.abs().max() > 0  # the same steps of 0.02
    plain = train_rank(_config(char_data, tmp_path, "aux_loss", "single", "moe.balancing=aux_loss"))
    assert plain.losses[0] == straight.losses[0] and plain.losses[-1] != straight.losses[-1]  # routing changed


def test_a_resumed_verify_row(char_data):
    """`paratrain verify`'s resumed row: 2 steps on ep2, checkpointed, the last 2 resumed on fsdp2, against one
    process's uninterrupted 4 steps like every row (all 4 losses, the final weights with the bias, the val loss)."""
    rows, _ = run_verify(["resume-ep2:fsdp2"], steps=4, tolerance=1e-5, extra_args=[f"data.dir={char_data}"],
                         echo=lambda line: None)
    assert rows[0].passed and len(rows[0].losses) == 4, rows
