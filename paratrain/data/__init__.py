"""Data pipeline: tokenizers, streamed preparation into token shards, deterministic (seed, step) batches."""

from pathlib import Path

from paratrain.data.tokenizers import Tokenizer, load_tokenizer
from paratrain.data.prepare import choose_dtype, ensure_prepared, main_prepare, prepare_dataset, read_meta
from paratrain.data.loader import TokenData
from paratrain.data.mixture import parse_sources
from paratrain.data.run import dataset_meta, open_split, prepare_for_config

# The bundled corpus the trainer prepares on first run when no dataset is given.
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "tinyshakespeare.txt"

__all__ = ["Tokenizer", "load_tokenizer", "choose_dtype", "ensure_prepared", "main_prepare",
           "prepare_dataset", "read_meta", "TokenData", "parse_sources", "dataset_meta", "open_split",
           "prepare_for_config", "DEFAULT_CORPUS"]
