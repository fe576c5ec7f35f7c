"""Hugging Face in and out.

Import: `model.init_from = "hf:PATH"` trains a transformers Llama / Mistral / Mixtral folder (config.json,
safetensors, tokenizer.json): the architecture comes from config.json (arch.py), the weights are read straight
onto whatever layout the run uses, each rank reading only its shards (load.py), the dataset is tokenized with
the folder's tokenizer, and the optimizer starts fresh at step 0.
Export: `paratrain export RUN_DIR --format hf --out DIR` or `checkpoint.export_hf = true` writes a folder that
`AutoModelForCausalLM.from_pretrained` loads (export.py, tokenizer.py).

The functions below are the trainer's only contact with this package.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paratrain.errors import ConfigError, UserError
from paratrain.hf.arch import architecture, family_mismatch, is_hf_folder, mixtral_mismatch

# Model keys an imported model may still set: how it is trained, not what it computes.
TRAINING_KEYS = ("max_seq_len", "moe_aux_loss_coef", "moe_capacity_factor")
_IGNORED_KEYS = ("preset", "init_from")


def init_folder(cfg) -> Path | None:
    """The Hugging Face folder of `model.init_from = "hf:PATH"`, or None."""
    source = cfg.model.init_from
    return Path(source[3:]).expanduser() if source.startswith("hf:") else None


def model_args(cfg):
    """ModelArgs of the imported model (config.json), with the training-only keys the run sets; any other
    model key that disagrees with config.json is a ConfigError. The weights are checked against it too."""
    from paratrain.data.tokenizers import HFTokenizer
    from paratrain.hf.load import check_tokenizer_fits, checked_weights, hf_model_args

    folder = init_folder(cfg)
    args = hf_model_args(folder)
    checked_weights(folder, args)  # names, shapes, complete files: from the headers, before anything starts
    if (folder / "tokenizer.json").is_file():  # every id the dataset will hold has an embedding row
        check_tokenizer_fits(HFTokenizer.from_file(folder / "tokenizer.json"), args, folder / "tokenizer.json")
    changes = {}
    for key, value in vars(cfg.model).items():
        if value is None or key in _IGNORED_KEYS:
            continue
        if key in TRAINING_KEYS:
            changes[key] = value
        elif getattr(args, key, None) != value:
            raise ConfigError(f"model.{key}={value} conflicts with model.init_from ({folder / 'config.json'} has "
                              f"{getattr(args, key, None)}); an imported model keeps its architecture")
    return dataclasses.replace(args, **changes)


def check_run(cfg, args) -> None:
    """Before launch: an export at the end must be possible."""
    if cfg.checkpoint.export_hf:
        why = family_mismatch(args) or (args.moe_experts and mixtral_mismatch(args))
        if why:
            raise ConfigError(f"checkpoint.export_hf: model {cfg.model.init_from or cfg.model.preset} has {why}")


def dataset_tokenizer(cfg) -> Path:
    """The tokenizer.json the dataset of an imported model is tokenized with: the folder's own."""
    from paratrain.hf.load import hf_tokenizer_file

    path = hf_tokenizer_file(init_folder(cfg))
    chosen = cfg.data.tokenizer
    if chosen is not None and (not chosen.endswith(".json") or Path(chosen).resolve() != path.resolve()):
        raise ConfigError(f"data.tokenizer={chosen} conflicts with model.init_from: an imported model reads the "
                          f"ids of its own tokenizer ({path}); leave data.tokenizer unset")
    return path


def check_dataset(cfg, data_dir) -> None:
    """The prepared dataset was made with the imported model's tokenizer (an older one in data.dir is not)."""
    import tokenizers as hf

    from paratrain.data import load_tokenizer

    path = dataset_tokenizer(cfg)
    tok = load_tokenizer(data_dir)
    if not hasattr(tok, "tok") or tok.tok.to_str() != hf.Tokenizer.from_file(str(path)).to_str():
        raise UserError(f"data.dir={data_dir} was prepared with another tokenizer ({tok.kind}); model.init_from "
                        f"needs {path}: choose another data.dir, or run paratrain prepare --tokenizer {path} "
                        f"--out {data_dir} --overwrite")


def load_initial_weights(model, cfg, args) -> Path:
    from paratrain.hf.load import load_hf_weights

    folder = init_folder(cfg)
    load_hf_weights(model, folder, args)
    return folder


def export_final(cfg, rank: int, world: int) -> Path:
    """`checkpoint.export_hf`: the final checkpoint as RUN_DIR/hf (every rank calls this)."""
    from paratrain.hf.export import export_at_end

    ckpt = cfg.run_dir / "checkpoints" / f"step-{cfg.training.steps}"
    return export_at_end(ckpt, cfg.run_dir / "hf", cfg.checkpoint.export_hf_dtype, rank, world)


def main_export(argv: list[str]) -> int:
    from paratrain.hf.export import main_export as run

    return run(argv)


__all__ = ["architecture", "init_folder", "model_args", "check_run", "dataset_tokenizer", "check_dataset", "load_initial_weights",
           "export_final", "main_export"]
