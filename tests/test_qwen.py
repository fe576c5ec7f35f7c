"""The Qwen families: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, its own head_dim) and Qwen3-MoE imported from
transformers, trained on every layout from transformers' loss, exported back (logits, greedy tokens, bitwise round
trip), refused in one line where paratrain cannot represent them; the presets' published parameter counts.

The Hugging Face models are tiny random ones made with transformers' config classes (biases and norm gains
perturbed, so that they matter), saved in bf16 with test_hf's byte-level BPE tokenizer and its vocab.json/merges.txt.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.errors import UserError  # noqa: E402
from paratrain.models import build_model, count_active_params, count_params, parameters, preset_args  # noqa: E402

from conftest import fast_config  # noqa: E402
from test_hf import HF_VOCAB, check_exported, hf_first_loss, hf_model, safetensors_of, save_tokenizer  # noqa: E402

BASE = dict(vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6)
# name -> (config class, model class, fields, architecture, paratrain family)
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2), "qwen2"),
    # the small sizes' tied embeddings (which paratrain's tensor and pipeline parallelism refuse: 1 process and fsdp)
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True), "qwen2"),
    # head_dim 24 != hidden 48 / 4 heads, as in Qwen3 (128 whatever the width)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=24), "qwen3"),
    # attention_bias: q/k/v/o biases beside the q/k norms; block 1 keeps a dense MLP
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=4, attention_bias=True, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]), "qwen3-bias"),
}


def make_qwen(folder, name: str):
    config_cls, model_cls, fields, _ = ARCHS[name]
    torch.manual_seed(2)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **fields}))
    with torch.no_grad():  # transformers starts biases at 0 and norm gains at 1
        for key, p in model.named_parameters():
            if key.endswith("bias") or "norm" in key:
                p.add_(0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    save_tokenizer(folder)
    import tokenizers as tk

    tk.Tokenizer.from_file(str(folder / "tokenizer.json")).model.save(str(folder))  # vocab.json, merges.txt
    return folder


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return {name: make_qwen(root / name, name) for name in ARCHS}


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    """One dataset for all three folders: they share the tokenizer."""
    return tmp_path_factory.mktemp("qwen-data") / "data"


# ---------------------------------------------------------------------------- the families

@pytest.mark.parametrize("preset, family", [("tiny", "qwen2"), ("tiny-qwen3", "qwen3"), ("tiny-qwen3", "qwen3-bias"),
                                            ("tiny-qwen3-moe", "qwen3"), ("tiny-qwen3-moe", "qwen2")])
def test_parameter_table_is_the_module(preset, family):
    args = preset_args(preset, vocab_size=128, family=family)
    with torch.device("meta"):
        model = build_model(args)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in parameters(args)]
    assert count_params(args) == sum(p.numel() for p in model.parameters())
    roles = {p.name.split(".", 2)[2]: p.role for p in parameters(args) if p.layer == 0}
    if family != "qwen2":
        assert roles["attention.q_norm.weight"] == roles["attention.k_norm.weight"] == "head_norm"
    assert ("attention.wq.bias" in roles) == (family != "qwen3") and ("attention.wo.bias" in roles) == (
        family == "qwen3-bias")


# Published: the model cards' "Number of Parameters" (7.61B, 8.2B, 32.8B, 30.5B with 3.3B activated, 235B with 22B
# activated); exact: the official config.json shapes, counted by transformers itself below (Qwen2.5-7B's safetensors
# index says the same: 15,231,233,024 bf16 bytes).
PUBLISHED = {"qwen2.5-7b": (7_615_616_512, None), "qwen3-8b": (8_190_735_360, None),
             "qwen3-32b": (32_762_123_264, None), "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
             "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_the_published_counts(name):
    """The presets' counts, from the family's table, equal transformers' own count of the same config.json (a model
    built on the meta device), and the config survives paratrain -> config.json -> paratrain."""
    from paratrain.hf.arch import args_from_hf_config, hf_config_from_args

    args = preset_args(name)
    total, active = PUBLISHED[name]
    assert count_params(args) == total and count_active_params(args) == (active or total)
    config = hf_config_from_args(args, args.vocab_size, "bf16", 151643, 151645)
    assert args_from_hf_config(json.loads(json.dumps(config))) == args
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **{
        k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        hf = getattr(transformers, config["architectures"][0])(hf_config)
    assert hf.num_parameters() == total


def test_estimate_and_plan_print_the_published_counts(capsys):
    assert main(["estimate", "--model", "qwen3-8b"]) == 0
    assert "model qwen3-8b: 8.19B parameters (8,190,735,360)" in capsys.readouterr().out
    assert main(["estimate", "--model", "qwen3-30b-a3b"]) == 0
    assert ("model qwen3-30b-a3b: 30.53B parameters (30,532,122,624), 3.35B active per token (3,353,032,704)"
            in capsys.readouterr().out)
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "H100",
                 "--no-write", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parameters"] == 30_532_122_624 and plan["ranked"]


# ---------------------------------------------------------------------------- import, train, export

@pytest.mark.parametrize("name", ARCHS)
def test_import_train_export(qwen_models, qwen_data, tmp_path, name):
    """One process: transformers' loss at the first step, training moves on, and the export at the end loads in
    transformers with paratrain's logits and greedy tokens, keeping the tokenizer files byte for byte."""
    from paratrain.api import train_rank
    from paratrain.inference import load_for_generation

    folder, arch = qwen_models[name], ARCHS[name][1]
    cfg = fast_config(qwen_data, tmp_path, name, f"model.init_from=hf:{folder}", "training.steps=2",
                      "checkpoint.export_hf=true", "checkpoint.export_hf_dtype=fp32")
    result = train_rank(cfg)
    assert abs(result.losses[0] - hf_first_loss(folder, qwen_data, cfg.training.micro_batch)) <= 1e-4
    assert result.losses[1] != result.losses[0]
    out = cfg.run_dir / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    for file in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (out / file).read_bytes() == (folder / file).read_bytes(), file
    model, tokenizer, args, _ = load_for_generation(cfg.run_dir)
    assert args.family == ARCHS[name][3]
    check_exported(out, model, tokenizer, HF_VOCAB)


def test_round_trip_is_bitwise(qwen_models, qwen_data, tmp_path):
    """HF (bf16) -> paratrain checkpoint (one step at lr 1e-30 changes no bit) -> HF: every tensor and the tokenizer
    files identical, and the config fields paratrain maps."""
    from paratrain.api import train_rank

    for name, folder in qwen_models.items():
        cfg = fast_config(qwen_data, tmp_path / "runs", name, f"model.init_from=hf:{folder}", "training.steps=1",
                          "optimizer.lr=1e-30", "optimizer.min_lr=0", "training.eval_every=0")
        train_rank(cfg)
        out = tmp_path / f"{name}-out"
        assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(out), "--dtype", "bf16"]) == 0
        before, after = safetensors_of(folder), safetensors_of(out)
        assert before.keys() == after.keys()
        for key in before:
            assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), (name, key)
        for file in ("tokenizer.json", "vocab.json", "merges.txt"):
            assert (out / file).read_bytes() == (folder / file).read_bytes(), file
        a, b = hf_model(folder).config.to_dict(), hf_model(out).config.to_dict()
        for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "head_dim", "rms_norm_eps",
                    "rope_parameters", "tie_word_embeddings", "num_key_value_heads", "attention_bias", "num_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                    "decoder_sparse_step"):
            assert a.get(key) == b.get(key), (name, key)


def train_all_and_place(cfgs, args):
    """What each of the 2 launched ranks runs: every config one after the other in one process group (rank 0's
    results), then the tensor-parallel placements of `args` on these ranks."""
    from paratrain.api import run_rank

    import qkv_bias_family

    results = [run_rank(cfg, keep_group=True) for cfg in cfgs]
    return results, qkv_bias_family.tp_placements(args, group_up=True)


LAYOUTS = {"fsdp2": ["parallel.dp_mode=fsdp"], "tp2": ["parallel.tp=2"],
           "pp2": ["parallel.pp=2", "parallel.pp_schedule=gpipe"], "ep2": ["parallel.ep=2"]}
# Tensor and pipeline parallelism refuse tied embeddings, and paratrain's pipelines a mixture of experts.
CASES = [("qwen2", "fsdp2"), ("qwen2", "tp2"), ("qwen2", "pp2"), ("qwen2-tied", "fsdp2"), ("qwen3", "fsdp2"),
         ("qwen3", "tp2"), ("qwen3", "pp2"), ("qwen3-moe", "fsdp2"), ("qwen3-moe", "tp2"), ("qwen3-moe", "ep2")]


def test_imported_models_train_from_transformers_loss_on_two_ranks(qwen_models, qwen_data, tmp_path):
    """fsdp2, tp2, pp2 and (MoE) ep2, each rank reading only its shards: the first step's loss is transformers' on
    the same global batch; all in one launch of the ranks, which then show the tensor-parallel plan: biases split
    with their weights, o's bias and the q/k norms replicated (each rank normalises its own heads)."""
    from paratrain.api import launch_ranks

    cfgs = [fast_config(qwen_data, tmp_path, f"{name}-{layout}", f"model.init_from=hf:{qwen_models[name]}",
                        "training.steps=1", "training.eval_every=0", "checkpoint.save_final=false", *LAYOUTS[layout])
            for name, layout in CASES]
    results, placements = launch_ranks(train_all_and_place, (cfgs, preset_args("tiny-qwen3", vocab_size=128)), 2)
    for (name, layout), cfg, result in zip(CASES, cfgs, results):
        data_parallel = 2 if layout in ("fsdp2", "ep2") else 1
        expected = hf_first_loss(qwen_models[name], qwen_data, cfg.training.micro_batch * data_parallel)
        assert abs(result.losses[0] - expected) <= 1e-4, (name, layout, result.losses[0], expected)
    for sp in (False, True):
        got = {k.split(".", 2)[2]: v for k, v in placements[sp].items() if k.startswith("layers.1.")}
        for w in ("wq", "wk", "wv"):
            assert got[f"attention.{w}.weight"] == got[f"attention.{w}.bias"] == "S(0)"
        assert got["attention.wo.weight"] == "S(1)" and got["attention.wo.bias"] == "R"
        assert got["attention.q_norm.weight"] == got["attention.k_norm.weight"] == "R"


# ---------------------------------------------------------------------------- what paratrain cannot represent

def _qwen_config(name: str, **changes) -> dict:
    config_cls, _, fields, _ = ARCHS[name]
    config = getattr(transformers, config_cls)(**{**BASE, **fields}).to_dict()
    config["architectures"] = [ARCHS[name][1]]
    return {**config, **changes}


@pytest.mark.parametrize("name, changes, message", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true is not supported"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types 'sliding_attention' is not"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     "rope scaling 'yarn' is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported"),
    ("qwen3-moe", {"num_experts_per_tok": 1}, "num_experts_per_tok=1 with renormalised gates"),
    ("qwen3-moe", {"mlp_only_layers": [9]}, "mlp_only_layers must be a list of layer indices"),
    ("qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer"),
    ("qwen3", {"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
])
def test_unrepresentable_config_is_one_line(name, changes, message):
    from paratrain.hf.arch import args_from_hf_config

    with pytest.raises(UserError) as e:
        args_from_hf_config(_qwen_config(name, **changes))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_router_variants_map_exactly():
    """norm_topk_prob=false keeps the router's probabilities (top-1 then too); decoder_sparse_step makes blocks
    dense; and a model without a Qwen counterpart is refused on export, naming what it has."""
    from paratrain.hf.arch import args_from_hf_config, hf_config_from_args

    args = args_from_hf_config(_qwen_config("qwen3-moe", norm_topk_prob=False, num_experts_per_tok=1,
                                            decoder_sparse_step=2, mlp_only_layers=[]))
    assert not args.moe_norm_topk and args.moe_top_k == 1 and args.moe_dense_layers == (0, 2)
    assert hf_config_from_args(args, HF_VOCAB, "bf16", None, None)["mlp_only_layers"] == [0, 2]
    for changes, message in ((dict(moe_shared_experts=1), "1 shared expert(s)"),
                             (dict(moe_score_func="sigmoid"), "sigmoid routing")):
        with pytest.raises(UserError, match=re.escape(message)):
            hf_config_from_args(preset_args("tiny-qwen3-moe", vocab_size=128, **changes), 128, "bf16", None, None)
    with pytest.raises(UserError, match="no gated shared expert"):  # (Qwen2-MoE has one)
        hf_config_from_args(preset_args("tiny-qwen3-moe", vocab_size=128, family="qwen2"), 128, "bf16", None, None)
    with pytest.raises(UserError, match="dense blocks only in model family 'deepseek'"):  # (DeepSeek-V3 is an MoE)
        hf_config_from_args(preset_args("tiny-deepseek", vocab_size=128, moe_experts=0), 128, "bf16", None, None)


def test_refused_folder_on_the_command_line(qwen_models, tmp_path, capsys):
    folder = shutil.copytree(qwen_models["qwen2"], tmp_path / "window")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 16}))
    argv = ["train", "--model.init_from=hf:" + str(folder), f"--run.out_dir={tmp_path}", "--run.name=bad",
            f"--data.dir={tmp_path / 'data'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "use_sliding_window=true is not supported" in err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "data").exists()


def test_verify_rows_pass(char_data):
    """`paratrain verify`'s Qwen3-shaped rows: fsdp2, tp2+sp, pp2, cp2 and (Qwen3-MoE routing) ep2xfsdp2, within 1e-5
    of one process."""
    from paratrain.verify import QWEN_MATRIX, run_verify

    rows, _ = run_verify(QWEN_MATRIX, steps=4, tolerance=1e-5, extra_args=[f"data.dir={char_data}"],
                         echo=lambda line: None, share_launches=True)
    assert [r.layout for r in rows if r.passed] == QWEN_MATRIX, rows


def test_dense_layer_indices_are_checked():
    from paratrain.errors import ConfigError
    from paratrain.models.args import fields_problem

    with pytest.raises(ConfigError, match="model.moe_dense_layers: 7 is not a block of the 2-block model"):
        preset_args("tiny-qwen3-moe", vocab_size=128, moe_dense_layers=(7,))
    saved = {**vars(preset_args("tiny-qwen3-moe", vocab_size=128)), "moe_dense_layers": "1"}
    problem = fields_problem(saved, "model_args.")
    assert problem == "model_args.moe_dense_layers must be a list of layer indices, got '1'"
