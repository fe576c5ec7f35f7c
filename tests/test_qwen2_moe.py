"""Qwen2-MoE in and out of Hugging Face: q/k/v biases, softmax top-k routing with or without renormalised gates, one
sigmoid-gated shared expert (paratrain's n shared experts of the routed width with moe_shared_gate), dense blocks where
mlp_only_layers says. Logits and greedy tokens equal transformers', the export loads in transformers without warnings,
the round trip is bitwise, and what paratrain cannot represent is refused in one line.

The Hugging Face model is a tiny random one (biases, norm gains and the shared-expert gate perturbed, so they matter),
saved in fp32 with test_hf's byte-level BPE tokenizer: no network.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.errors import UserError  # noqa: E402

from conftest import fast_config  # noqa: E402
from test_hf import HF_VOCAB, check_exported, hf_first_loss, hf_model, safetensors_of, save_tokenizer  # noqa: E402

CONFIG = dict(vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6, num_hidden_layers=3,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
              norm_topk_prob=False, mlp_only_layers=[1])


def make_qwen2_moe(folder, **changes):
    torch.manual_seed(3)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**CONFIG, **changes}))
    with torch.no_grad():  # transformers starts biases at 0 and norm gains at 1
        for key, p in model.named_parameters():
            if key.endswith("bias") or "norm" in key or "shared_expert_gate" in key:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2-moe")
    return {"plain": make_qwen2_moe(root / "plain"), "renormalised": make_qwen2_moe(root / "renorm", norm_topk_prob=True)}


@pytest.mark.parametrize("name", ["plain", "renormalised"])
def test_logits_and_greedy_tokens_equal_transformers(folders, name):
    from paratrain.hf.load import load_hf_model

    model, args, tok = load_hf_model(folders[name])
    assert args.family == "qwen2" and args.moe_shared_experts == 2 and args.moe_shared_gate
    assert args.moe_norm_topk == (name == "renormalised") and args.moe_dense_layers == (1,)
    assert_matches_transformers(model, tok, folders[name])


def assert_matches_transformers(model, tok, folder) -> None:
    """paratrain's `model` (imported from `folder`) gives transformers' logits within 1e-5 and its 20 greedy tokens."""
    from paratrain.generate import sample

    hf = hf_model(folder)
    x = torch.randint(0, HF_VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
        ids = tok.encode("ROMEO: But soft")
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    assert sample(model, ids, 20, 64, temperature=0.0)[:len(greedy)] == greedy


def _load_without_warnings(folder):
    """transformers' model from `folder`, failing on any warning it logs or raises (missing or unexpected keys, config
    fields it does not know)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = hf_model(folder)
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]
    return model


def test_import_train_export(folders, tmp_path):
    """transformers' loss at the first step, training moves on, and the export loads in transformers without a
    warning, with paratrain's logits (1e-5) and greedy tokens."""
    from paratrain.api import train_rank
    from paratrain.inference import load_for_generation

    folder, data = folders["plain"], tmp_path / "data"
    cfg = fast_config(data, tmp_path, "q2m", f"model.init_from=hf:{folder}", "training.steps=2",
                      "checkpoint.export_hf=true", "checkpoint.export_hf_dtype=fp32")
    result = train_rank(cfg)
    assert abs(result.losses[0] - hf_first_loss(folder, data, cfg.training.micro_batch)) <= 1e-4
    assert result.losses[1] != result.losses[0]
    out = cfg.run_dir / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["shared_expert_intermediate_size"] == 64
    hf = _load_without_warnings(out)
    model, tokenizer, args, _ = load_for_generation(cfg.run_dir)
    x = torch.randint(0, HF_VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[..., :HF_VOCAB], rtol=0, atol=1e-5)
    check_exported(out, model, tokenizer, HF_VOCAB)


def test_round_trip_is_bitwise(folders, tmp_path):
    """HF -> paratrain checkpoint (one step at lr 1e-30 changes no bit) -> HF: every tensor (the shared expert and its
    gate included) and the config fields paratrain maps."""
    from paratrain.api import train_rank

    folder = folders["renormalised"]
    cfg = fast_config(tmp_path / "data", tmp_path / "runs", "rt", f"model.init_from=hf:{folder}", "training.steps=1",
                      "optimizer.lr=1e-30", "optimizer.min_lr=0", "training.eval_every=0")
    train_rank(cfg)
    out = tmp_path / "out"
    assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(out), "--dtype", "fp32"]) == 0
    before, after = safetensors_of(folder), safetensors_of(out)
    assert before.keys() == after.keys() and "model.layers.0.mlp.shared_expert_gate.weight" in after
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    a, b = hf_model(folder).config.to_dict(), hf_model(out).config.to_dict()
    for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "head_dim", "rms_norm_eps",
                "rope_parameters", "tie_word_embeddings", "num_key_value_heads", "qkv_bias", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "mlp_only_layers", "decoder_sparse_step", "sliding_window", "use_sliding_window"):
        assert a.get(key) == b.get(key), key


def test_config_round_trip_and_refusals():
    from paratrain.hf.arch import args_from_hf_config, hf_config_from_args
    from paratrain.models import preset_args

    config = {**CONFIG, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "sliding_window": 0,
              "use_sliding_window": False}
    args = args_from_hf_config(config)
    assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(args, HF_VOCAB, "fp32", None, None)))) == args
    for changes, message in (
            ({"shared_expert_intermediate_size": 48}, "shared_expert_intermediate_size=48 is not a multiple of "
                                                      "moe_intermediate_size=32"),
            ({"qkv_bias": False}, "qkv_bias=false is not supported"),
            ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true is not supported")):
        with pytest.raises(UserError, match=message) as e:
            args_from_hf_config({**config, **changes})
        assert "\n" not in str(e.value)
    # what Qwen2-MoE has no field for is refused on export, naming it
    for fields, message in ((dict(moe_shared_experts=0), "no gated shared expert"),
                            (dict(moe_shared_experts=1), "ungated shared experts"),
                            (dict(moe_shared_experts=1, moe_shared_gate=True, moe_n_group=2),
                             "group-limited routing (2 groups)"),
                            (dict(moe_shared_experts=1, moe_shared_gate=True, moe_routed_scaling_factor=2.5),
                             "routed gates scaled by 2.5")):
        args = preset_args("tiny-qwen3-moe", vocab_size=128, family="qwen2", **fields)
        with pytest.raises(UserError, match="cannot be exported") as e:
            hf_config_from_args(args, 128, "fp32", None, None)
        assert message in str(e.value) and "Qwen2MoeForCausalLM has softmax top-k routing with one sigmoid-gated " \
            "shared expert" in str(e.value)
