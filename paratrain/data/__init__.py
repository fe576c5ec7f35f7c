"""Data pipeline: tokenizers, dataset preparation (train.bin / val.bin) and deterministic batches."""

from pathlib import Path

from paratrain.data.tokenizers import Tokenizer, load_tokenizer
from paratrain.data.prepare import choose_dtype, ensure_prepared, main_prepare, prepare_dataset, read_meta
from paratrain.data.loader import TokenData

# The bundled corpus the trainer prepares on first run when no dataset is given.
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "tinyshakespeare.txt"

__all__ = ["Tokenizer", "load_tokenizer", "choose_dtype", "ensure_prepared", "main_prepare",
           "prepare_dataset", "read_meta", "TokenData", "DEFAULT_CORPUS"]
