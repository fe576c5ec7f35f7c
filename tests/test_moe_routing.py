"""DeepSeek-V3's group-limited routing and routed scaling, Qwen2-MoE's gated shared experts: the MoE block against
transformers' router and a token-by-token reference, ties, the parameter table, and one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.config import load_config
from paratrain.errors import ConfigError
from paratrain.models import build_model, parameters, preset_args
from paratrain.models.llama import FeedForward
from paratrain.models.moe import MoE, choose_experts
from paratrain.spec import resolve_run

from conftest import fast_overrides

DIM, HIDDEN = 16, 24


def make_moe(n_experts=8, top_k=2, seed=0, shared=True, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, n_experts, top_k, HIDDEN, shared=FeedForward(DIM, HIDDEN) if shared else None, **kw)
    with torch.no_grad():  # clear preferences (the default init is near-uniform)
        moe.router.weight.normal_(0, 0.5)
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, as DeepSeek-V3 writes it: group scores, the best groups, the top-k within them, gates
    renormalised and scaled; plus the (gated) shared experts."""
    w, E, G = moe.experts, moe.n_experts, moe.n_group
    out = torch.empty_like(x)
    for n, tok in enumerate(x.view(-1, DIM)):
        logits = moe.router.weight @ tok
        scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
        size = E // G
        group_score = [sum(sorted(scores[g * size:(g + 1) * size].tolist(), reverse=True)[:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-group_score[g], g))[:moe.topk_group]
        allowed = [e for e in range(E) if e // size in groups]
        top = sorted(allowed, key=lambda e: (-scores[e].item(), e))[:moe.top_k]
        gates = scores[top] / scores[top].sum() if moe.top_k > 1 else scores[top]
        gates = gates * moe.routed_scaling_factor
        y = sum(g * ((F.silu(tok @ w.w1[e]) * (tok @ w.w3[e])) @ w.w2[e]) for g, e in zip(gates, top))
        if moe.shared is not None:
            shared = moe.shared(tok[None])[0]
            if moe.shared_gate is not None:
                shared = torch.sigmoid(moe.shared_gate(tok)) * shared
            y = y + shared
        out.view(-1, DIM)[n] = y
    return out


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("n_group, topk_group, top_k, shared_gate", [(4, 2, 2, False), (4, 1, 2, True),
                                                                     (2, 1, 3, True), (1, 1, 2, True)])
def test_each_token_is_the_reference_sum(score_func, n_group, topk_group, top_k, shared_gate):
    moe = make_moe(top_k=top_k, score_func=score_func, n_group=n_group, topk_group=topk_group,
                   routed_scaling_factor=2.5, shared_gate=shared_gate)
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_routing_equals_transformers_deepseek_v3_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=DIM, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(config)
    moe = make_moe(n_experts=16, top_k=4, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    hf.weight.data.copy_(moe.router.weight.data)
    x = torch.randn(64, DIM)
    with torch.no_grad():
        _, idx, gates = moe.route(x)
        _, hf_gates, hf_idx = hf(x)
    order = hf_idx.argsort(-1)  # transformers' top-k is unsorted: compare by expert id
    assert torch.equal(idx.sort(-1).values, hf_idx.gather(1, order))
    torch.testing.assert_close(gates.gather(1, idx.argsort(-1)), hf_gates.gather(1, order), rtol=0, atol=1e-6)
    # the limit matters: routing over all 16 experts picks other experts for some tokens
    assert not torch.equal(idx, choose_experts(torch.sigmoid(x @ moe.router.weight.T), 4))


def test_ties_go_to_the_lower_group_and_expert():
    choice = torch.zeros(3, 8)  # every group and expert equal
    assert choose_experts(choice, 2, n_group=4, topk_group=2).tolist() == [[0, 1]] * 3
    choice[:, 7] = 1.0  # group 3 is best; then group 0 (ties with 1 and 2) by index
    assert choose_experts(choice, 3, n_group=4, topk_group=2).tolist() == [[7, 0, 1]] * 3


def test_gated_shared_expert_in_the_parameter_table():
    args = preset_args("tiny-moe", vocab_size=128, moe_shared_gate=True, moe_n_group=2, moe_topk_group=1,
                       moe_routed_scaling_factor=2.5)
    with torch.device("meta"):
        model = build_model(args)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in parameters(args)]
    gate = next(p for p in parameters(args) if p.name.endswith("shared_gate.weight"))
    assert gate.name == "layers.1.feed_forward.shared_gate.weight" and gate.shape == (1, 64)
    assert gate.role == "replicated"


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_n_group=3"], "model.moe_n_group=3 must divide model.moe_experts=4"),
    (["model.moe_n_group=2", "model.moe_topk_group=3"], "model.moe_topk_group=3 must be between 1 and "
                                                        "model.moe_n_group=2"),
    (["model.moe_n_group=4", "model.moe_topk_group=1"], "model.moe_top_k=2 is more than the 1 experts of "
                                                        "model.moe_topk_group=1 group(s) of 1"),
    (["model.moe_shared_experts=0", "model.moe_shared_gate=true"], "model.moe_shared_gate=true gates the shared "
                                                                   "experts"),
])
def test_bad_routing_settings_are_one_line_errors(char_data, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        resolve_run(load_config(None, fast_overrides(char_data, tmp_path, "bad", "model.preset=tiny-moe",
                                                     *overrides)), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_routing_and_capacity_layouts_match_one_process(char_data):
    """Group routing + routed scaling + the gated shared expert on ep2 x tp2, and token dropping (a capacity factor)
    under expert parallelism, each against one process training the same model (the other moe-routing rows run in
    `paratrain verify`; group routing and routed scaling on fsdp2, tp2, pp2-1f1b and ep2 in the DeepSeek journey's)."""
    from test_distributed import check_matrix

    check_matrix(["moe-routing-ep2xtp2", "ep2+capacity"], char_data)
