"""DeepSeek-V3 in and out of Hugging Face: multi-head latent attention (with and without the query latent), sigmoid
top-k routing within the best groups chosen with the per-expert bias (e_score_correction_bias), renormalised and
scaled gates, an ungated shared expert, dense first blocks. Logits and greedy tokens equal transformers', the export
loads in transformers without warnings, the round trip is bitwise, and what paratrain cannot represent is refused in
one line.

The Hugging Face model is a tiny random one (norm gains and the routing bias perturbed, so they matter), saved in fp32
with test_hf's byte-level BPE tokenizer: no network.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.errors import UserError  # noqa: E402

from conftest import fast_config  # noqa: E402
from test_hf import HF_VOCAB, check_exported, hf_first_loss, hf_model, safetensors_of, save_tokenizer  # noqa: E402
from test_qwen2_moe import _load_without_warnings, assert_matches_transformers  # noqa: E402

CONFIG = dict(vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, rope_theta=1e4, rms_norm_eps=1e-6, num_hidden_layers=3,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
              topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=24,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, bos_token_id=None,
              eos_token_id=None)


def make_deepseek(folder, **changes):
    torch.manual_seed(5)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**CONFIG, **changes}))
    with torch.no_grad():  # transformers starts norm gains at 1 and the routing bias at 0
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(0.1 * torch.randn_like(p))
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-v3")
    return {"latent-q": make_deepseek(root / "latent-q"), "direct-q": make_deepseek(root / "direct-q", q_lora_rank=None)}


@pytest.mark.parametrize("name", ["latent-q", "direct-q"])
def test_logits_and_greedy_tokens_equal_transformers(folders, name):
    from paratrain.hf.load import load_hf_model

    model, args, tok = load_hf_model(folders[name])
    assert args.family == "deepseek" and args.moe_score_func == "sigmoid" and args.moe_expert_bias
    assert (args.moe_n_group, args.moe_topk_group, args.moe_routed_scaling_factor) == (4, 2, 2.5)
    assert args.moe_shared_experts == 1 and not args.moe_shared_gate and args.moe_first_dense_layers == 1
    assert args.mla_q_lora_rank == (24 if name == "latent-q" else 0) and args.head_dim == 4
    bias = model.layers["1"].feed_forward.expert_bias
    assert bias.abs().sum() > 0  # the checkpoint's routing bias, not zeros
    assert_matches_transformers(model, tok, folders[name])


def test_import_train_export(folders, tmp_path):
    """transformers' loss at the first step, training moves on (the routing bias too, aux-free balancing being the
    default for a model with one), and the export loads in transformers without a warning, with paratrain's logits."""
    from paratrain.api import train_rank
    from paratrain.inference import load_for_generation

    folder, data = folders["latent-q"], tmp_path / "data"
    cfg = fast_config(data, tmp_path, "ds", f"model.init_from=hf:{folder}", "training.steps=2",
                      "checkpoint.export_hf=true", "checkpoint.export_hf_dtype=fp32", "moe.bias_update_rate=0.01")
    result = train_rank(cfg)
    assert abs(result.losses[0] - hf_first_loss(folder, data, cfg.training.micro_batch)) <= 1e-4
    assert result.losses[1] != result.losses[0]
    out = cfg.run_dir / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["n_group"] == 4
    hf = _load_without_warnings(out)
    model, tokenizer, args, _ = load_for_generation(cfg.run_dir)
    before = safetensors_of(folder)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not torch.equal(model.layers["1"].feed_forward.expert_bias, before)  # balanced while training
    x = torch.randint(0, HF_VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[..., :HF_VOCAB], rtol=0, atol=1e-5)
    check_exported(out, model, tokenizer, HF_VOCAB)


def test_round_trip_is_bitwise(folders, tmp_path):
    """HF -> paratrain checkpoint (one step at lr 1e-30, no balancing: no bit changes) -> HF: every tensor (the routing
    bias included) and the config fields paratrain maps."""
    from paratrain.api import train_rank

    folder = folders["direct-q"]
    cfg = fast_config(tmp_path / "data", tmp_path / "runs", "rt", f"model.init_from=hf:{folder}", "training.steps=1",
                      "optimizer.lr=1e-30", "optimizer.min_lr=0", "training.eval_every=0", "moe.balancing=aux_loss")
    train_rank(cfg)
    out = tmp_path / "out"
    assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(out), "--dtype", "fp32"]) == 0
    before, after = safetensors_of(folder), safetensors_of(out)
    assert before.keys() == after.keys() and "model.layers.2.mlp.gate.e_score_correction_bias" in after
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    a, b = hf_model(folder).config.to_dict(), hf_model(out).config.to_dict()
    for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "rms_norm_eps", "rope_parameters",
                "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "rope_interleave"):
        assert a.get(key) == b.get(key), key


def test_config_round_trip_and_refusals():
    from paratrain.hf.arch import args_from_hf_config, hf_config_from_args
    from paratrain.models import preset_args

    config = {**CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    args = args_from_hf_config(config)
    assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(args, HF_VOCAB, "fp32", None, None)))) == args
    for changes, message in (({"rope_interleave": False}, "rope_interleave=false is not supported"),
                             ({"n_group": 3}, "moe_n_group=3"),
                             ({"first_k_dense_replace": -1}, "first_k_dense_replace must be an integer from 0"),
                             ({"rope_scaling": {"type": "yarn", "factor": 40}}, "rope scaling 'yarn' is not supported")):
        with pytest.raises(UserError, match=message) as e:
            args_from_hf_config({**config, **changes})
        assert "\n" not in str(e.value)
    # what DeepSeek-V3 has no field for is refused on export, naming it
    for fields, message in ((dict(moe_expert_bias=False), "no routing bias"),
                            (dict(moe_shared_gate=True), "gated shared experts"),
                            (dict(moe_score_func="softmax"), "softmax routing")):
        with pytest.raises(UserError, match="cannot be exported") as e:
            hf_config_from_args(preset_args("tiny-deepseek", vocab_size=128, **fields), 128, "fp32", None, None)
        assert message in str(e.value) and "DeepseekV3ForCausalLM has sigmoid top-k routing" in str(e.value)
