"""The Llama model: shapes, parameter counts, causality, GQA, tied embeddings, init, RoPE, learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from paratrain.errors import UserError
from paratrain.models import PRESETS, ModelArgs, Transformer, build_model, count_params, preset_args
from paratrain.distributed.initialize import init_weights
from paratrain.models.llama import apply_rope, rope_tables

VOCAB = 65  # tinyshakespeare's character count


def tiny_args(**overrides) -> ModelArgs:
    return preset_args("tiny", vocab_size=VOCAB, **overrides)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    model = Transformer(tiny_args(**overrides))
    init_weights(model, seed)
    return model


def tokens(B: int, T: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


# ---------------------------------------------------------------------------- shapes and sizes

@pytest.mark.parametrize("B, T", [(1, 1), (2, 7), (3, 32)])
def test_output_shape(B, T):
    model = tiny_model()
    logits = model(tokens(B, T))
    assert logits.shape == (B, T, VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_rejects_too_long_input():
    model = tiny_model(max_seq_len=16)
    model(tokens(1, 16))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, 17))


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_params_matches_meta_model(name):
    args = preset_args(name, vocab_size=VOCAB)  # vocab only used by the presets that take it from data
    with torch.device("meta"):
        model = build_model(args)  # the preset's family's module
    assert count_params(args) == numel(model)
    embedding = args.vocab_size * args.dim
    assert count_params(args, include_embedding=False) == numel(model) - embedding


@pytest.mark.parametrize("name, expected", [
    ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824),
    ("llama3-8b", 8_030_261_248),
    ("llama3.1-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3.1-405b", 405_853_388_800),
])
def test_published_llama_sizes(name, expected):
    assert count_params(preset_args(name)) == expected


def test_unknown_preset_suggests():
    with pytest.raises(UserError, match="did you mean 'tiny'"):
        preset_args("tinyy", vocab_size=VOCAB)
    with pytest.raises(UserError, match="vocab size"):
        preset_args("tiny")  # takes its vocab from the dataset: must be given


# ---------------------------------------------------------------------------- attention

def test_causal():
    """Changing token t+1 never changes the logits at positions <= t (fp32, tight tolerance)."""
    torch.manual_seed(0)
    model = tiny_model().eval()
    T = 24
    x = tokens(2, T)
    with torch.no_grad():
        base = model(x)
        for t in (0, 5, 11, T - 2):
            y = x.clone()
            y[:, t + 1] = (y[:, t + 1] + 1 + torch.arange(2)) % VOCAB
            out = model(y)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])  # the changed position does see it


def test_gqa_runs_and_equals_mha_with_repeated_kv():
    gqa_args = tiny_args(n_heads=4, n_kv_heads=2)
    assert gqa_args.n_kv_heads < gqa_args.n_heads
    gqa = Transformer(gqa_args)
    init_weights(gqa, 3)
    x = tokens(2, 16)
    with torch.no_grad():
        out = gqa(x)
    assert out.shape == (2, 16, VOCAB)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * gqa_args.head_dim, gqa_args.dim)

    # Multi-head attention whose K/V heads are copies of the GQA heads computes the same thing.
    mha = Transformer(dataclasses.replace(gqa_args, n_kv_heads=4))
    rep, hd = 2, gqa_args.head_dim
    state = {}
    for k, v in gqa.state_dict().items():
        if k.endswith(("wk.weight", "wv.weight")):
            v = v.view(-1, hd, v.shape[-1]).repeat_interleave(rep, dim=0).reshape(-1, v.shape[-1])
        state[k] = v
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), out, rtol=1e-5, atol=1e-5)


def test_gqa_backward():
    model = tiny_model(n_heads=4, n_kv_heads=1)
    x = tokens(2, 8)
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------- tied embeddings

def test_tied_embeddings_share_storage():
    args = tiny_args(tie_embeddings=True)
    model = Transformer(args)
    init_weights(model, 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert numel(model) == count_params(args) == count_params(tiny_args()) - VOCAB * args.dim
    # A gradient step through either use updates the one shared tensor.
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = 123.0
    assert model.output.weight[0, 0] == 123.0


def test_tied_embeddings_survive_meta_to_empty():
    with torch.device("meta"):
        model = Transformer(tiny_args(tie_embeddings=True))
    model.to_empty(device="cpu")
    init_weights(model, 0)
    assert model.output.weight is model.tok_embeddings.weight


# ---------------------------------------------------------------------------- init

def test_init_deterministic():
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    matrices = [k for k in sa if sa[k].dim() == 2]
    assert all(not torch.equal(sa[k], sc[k]) for k in matrices)
    # Different parameters get different draws (the name is part of the seed).
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])


def test_init_values():
    model = tiny_model(seed=0)
    n_layers = model.args.n_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        elif name.endswith(("wo.weight", "w2.weight")):
            assert abs(p.std().item() - 0.02 / (2 * n_layers) ** 0.5) < 0.003
        else:
            assert abs(p.std().item() - 0.02) < 0.003 and abs(p.mean().item()) < 0.003


def test_init_on_meta_then_to_empty_matches():
    ref = tiny_model(seed=5)
    with torch.device("meta"):
        model = Transformer(tiny_args())
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    init_weights(model, 5)
    sr, sm = ref.state_dict(), model.state_dict()
    assert sr.keys() == sm.keys() and all(torch.equal(sr[k], sm[k]) for k in sr)
    # The non-persistent rotary tables are rebuilt too (reset_buffers), not left as garbage.
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)
    x = tokens(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


# ---------------------------------------------------------------------------- RoPE

def test_rope_preserves_norm_and_is_relative():
    B, T, H, D = 2, 16, 3, 8
    cos, sin = rope_tables(D, T, 10000.0)
    assert cos.shape == sin.shape == (T, D // 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, H, D, generator=g)
    r = apply_rope(x, cos, sin)
    assert r.shape == x.shape and r.dtype == x.dtype
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r[:, 0], x[:, 0])  # position 0: no rotation
    # Each pair (x[i], x[i + D/2]) is rotated on its own (split halves, as transformers' Llama): the norm of
    # every pair is preserved too.
    def pairs(t):
        return t.unflatten(-1, (2, -1)).norm(dim=-2)

    torch.testing.assert_close(pairs(r), pairs(x), rtol=1e-5, atol=1e-6)
    # <rope(q, m), rope(k, n)> depends on m - n only.
    q, k = torch.randn(D, generator=g), torch.randn(D, generator=g)
    qs = apply_rope(q.expand(1, T, 1, D), cos, sin)[0, :, 0]
    ks = apply_rope(k.expand(1, T, 1, D), cos, sin)[0, :, 0]
    torch.testing.assert_close(qs[7] @ ks[4], qs[12] @ ks[9], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(qs[3] @ ks[3], q @ k, rtol=1e-4, atol=1e-5)


def test_llama3_rope_scaling_stretches_low_frequencies_only():
    args = tiny_args(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                     rope_original_max_seq_len=64)
    D, T = args.head_dim, args.max_seq_len
    plain_cos, _ = rope_tables(D, T, args.rope_theta)
    cos, sin = rope_tables(D, T, args.rope_theta, args=args)
    assert torch.equal(cos[:, 0], plain_cos[:, 0])  # the highest frequency is kept
    plain_angle = torch.outer(torch.arange(T, dtype=torch.float32), torch.tensor([500000.0 ** (-(D - 2) / D)]))
    torch.testing.assert_close(torch.atan2(sin[:, -1], cos[:, -1]), (plain_angle[:, 0] / 8.0))  # lowest / factor


def test_explicit_head_dim_and_norm_eps():
    args = tiny_args(head_dim=32, norm_eps=1e-6)
    model = Transformer(args)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 32, args.dim)
    assert model.layers["0"].attention.wo.weight.shape == (args.dim, 4 * 32)
    assert model.norm.eps == 1e-6 and numel(model) == count_params(args)
    assert model(tokens(1, 8)).shape == (1, 8, VOCAB)
    with pytest.raises(UserError, match="head_dim=7 must be even"):
        tiny_args(head_dim=7)
    with pytest.raises(UserError, match="rope_scaling: 'yarn'"):
        tiny_args(rope_scaling="yarn")


def test_rope_bf16_keeps_dtype():
    cos, sin = rope_tables(8, 4, 10000.0)
    x = torch.randn(1, 4, 2, 8).to(torch.bfloat16)
    assert apply_rope(x, cos, sin).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- learning

def test_overfits_one_batch():
    torch.manual_seed(0)
    model = tiny_model(seed=0)
    x = tokens(4, 33, seed=1)
    inp, tgt = x[:, :-1], x[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(400):
        loss = F.cross_entropy(model(inp).flatten(0, 1), tgt.flatten())
        first = first if first is not None else loss.item()
        if loss.item() < 0.1:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert first > 3.5  # about ln(65) at init
    assert loss.item() < 0.1
