"""Hugging Face in and out.

Import: `model.init_from = "hf:PATH"` trains a transformers Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE
folder (config.json, safetensors, tokenizer.json): the architecture comes from config.json (arch.py, from the model
families' architectures), the weights are read straight onto whatever layout the run uses, each rank reading only
its shards (load.py), the dataset is tokenized with the folder's tokenizer, and the optimizer starts fresh at step 0.
Export: `paratrain export RUN_DIR --format hf --out DIR` or `checkpoint.export_hf = true` writes a folder that
`AutoModelForCausalLM.from_pretrained` loads (paratrain/training/export.py, which reads the checkpoint, and
tokenizer.py here; a LoRA checkpoint's adapters merged into its base); `--format peft` writes a LoRA checkpoint's
adapters as a PEFT adapter folder (paratrain/training/peft_export.py). This package is below `training`: it never
reads a paratrain checkpoint.

The functions below are the trainer's only contact with this package.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paratrain.errors import ConfigError, UserError
from paratrain.hf.arch import architecture, export_mismatch, is_hf_folder

# Model keys an imported model may still set: how it is trained, not what it computes.
TRAINING_KEYS = ("max_seq_len", "moe_aux_loss_coef", "moe_capacity_factor")
_IGNORED_KEYS = ("preset", "init_from")


def init_folder(init_from: str) -> Path | None:
    """The Hugging Face folder `model.init_from = "hf:PATH"` names, or None."""
    return Path(init_from[3:]).expanduser() if init_from.startswith("hf:") else None


def model_args(folder: Path, model):
    """ModelArgs of the imported model in `folder` (config.json), with the training-only keys the `[model]` section
    sets; any other model key that disagrees with config.json is a ConfigError. The weights are checked against it
    too, and the tokenizer (every id it makes has an embedding row)."""
    # lazy: torch and the tokenizers library are not needed for the checks of a config without init_from
    from paratrain.data.tokenizers import HFTokenizer
    from paratrain.hf.load import check_tokenizer_fits, checked_weights, hf_model_args

    args = hf_model_args(folder)
    checked_weights(folder, args)  # names, shapes, complete files: from the headers, before anything starts
    if (folder / "tokenizer.json").is_file():  # every id the dataset will hold has an embedding row
        check_tokenizer_fits(HFTokenizer.from_file(folder / "tokenizer.json"), args, folder / "tokenizer.json")
    changes = {}
    for key, value in vars(model).items():
        if value is None or key in _IGNORED_KEYS:
            continue
        if key in TRAINING_KEYS:
            changes[key] = value
        elif getattr(args, key, None) != value:
            raise ConfigError(f"model.{key}={value} conflicts with model.init_from ({folder / 'config.json'} has "
                              f"{getattr(args, key, None)}); an imported model keeps its architecture")
    return dataclasses.replace(args, **changes)


def check_run(args, name: str) -> None:
    """Before launch, with checkpoint.export_hf: the export at the end must be possible for model `name`."""
    why = export_mismatch(args)
    if why:
        raise ConfigError(f"checkpoint.export_hf: model {name} has {why}")


def dataset_tokenizer(folder: Path, chosen: str | None) -> Path:
    """The tokenizer.json the dataset of the model imported from `folder` is tokenized with: the folder's own
    (`chosen`, data.tokenizer, may only name that one: its file, or a copy with the same content)."""
    # lazy: the tokenizers library is not needed for the checks of a config without init_from
    from paratrain.data.tokenizers import HFTokenizer, tokenizer_identity
    # lazy: torch is not needed for the checks before launch
    from paratrain.hf.load import hf_tokenizer_file

    def identity(file) -> str:
        return tokenizer_identity(HFTokenizer.from_file(file))

    path = hf_tokenizer_file(folder)
    if chosen is not None and (not chosen.endswith(".json") or identity(chosen) != identity(path)):
        raise ConfigError(f"data.tokenizer={chosen} conflicts with model.init_from: an imported model reads the "
                          f"ids of its own tokenizer ({path}); leave data.tokenizer unset")
    return path


def check_dataset(tokenizer: Path, data_dir) -> None:
    """The dataset prepared in data_dir was made with the imported model's tokenizer (an older one is not)."""
    import tokenizers as hf

    from paratrain.data import load_tokenizer  # lazy: numpy and tokenizers wait until a dataset is read

    tok = load_tokenizer(data_dir)
    if not hasattr(tok, "tok") or tok.tok.to_str() != hf.Tokenizer.from_file(str(tokenizer)).to_str():
        raise UserError(f"data.dir={data_dir} was prepared with another tokenizer ({tok.kind}); model.init_from "
                        f"needs {tokenizer}: choose another data.dir, or run paratrain prepare --tokenizer {tokenizer} "
                        f"--out {data_dir} --overwrite")


def load_initial_weights(model, folder: Path, args) -> None:
    # lazy: torch is not needed for the checks before launch
    from paratrain.hf.load import load_hf_weights

    load_hf_weights(model, folder, args)


__all__ = ["architecture", "init_folder", "model_args", "check_run", "dataset_tokenizer", "check_dataset", "load_initial_weights"]
