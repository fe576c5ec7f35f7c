"""Multi-head latent attention (the "deepseek" family, models/deepseek.py): its table is the module, its logits are
transformers' DeepseekV3ForCausalLM's, its parallel layouts match one process, the estimator reads its shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.models.presets import count_params, preset_args
from paratrain.models.registry import build_model, parameters

VOCAB = 65


def test_parameter_table_is_the_module():
    args = preset_args("tiny-mla", vocab_size=VOCAB)
    model = build_model(args)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in parameters(args)]
    direct = preset_args("tiny-mla", vocab_size=VOCAB, mla_q_lora_rank=0)  # q projected directly: q_proj
    assert [n for n, _ in build_model(direct).named_parameters()] == [p.name for p in parameters(direct)]
    assert any(p.name.endswith("attention.q_proj.weight") for p in parameters(direct))


@pytest.mark.parametrize("change, message", [
    (dict(head_dim=16), "model.head_dim=16 must equal model.mla_qk_rope_head_dim=8"),
    (dict(mla_kv_lora_rank=0), "needs model.mla_kv_lora_rank >= 1"),
    (dict(n_kv_heads=2), "model.n_kv_heads=2 must equal model.n_heads=4"),
])
def test_impossible_dimensions_are_one_line(change, message):
    from paratrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parameters(preset_args("tiny-mla", vocab_size=VOCAB, **change))


def hf_config(q_lora_rank):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True, tie_word_embeddings=False,
        attn_implementation="eager")


def to_hf_state(model, args) -> dict:
    """Our weights under transformers' names: DEEPSEEK_HF for all but the routed experts, which transformers 5 holds
    fused per layer (gate_up_proj (E, 2H, C), down_proj (E, C, H))."""
    from paratrain.models.deepseek_params import DEEPSEEK_HF

    out = {}
    for name, p in model.named_parameters():
        if name in DEEPSEEK_HF.top:
            out[DEEPSEEK_HF.top[name]] = p
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{i}."
        if rest.startswith("feed_forward.experts."):
            continue
        out[prefix + DEEPSEEK_HF.block[rest]] = p
    for i, block in model.layers.items():
        if args.is_moe_layer(int(i)):
            e = block.feed_forward.experts
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat((e.w1, e.w3), -1).transpose(1, 2)
            out[f"model.layers.{i}.mlp.experts.down_proj"] = e.w2.transpose(1, 2)
    return out


@pytest.mark.parametrize("q_lora", [32, 0])
def test_logits_equal_transformers(q_lora):
    """fp32, a tiny random DeepseekV3ForCausalLM (n_group 1, routed_scaling_factor 1, no MTP), dense then MoE."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    args = preset_args("tiny-mla", vocab_size=VOCAB, mla_q_lora_rank=q_lora)
    ours = build_model(args)
    for name, p in ours.named_parameters():
        torch.nn.init.normal_(p, 1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else 0.05)
    hf = DeepseekV3ForCausalLM(hf_config(q_lora or None)).eval()
    state = to_hf_state(ours, args)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("e_score_correction_bias" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # packed documents: a window holding two documents is each document on its own
    positions = torch.cat((torch.arange(10), torch.arange(14)))[None].repeat(2, 1)
    with torch.no_grad():
        packed = ours(tokens, positions=positions)
        second = hf(tokens[:, 10:]).logits
    torch.testing.assert_close(packed[:, 10:], second, rtol=0, atol=1e-5)


def test_verify_rows_pass(char_data):
    """`paratrain verify`'s MLA rows within 1e-5 of one process: here tp2 + sp and cp2 (tp2 fails, 6e-5, if the rotary
    key's gradient is not summed over the tp ranks: role "shared_key"); MLA on fsdp2, tp2, pp2-1f1b, ep2 and ep2 x tp2
    is the DeepSeek journey's verify (tests/test_journeys.py, tiny-deepseek)."""
    from paratrain.models.deepseek_params import FAMILY
    from test_distributed import check_matrix

    rows_here = ["mla-tp2+sp", "mla-cp2"]
    assert set(rows_here) < set(FAMILY.verify_rows)
    check_matrix(rows_here, char_data, steps=4)


def test_presets_and_the_estimators_shape():
    """deepseek-v3-671b has the published counts; the estimator reads MLA's widths from the family (FLOPs of its
    attention term, the saved latents), and a plan of it ranks layouts with expert parallelism."""
    from paratrain.estimate import activations as A
    from paratrain.estimate.step_time import attention_gemms
    from paratrain.layout import Layout
    from paratrain.models.presets import count_active_params, flops_per_token

    with_mtp = preset_args("deepseek-v3-671b")
    v3 = dataclasses.replace(with_mtp, mtp_depth=0)  # the published counts are the main model's
    assert count_params(v3) == 671_026_404_352 and count_active_params(v3) == 37_552_282_624
    # the MTP module (published: 14B with its copies of the embedding and the head, which paratrain shares)
    assert count_params(with_mtp) - count_params(v3) == 11_610_067_968
    assert flops_per_token(v3, 4096) == 6 * count_active_params(v3, include_embedding=False) + 12 * 61 * 128 * (192 + 128) // 2 * 4096
    # per tp rank: q_a and kv_a whole, q_b and kv_b split by heads, o_proj's input split
    assert attention_gemms(v3, 2) == ((7168, 1536), (1536, 128 * 192 / 2), (7168, 576), (512, 128 * 256 / 2),
                                      (128 * 128 / 2, 7168))
    d = A.act_dims(v3, Layout(tp=2), "bf16", "measured", 1, 4096)
    assert (d.Hq, d.Hkv, d.D, d.Dv, d.Do, d.rope_D, d.latents) == (64, 64, 192, 192, 128, 64, (1536, 512))
    names = [n for n, _ in A.attention_saved(d)]
    assert "latent 1536 up-projection input" in names and "output projection input" in names


def test_plan_ranks_expert_parallel_layouts(capsys):
    from paratrain.cli import main

    assert main(["plan", "--model", "deepseek-v3-671b", "--gpus", "1024", "--gpus-per-node", "8", "--gpu", "H100",
                 "--no-write", "--top", "3"]) in (0, None)
    ranked = [line for line in capsys.readouterr().out.splitlines() if line.split(" ", 2)[1:2] in (["1"], ["2"], ["3"])]
    assert ranked and all("ep=" in line for line in ranked), ranked
