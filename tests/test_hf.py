"""Hugging Face in and out: export to transformers, import from it on several layouts, round trips, bad input.

Every Hugging Face model here is a tiny random one made with transformers' config classes and saved into
tmp_path, with a small byte-level BPE tokenizer trained on the bundled corpus: no network.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.data import DEFAULT_CORPUS  # noqa: E402
from paratrain.errors import UserError  # noqa: E402

from conftest import fast_config, fast_overrides  # noqa: E402

HF_VOCAB = 304  # the tokenizer below has 300 ids: the model's vocabulary is larger, as in many HF models
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


# ---------------------------------------------------------------------------- making Hugging Face folders

def save_tokenizer(folder) -> None:
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([DEFAULT_CORPUS.read_text()[:20000]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


def _save_random(folder, config_cls, model_cls, seed: int, dtype, fields: dict, changes: dict):
    torch.manual_seed(seed)
    model_cls(config_cls(**{**fields, **changes})).to(dtype).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def make_llama(folder, tied: bool = False, dtype=torch.float32, **config):
    """A random HF Llama: GQA, head_dim != hidden / heads, rms eps 1e-6, Llama 3.1 rope scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  max_position_embeddings=64, tie_word_embeddings=tied, rope_theta=500000.0,
                  rope_scaling=dict(LLAMA3_ROPE))
    return _save_random(folder, LlamaConfig, LlamaForCausalLM, 0, dtype, fields, config)


def make_mixtral(folder, dtype=torch.float32, **config):
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = dict(vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64)
    return _save_random(folder, MixtralConfig, MixtralForCausalLM, 1, dtype, fields, config)


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def safetensors_of(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"tied": make_llama(root / "llama-tied", tied=True),
            "untied": make_llama(root / "llama-untied", tied=False),
            "mixtral": make_mixtral(root / "mixtral")}


def assert_readable(folder) -> None:
    for f in folder.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


# ---------------------------------------------------------------------------- the model matches transformers

@pytest.mark.parametrize("name", ["tied", "untied", "mixtral"])
def test_imported_logits_equal_transformers(hf_models, name):
    """HF -> paratrain: the rotary layout, head_dim, eps, llama3 rope scaling and the Mixtral block agree."""
    from paratrain.hf.load import load_hf_model

    model, args, tok = load_hf_model(hf_models[name])
    assert args.vocab_size == HF_VOCAB and args.head_dim == 16 and tok.vocab_size == 300
    if name != "mixtral":
        assert args.norm_eps == 1e-6 and args.rope_scaling == "llama3" and args.tie_embeddings == (name == "tied")
    x = torch.randint(0, HF_VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(hf_models[name])(x).logits, rtol=0, atol=1e-5)


def test_paratrain_to_transformers_logits_equal(tmp_path):
    """paratrain -> HF by name (no permutation of q/k rows): a random paratrain model's weights under their
    Hugging Face names give transformers the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from paratrain.hf.arch import hf_config_from_args
    from paratrain.hf.names import pieces
    from paratrain.models import Transformer, preset_args
    from paratrain.distributed.initialize import init_weights

    args = preset_args("tiny", vocab_size=128, rope_scaling="llama3", rope_original_max_seq_len=32, norm_eps=1e-6)
    model = Transformer(args)
    init_weights(model, 3)
    config = {k: v for k, v in hf_config_from_args(args, 128, "fp32", None, None).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    params = dict(model.named_parameters())
    hf.load_state_dict({p.hf: params[p.param] for p in pieces(args)}, strict=True)
    x = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_llama3_presets_round_trip_through_config_json():
    from paratrain.hf.arch import args_from_hf_config, hf_config_from_args
    from paratrain.models import count_params, preset_args

    for name in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "mixtral-8x7b"):
        args = preset_args(name)
        assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(args, args.vocab_size, "bf16", 1, 2)))) == args
    assert preset_args("llama3.2-1b").rope_scaling_factor == 32.0
    assert preset_args("llama3.1-8b").rope_scaling_factor == 8.0
    assert count_params(preset_args("llama3.2-1b")) == 1_235_814_400
    assert count_params(preset_args("llama3-8b")) == 8_030_261_248


# ---------------------------------------------------------------------------- export

def check_exported(folder, model, tokenizer, vocab: int) -> None:
    """transformers loads `folder`; logits equal paratrain's forward; 20 greedy tokens are identical (over the exported
    `vocab` rows: an imported model keeps rows beyond its tokenizer's ids, which transformers may pick)."""
    from transformers import AutoTokenizer

    from paratrain.generate import sample

    assert_readable(folder)
    hf = hf_model(folder)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    assert hf.config.vocab_size == vocab
    prompt = "ROMEO: But soft, what light"
    ids = tokenizer.encode(prompt)
    assert hf_tok(prompt)["input_ids"] == ids
    assert hf_tok.decode(ids) == prompt
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[..., :vocab], rtol=0, atol=1e-4)
        greedy = hf.generate(x, max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    ours = sample(model, ids, 20, 64, temperature=0.0, vocab_limit=vocab)
    assert len(greedy) >= 1 and ours[:len(greedy)] == greedy  # transformers stops early at EOS, if ever


def test_export_dense_loads_in_transformers(trained_run, tmp_path):
    from paratrain.inference import load_for_generation

    out = tmp_path / "hf"
    assert main(["export", str(trained_run), "--format", "hf", "--out", str(out), "--dtype", "fp32"]) == 0
    model, tokenizer, args, _ = load_for_generation(trained_run)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == tokenizer.vocab_size
    assert args.vocab_size > tokenizer.vocab_size  # the padded rows are trimmed
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"} <= \
        {f.name for f in out.iterdir()}
    check_exported(out, model, tokenizer, tokenizer.vocab_size)


def test_export_mixtral_sharded_at_end_of_training(char_data, tmp_path):
    """A Mixtral-compatible MoE (no shared expert, no dense layer) exported by checkpoint.export_hf, and again
    by the command line in several shards with an index."""
    from paratrain.inference import load_for_generation
    from paratrain.api import train_rank as train

    cfg = fast_config(char_data, tmp_path, "moe", "model.preset=tiny-moe", "model.moe_shared_experts=0",
                      "model.moe_first_dense_layers=0", "training.steps=3", "checkpoint.export_hf=true",
                      "checkpoint.export_hf_dtype=fp32")
    run = train(cfg).run_dir
    model, tokenizer, _, _ = load_for_generation(run)
    assert json.loads((run / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    check_exported(run / "hf", model, tokenizer, tokenizer.vocab_size)

    sharded = tmp_path / "sharded"
    assert main(["export", str(run), "--format", "hf", "--out", str(sharded), "--dtype", "fp32",
                 "--max-shard-size", "100KB"]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in sharded.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert all(f.stat().st_size <= 100_000 + 10_000 for f in sharded.glob("*.safetensors"))  # + header
    check_exported(sharded, model, tokenizer, tokenizer.vocab_size)


def test_export_from_pipeline_layout(char_data, tmp_path):
    """checkpoint.export_hf from a pp=2 run (2 ranks, each writing part of the export)."""
    from paratrain.api import run_rank
    from paratrain.distributed.launch import launch
    from paratrain.inference import load_for_generation

    cfg = fast_config(char_data, tmp_path, "pp", "parallel.pp=2", "training.steps=2", "checkpoint.export_hf=true",
                      "checkpoint.export_hf_dtype=fp32", "parallel.pp_schedule=gpipe")
    launch(run_rank, (cfg,), 2)
    model, tokenizer, _, _ = load_for_generation(cfg.run_dir)
    check_exported(cfg.run_dir / "hf", model, tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_byte_and_char_tokenizers_as_tokenizers_models(tmp_path, kind):
    from transformers import AutoTokenizer

    from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer
    from paratrain.hf.tokenizer import write_tokenizer

    text = "Héllo, wörld!\n\n  tabs\tand 😀 newlines\n"
    tok = ByteTokenizer() if kind == "byte" else CharTokenizer.from_text(text)
    write_tokenizer(tok, tmp_path, 256)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ids = hf(text)["input_ids"]
    expected = tok.encode(text)
    if getattr(tok, "bos_id", None) is not None:
        expected = [tok.bos_id] + expected
    assert ids == expected
    assert hf.decode(tok.encode(text)) == text
    if getattr(tok, "eos_id", None) is not None:
        assert hf.eos_token_id == tok.eos_id


# ---------------------------------------------------------------------------- import and train

def hf_first_loss(folder, data_dir, global_batch: int, seq_len: int = 32, seed: int = 1337) -> float:
    from paratrain.data.loader import TokenData

    x, y = TokenData(data_dir, "train", seq_len).global_batch(0, global_batch, seed)
    with torch.no_grad():
        logits = hf_model(folder)(x.long()).logits
    return F.cross_entropy(logits.flatten(0, 1), y.long().flatten()).item()


IMPORT_CASES = [
    ("tied", 1, []),
    ("tied", 2, ["parallel.dp_mode=fsdp"]),
    ("untied", 1, []),
    ("untied", 2, ["parallel.tp=2"]),
    ("mixtral", 1, []),
    ("mixtral", 2, ["parallel.dp_mode=fsdp"]),
    ("mixtral", 2, ["parallel.tp=2"]),
    ("mixtral", 2, ["parallel.ep=2"]),
    ("untied", 2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
]


@pytest.mark.parametrize("name, nproc, layout", IMPORT_CASES,
                         ids=[f"{n}-{'x'.join(l) or 'one'}" for n, _, l in IMPORT_CASES])
def test_imported_model_trains_from_transformers_loss(hf_models, tmp_path_factory, name, nproc, layout):
    """model.init_from=hf:PATH: the first step's loss is transformers' loss on the same batch, on one
    process and on fsdp2 / tp2 / ep2 / pp2 (each rank reading only its shards); training then moves on."""
    from paratrain.api import run_rank
    from paratrain.distributed.launch import launch
    from paratrain.api import train_rank as train

    out = tmp_path_factory.mktemp("runs")
    data = out / "data"
    cfg = fast_config(data, out, "ft", f"model.init_from=hf:{hf_models[name]}", "training.steps=2",
                      "checkpoint.save_final=false", *[f"{o}" for o in layout])
    result = train(cfg) if nproc == 1 else launch(run_rank, (cfg,), nproc)
    assert len(result.losses) == 2 and result.losses[1] != result.losses[0]
    data_parallel = nproc if ("fsdp" in str(layout) or "ep" in str(layout)) else 1
    expected = hf_first_loss(hf_models[name], data, cfg.training.micro_batch * data_parallel)
    assert abs(result.losses[0] - expected) <= 1e-4, (result.losses[0], expected)


def test_round_trip_is_bitwise(tmp_path):
    """HF (bf16, tied, llama3 rope) -> paratrain checkpoint (one step at lr 1e-30 changes no bit) -> HF: every
    tensor, the config and the tokenizer files are identical; the Mixtral experts survive unstacking too."""
    from paratrain.api import train_rank as train

    for name, folder, dtype in (("llama", make_llama(tmp_path / "llama", tied=True, dtype=torch.bfloat16), "bf16"),
                                ("mixtral", make_mixtral(tmp_path / "mixtral"), "fp32")):
        cfg = fast_config(tmp_path / f"data-{name}", tmp_path / "runs", name, f"model.init_from=hf:{folder}",
                          "training.steps=1", "optimizer.lr=1e-30", "optimizer.min_lr=0", "training.eval_every=0")
        train(cfg)
        out = tmp_path / f"{name}-out"
        assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(out), "--dtype", dtype]) == 0
        before, after = safetensors_of(folder), safetensors_of(out)
        assert before.keys() == after.keys()
        for key in before:
            assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
        assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
        a, b = hf_model(folder).config.to_dict(), hf_model(out).config.to_dict()
        for key in ("vocab_size", "hidden_size", "head_dim", "rms_norm_eps", "rope_parameters", "rope_scaling",
                    "tie_word_embeddings", "num_key_value_heads", "num_local_experts", "eos_token_id"):
            assert a.get(key) == b.get(key), key


def test_generate_from_a_hugging_face_folder(hf_models, capsys):
    assert main(["generate", "--checkpoint", str(hf_models["untied"]), "--prompt", "ROMEO:",
                 "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")


# ---------------------------------------------------------------------------- bad input

def _fails(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def _train_argv(char_data, tmp_path, *extra):
    return ["train", *[f"--{o}" for o in fast_overrides(char_data, tmp_path, "bad", *extra)]]


def _hf_variant(tmp_path, hf_models, name="untied", **config_changes):
    import shutil

    folder = tmp_path / "variant"
    shutil.copytree(hf_models[name], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"architectures": ["GPTNeoXForCausalLM"]}, "architecture GPTNeoXForCausalLM is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
    ({"intermediate_size": 80}, "has shape [96, 48] in model.safetensors, but config.json implies [80, 48]"),
    ({"num_hidden_layers": 3}, "tensor model.layers.2.input_layernorm.weight is missing"),
])
def test_unrepresentable_or_inconsistent_folder(char_data, tmp_path, hf_models, capsys, change, message):
    folder = _hf_variant(tmp_path, hf_models, **change)
    _fails(capsys, _train_argv(char_data, tmp_path, f"model.init_from=hf:{folder}"), message)
    assert not (tmp_path / "bad").exists()


def test_folder_without_config_json(char_data, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _fails(capsys, _train_argv(char_data, tmp_path, f"model.init_from=hf:{tmp_path / 'empty'}"), "no config.json")
    _fails(capsys, ["generate", "--checkpoint", str(tmp_path / "empty")], "not a paratrain checkpoint")
    assert not (tmp_path / "bad").exists()


def test_truncated_shard(char_data, tmp_path, hf_models, capsys):
    folder = _hf_variant(tmp_path, hf_models)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    _fails(capsys, _train_argv(char_data, tmp_path, f"model.init_from=hf:{folder}"), "truncated shard")
    _fails(capsys, ["generate", "--checkpoint", str(folder)], "truncated shard")
    assert not (tmp_path / "bad").exists()


def test_hugging_face_folder_passed_to_resume(char_data, tmp_path, hf_models, capsys):
    _fails(capsys, _train_argv(char_data, tmp_path, f"checkpoint.resume={hf_models['tied']}"),
           f"start a run from it with --model.init_from=hf:{hf_models['tied']}")


@pytest.mark.parametrize("extra, message", [
    (["model.dim=64"], "model.dim=64 conflicts with model.init_from"),
    (["data.tokenizer=bpe"], "data.tokenizer=bpe conflicts with model.init_from"),
    (["parallel.tp=2"], "vocab size 301 is not divisible by parallel.tp=2"),
])
def test_import_settings_checked_before_anything_is_written(tmp_path, hf_models, extra, message):
    from paratrain.errors import ConfigError
    from paratrain.spec import resolve_run

    folder = make_llama(tmp_path / "odd", vocab_size=301) if "parallel.tp=2" in extra else hf_models["untied"]
    cfg = fast_config(tmp_path / "data", tmp_path, "bad", f"model.init_from=hf:{folder}", *extra)
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, 2 if "parallel.tp=2" in extra else 1)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "data").exists() and not (tmp_path / "bad").exists()


def test_imported_model_is_read_once_per_process(tmp_path, hf_models, monkeypatch):
    """spec.check reads the folder (config.json, weights' headers, tokenizer) once; what follows receives the parts:
    the source's dimensions, its tokenizer for the data, its folder for the initial weights."""
    import paratrain.hf.load as load
    from paratrain.spec import check, resolve

    reads = []
    real = load.hf_model_args
    monkeypatch.setattr(load, "hf_model_args", lambda folder: reads.append(folder) or real(folder))
    folder = hf_models["untied"]
    parts = check(fast_config(tmp_path / "data", tmp_path, "once", f"model.init_from=hf:{folder}"), 1)
    spec = resolve(parts, {"vocab_size": 1, "dir": str(folder)})
    assert reads == [folder]
    assert spec.source.hf_folder == folder and spec.model_args == parts.source.args()
    assert parts.data.model_tokenizer == folder / "tokenizer.json"
    assert spec.model_name == f"hf:{folder} (LlamaForCausalLM)"


def test_moe_without_mixtral_counterpart(char_data, tmp_path, capsys):
    """tiny-moe (a shared expert, a dense first layer) cannot be a MixtralForCausalLM: refused by export, and
    by checkpoint.export_hf before training."""
    from paratrain.api import train_rank as train

    _fails(capsys, _train_argv(char_data, tmp_path, "model.preset=tiny-moe", "checkpoint.export_hf=true"),
           "1 shared expert(s), 1 dense first layer(s)")
    assert not (tmp_path / "bad").exists()
    run = train(fast_config(char_data, tmp_path, "moe", "model.preset=tiny-moe", "training.steps=1")).run_dir
    _fails(capsys, ["export", str(run), "--format", "hf", "--out", str(tmp_path / "out")],
           "cannot be exported as a Hugging Face model: it has 1 shared expert(s)")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_export_refuses_a_non_empty_out(trained_run, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails(capsys, ["export", str(trained_run), "--format", "hf", "--out", str(tmp_path / "out")], "is not empty")
    assert [f.name for f in (tmp_path / "out").iterdir()] == ["keep.txt"]
    with pytest.raises(UserError, match="cannot read"):
        from paratrain.training.export import parse_size

        parse_size("five")


def test_run_header_names_the_imported_model(hf_models, tmp_path, capsys):
    """The training header and the memory estimate name the Hugging Face folder and its architecture, with the
    parameter count transformers gives (M units), not the unused preset's name."""
    from paratrain.api import train_rank as train
    from paratrain.models import format_params

    folder = hf_models["untied"]
    cfg = fast_config(tmp_path / "data", tmp_path, "ft", f"model.init_from=hf:{folder}", "training.steps=1",
                      "checkpoint.save_final=false", "metrics.progress=lines")
    train(cfg)
    out = capsys.readouterr().out
    n = hf_model(folder).num_parameters()
    name = f"hf:{folder} (LlamaForCausalLM)"
    assert f"model {name}: {format_params(n)} parameters |" in out and format_params(n).endswith("M")
    table = (cfg.run_dir / "memory-estimate.txt").read_text()  # the memory estimate's table
    assert f"model {name}: {format_params(n)} parameters ({n:,})" in table
    assert "shakespeare-char" not in out
