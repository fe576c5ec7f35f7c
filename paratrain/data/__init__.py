"""Data pipeline: tokenizers, streamed preparation into token shards, deterministic (seed, step) batches.

Names are imported on first use, so `paratrain prepare` and its worker processes never load torch
(only the loader needs it).
"""

import importlib
from pathlib import Path

# The bundled corpus the trainer prepares on first run when no dataset is given.
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "tinyshakespeare.txt"

_WHERE = {
    "Tokenizer": "tokenizers", "load_tokenizer": "tokenizers", "tokenizer_identity": "tokenizers",
    "choose_dtype": "prepare", "ensure_prepared": "prepare", "prepare_dataset": "prepare",
    "read_meta": "prepare",
    "TokenData": "loader",
    "parse_sources": "mixture",
    "dataset_meta": "run", "open_split": "run", "prepare_for_config": "run", "tokenizer_to_prepare": "run",
}

__all__ = [*_WHERE, "DEFAULT_CORPUS"]


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"paratrain.data.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'paratrain.data' has no attribute {name!r}")
