"""Mixture of experts: routing and per-token math, grouped matmuls, capacity, the balance loss, presets,
metrics and one-line errors. The expert-parallel layouts are checked against one process by the verify
matrix (tests/test_distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from paratrain.config import load_config
from paratrain.errors import ConfigError
from paratrain.models import Transformer, count_active_params, count_params, flops_per_token, preset_args
from paratrain.models import moe as moe_lib
from paratrain.distributed.initialize import init_weights
from paratrain.models.llama import FeedForward
from paratrain.models.moe import MoE, grouped_mm, moe_modules
from paratrain.spec import resolve_run

from conftest import fast_overrides

DIM, HIDDEN = 16, 24


def make_moe(n_experts=4, top_k=2, shared=True, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, n_experts, top_k, HIDDEN, shared=FeedForward(DIM, HIDDEN) if shared else None, **kw)
    with torch.no_grad():  # a router with clear preferences (the default init is near-uniform)
        moe.router.weight.normal_(0, 0.5)
    return moe


def expert_ffn(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return (F.silu(x @ w.w1[e]) * (x @ w.w3[e])) @ w.w2[e]


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score every expert, keep the top k, add gate x expert(x), plus the shared expert."""
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            tok = x[b, t]
            logits = moe.router.weight @ tok
            scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
            top = sorted(range(moe.n_experts), key=lambda e: (-scores[e].item(), e))[:moe.top_k]
            weights = scores[top] / scores[top].sum() if moe.top_k > 1 else scores[top]
            y = sum(g * expert_ffn(moe, e, tok[None])[0] for g, e in zip(weights, top))
            if moe.shared is not None:
                y = y + moe.shared(tok[None])[0]
            out[b, t] = y
    return out


# ---------------------------------------------------------------------------- per-token math

@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k, shared", [(2, True), (1, False), (3, True)])
def test_each_token_is_the_gated_sum_of_its_experts(score_func, top_k, shared):
    moe = make_moe(top_k=top_k, shared=shared, score_func=score_func)
    x = torch.randn(3, 7, DIM)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), dense_reference(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.tokens_per_expert.sum() == 3 * 7 * top_k and moe.dropped == 0


def test_routing_scores_and_gates():
    x = torch.randn(50, DIM)
    for score_func in ("softmax", "sigmoid"):
        moe = make_moe(score_func=score_func)
        probs, idx, gates = moe.route(x)
        logits = x @ moe.router.weight.T
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        assert torch.equal(idx, scores.topk(2).indices)  # the two best experts, best first
        torch.testing.assert_close(gates.sum(-1), torch.ones(50))  # renormalised over the chosen experts
        torch.testing.assert_close(probs.sum(-1), torch.ones(50))  # a distribution for the balance loss
    moe = make_moe(top_k=1)
    probs, idx, gates = moe.route(x)
    torch.testing.assert_close(gates[:, 0], probs.max(-1).values)  # top-1: the raw probability (Switch)


def test_ties_go_to_the_lower_expert_index():
    moe = make_moe(n_experts=4, top_k=2, shared=False)
    with torch.no_grad():
        moe.router.weight.zero_()  # every score equal
    _, idx, _ = moe.route(torch.randn(5, DIM))
    assert idx.tolist() == [[0, 1]] * 5


def test_gradients_match_the_dense_computation():
    moe = make_moe()
    x = torch.randn(2, 5, DIM)
    moe(x).pow(2).sum().backward()
    fast = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    dense_reference(moe, x).pow(2).sum().backward()
    for n, p in moe.named_parameters():
        torch.testing.assert_close(fast[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


# ---------------------------------------------------------------------------- grouped matmul

@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_mm_equals_per_expert_matmuls(monkeypatch, grouped):
    if not grouped:
        monkeypatch.setattr(moe_lib, "use_grouped_mm", lambda x, w: False)  # the segment-loop fallback
    counts = torch.tensor([3, 0, 5, 1, 0])  # empty experts included
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    w = torch.randn(5, 8, 4, requires_grad=True)
    assert moe_lib.use_grouped_mm(x, w) == (grouped and hasattr(torch, "_grouped_mm"))
    y = grouped_mm(x, w, counts)
    y.sum().backward()  # an expanded (zero-stride) gradient
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rows = xr.split(counts.tolist())
    ref = torch.cat([rows[e] @ wr[e] for e in range(5)])
    ref.sum().backward()
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=1e-6)
    # No tokens at all: an empty output, and still a (zero) gradient for every expert.
    w.grad = None
    grouped_mm(x[:0], w, torch.zeros(5, dtype=torch.long)).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() == 0


def test_grouped_gemm_needs_aligned_rows():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm: the segment loop is used")
    assert moe_lib.use_grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8))
    assert not moe_lib.use_grouped_mm(torch.randn(4, 6), torch.randn(2, 6, 8))  # 24-byte rows: segment loop


# ---------------------------------------------------------------------------- capacity

def test_capacity_factor_drops_tokens_and_reports_them():
    moe = make_moe(top_k=2, capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight[0] += 10 * torch.randn(DIM).abs()  # most tokens want expert 0 ...
    x = torch.randn(2, 16, DIM).abs()  # ... positive inputs make that certain
    T, k, E = 16, 2, 4
    cap = moe.capacity(T)
    assert cap == 4  # ceil(0.5 * 16 * 2 / 4)
    with torch.no_grad():
        y = moe(x)
        _, idx, gates = moe.route(x.reshape(-1, DIM))
    idx = idx.view(2, T, k)
    # Expected drops per sequence: first choices before second choices, then in token order.
    expected, keep = 0, torch.ones(2, T, k, dtype=torch.bool)
    for b in range(2):
        used = [0] * E
        for slot in range(k):
            for t in range(T):
                e = idx[b, t, slot].item()
                used[e] += 1
                if used[e] > cap:
                    keep[b, t, slot] = False
                    expected += 1
    assert expected > 0 and int(moe.dropped) == expected
    # A kept assignment contributes gate x expert; a dropped one nothing; the shared expert always runs.
    flat = x.reshape(-1, DIM)
    with torch.no_grad():
        ref = moe.shared(flat).clone()
        for n in range(flat.shape[0]):
            for slot in range(k):
                if keep.view(-1, k)[n, slot]:
                    e = idx.view(-1, k)[n, slot].item()
                    ref[n] += gates[n, slot] * expert_ffn(moe, e, flat[n:n + 1])[0]
    torch.testing.assert_close(y.reshape(-1, DIM), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- load-balancing loss

def imbalance(moe: MoE) -> float:
    t = moe.tokens_per_expert.float()
    return (t.max() / t.mean()).item()


def test_balance_loss_is_one_when_balanced_and_e_when_collapsed():
    moe = make_moe(n_experts=4, top_k=1, shared=False)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 100.0
        moe(torch.ones(2, 8, DIM))  # everything to expert 2 with probability ~1
    assert moe.aux_loss.item() == pytest.approx(4.0, rel=1e-3)
    assert imbalance(moe) == pytest.approx(4.0)


def test_balance_loss_moves_an_imbalanced_router_toward_balance():
    torch.manual_seed(0)
    moe = make_moe(n_experts=8, top_k=2, shared=False, seed=1)
    with torch.no_grad():
        moe.router.weight[:2] += 0.5  # experts 0 and 1 take most of the (positive) tokens
    x = torch.randn(8, 32, DIM) + 1.0
    opt = torch.optim.Adam(moe.router.parameters(), lr=0.05)  # train only the router, only on the aux loss
    moe(x)
    start_loss, start_imbalance = moe.aux_loss.item(), imbalance(moe)
    for _ in range(40):
        opt.zero_grad()
        moe(x)
        moe.aux_loss.backward()
        opt.step()
    with torch.no_grad():
        moe(x)
    assert start_imbalance > 3.0, start_imbalance
    assert moe.aux_loss.item() < start_loss - 0.5
    assert imbalance(moe) < 1.5, (start_imbalance, imbalance(moe))


def test_balance_loss_is_per_sequence_so_any_batch_split_gives_the_same_mean():
    """The property that lets every data-parallel layout equal one process: the loss of a batch is the mean
    of the losses of its sequences, so the mean over ranks of each rank's loss is the global one."""
    moe = make_moe()
    x = torch.randn(6, 10, DIM)
    with torch.no_grad():
        moe(x)
        whole = moe.aux_loss.item()
        parts = []
        for chunk in x.split([1, 2, 3]):
            moe(chunk)
            parts.append(moe.aux_loss.item() * chunk.shape[0])
    assert sum(parts) / 6 == pytest.approx(whole, rel=1e-6)


# ---------------------------------------------------------------------------- model and presets

def test_moe_layers_replace_the_dense_mlp_from_the_first_moe_layer():
    args = preset_args("tiny-moe", vocab_size=64, n_layers=3)
    model = Transformer(args)
    kinds = [type(block.feed_forward).__name__ for block in model.layers.values()]
    assert kinds == ["FeedForward", "MoE", "MoE"]
    assert count_params(args) == sum(p.numel() for p in model.parameters())
    init_weights(model, 0)
    x = torch.randint(0, 64, (2, 12))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert len(moe_modules(model)) == 2


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # published: 46.7B total, 12.9B active
    ("deepseek-moe-16b", 16.4e9, 2.83e9),  # published: 16.4B total, 2.8B active
])
def test_published_moe_sizes(name, total, active):
    args = preset_args(name)
    assert float(f"{count_params(args):.3g}") == total
    assert float(f"{count_active_params(args):.3g}") == active
    # FLOPs follow the parameters a token actually uses.
    assert flops_per_token(args, 1) == pytest.approx(6 * count_active_params(args, include_embedding=False)
                                                     + 12 * args.n_layers * args.dim)


def test_dense_models_have_as_many_active_as_total_parameters():
    args = preset_args("llama3-8b")
    assert count_active_params(args) == count_params(args)


# ---------------------------------------------------------------------------- errors

@pytest.mark.parametrize("overrides, message", [
    (["model.moe_top_k=5"], "model.moe_top_k=5 must be between 1 and model.moe_experts=4"),
    (["model.moe_score_func=relu"], "model.moe_score_func: 'relu' is not one of softmax, sigmoid"),
    (["model.moe_capacity_factor=-1"], "model.moe_capacity_factor must be >= 0"),
])
def test_bad_moe_settings_are_one_line_errors(char_data, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:  # choices fail when the config loads, the rest when the run resolves
        resolve_run(load_config(None, fast_overrides(char_data, tmp_path, "bad", "model.preset=tiny-moe", *overrides)), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_bad_expert_parallelism_in_one_line(char_data, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "bad", "model.preset=tiny-moe")]
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--nproc", "4", *args, "--parallel.ep=3"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: parallel.ep=3 does not fit the mesh: expert parallelism borrows its ranks from dp_shard=4, "
        "which it must divide"]
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------- training and metrics

def test_training_logs_aux_loss_expert_load_and_drops(char_data, tmp_path):
    from paratrain.api import train_rank as train

    cfg = load_config(None, fast_overrides(char_data, tmp_path, "moe", "model.preset=tiny-moe", "training.steps=3",
                                           "model.moe_capacity_factor=1.0", "training.accum_steps=2",
                                           "checkpoint.save_final=false"))
    result = train(cfg)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    for r in steps:
        tokens = r["moe_tokens_per_expert"]  # one row per MoE layer (tiny-moe, 2 layers: 1 dense + 1 MoE)
        assert len(tokens) == 1 and len(tokens[0]) == 4
        assert sum(tokens[0]) == 4 * 2 * 32 * 2  # micro 4 x accum 2 sequences x 32 tokens x top-2
        assert r["moe_aux_loss"] > 0 and r["moe_max_violation"] >= 0 and r["moe_violation"] == [r["moe_max_violation"]]
        assert r["moe_dropped_tokens"] >= 0
        assert r["moe_dropped_share"] == [pytest.approx(r["moe_dropped_tokens"] / sum(tokens[0]))]
    assert any(r["moe_dropped_tokens"] > 0 for r in steps)  # capacity 1.0 with an untrained router


# ---------------------------------------------------------------------------- all-to-all dispatch

def _ep_rank(skew: bool) -> dict:
    """On each of 2 ranks: the MoE with experts [2r, 2r+1] here and the all-to-all dispatcher, on this rank's
    tokens; compared with the whole MoE on all tokens (outputs, and expert gradients summed over ranks)."""
    import torch.distributed as dist

    from paratrain.distributed.env import init_distributed
    from paratrain.distributed.expert_parallel import AllToAllDispatcher
    from paratrain.models.moe import GroupedExperts

    env = init_distributed("cpu")
    rank, ep = env.rank, env.world_size
    full = make_moe(n_experts=4, top_k=2, shared=False, seed=3)
    if skew:  # every token prefers experts 0 and 1: rank 1 receives nothing
        with torch.no_grad():
            full.router.weight[:2] += 5.0
    x = torch.rand(2 * ep, 6, DIM, generator=torch.Generator().manual_seed(4))
    full(x).pow(2).sum().backward()

    local = make_moe(n_experts=4, top_k=2, shared=False, seed=3)
    local.load_state_dict(full.state_dict())
    experts = GroupedExperts(2, DIM, HIDDEN)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(experts, name).copy_(getattr(full.experts, name)[2 * rank:2 * rank + 2])
    local.experts = experts
    local.dispatcher = AllToAllDispatcher(dist.group.WORLD, ep, 4)
    mine = x[2 * rank:2 * rank + 2]
    y = local(mine)
    y.pow(2).sum().backward()
    out_diff = (y - full(mine)).abs().max().item()
    grad_diff = 0.0
    for name in ("w1", "w2", "w3"):
        g = getattr(experts, name).grad  # the owner's gradient: every rank's tokens for these experts
        grad_diff = max(grad_diff, (g - getattr(full.experts, name).grad[2 * rank:2 * rank + 2]).abs().max().item())
    worst = torch.tensor([out_diff, grad_diff])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # both ranks' differences
    busy = (experts.w1.grad.abs().sum() > 0).float().view(1)
    dist.all_reduce(busy)
    dist.destroy_process_group()
    return {"out": worst[0].item(), "grad": worst[1].item(), "ranks_with_work": int(busy.item())}


@pytest.mark.parametrize("skew", [False, True])
def test_all_to_all_dispatch_equals_local_experts(skew):
    from paratrain.distributed.launch import launch

    got = launch(_ep_rank, (skew,), 2)
    assert got["out"] < 1e-6 and got["grad"] < 1e-6, got
    assert got["ranks_with_work"] == (1 if skew else 2)
