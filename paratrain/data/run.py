"""What the trainer asks of the data package, given the `[data]` config section.

    prepare_for_config(cfg.data, source)   rank 0, before launch: prepare (or reuse) the dataset; or check
                                           the datasets of a mixture. Returns the meta (with "dir": the
                                           folder the tokenizer is loaded from)
    tokenizer_to_prepare(cfg.data, source) the tokenizer prepare_for_config would prepare data.dir with (nothing
                                           written), or None when there is nothing to prepare
    dataset_meta(cfg.data)                 the same meta, read-only (the other ranks)
    open_split(cfg.data, split, seq_len)   the TokenData of a split (one dataset or the mixture)
"""

from __future__ import annotations

from pathlib import Path

from paratrain.data.loader import TokenData
from paratrain.data.mixture import parse_sources
from paratrain.data.prepare import ensure_prepared, planned_tokenizer, read_meta


def _mixture_meta(data_cfg) -> dict:
    mixture = parse_sources(data_cfg.sources)
    metas = [read_meta(d) for d in mixture.dirs]
    mixture.check_tokenizers(metas)
    return {**metas[0], "dir": str(mixture.dirs[0]), "mixture": [
        {"dir": str(d), "weight": w, "name": n} for d, w, n in zip(mixture.dirs, mixture.weights, mixture.names)]}


CONFIG_NAMES = {"source": "data.source", "tokenizer": "data.tokenizer", "vocab_size": "data.vocab_size"}


def prepare_for_config(data_cfg, source, tokenizer=None, tokenizer_name: str = "data.tokenizer", echo=None) -> dict:
    """`source`: data.source resolved to a path (None: not given). `tokenizer`: data.tokenizer, or the one a run
    must use (an imported model's tokenizer.json, named `tokenizer_name`)."""
    if getattr(data_cfg, "sources", None):
        return _mixture_meta(data_cfg)  # a mixture uses datasets prepared beforehand
    tokenizer, path = _tokenizer_args(data_cfg, tokenizer)
    meta = ensure_prepared(source, data_cfg.dir, tokenizer=tokenizer, vocab_size=data_cfg.vocab_size,
                           tokenizer_path=path, val_fraction=data_cfg.val_fraction, echo=echo,
                           names={**CONFIG_NAMES, "tokenizer": tokenizer_name})
    return {**meta, "dir": str(data_cfg.dir)}


def _tokenizer_args(data_cfg, tokenizer) -> tuple:
    """(tokenizer, tokenizer_path) for ensure_prepared: a .json is a tokenizer file."""
    tokenizer = data_cfg.tokenizer if tokenizer is None else tokenizer
    if tokenizer is not None and str(tokenizer).endswith(".json"):
        return "tokenizer.json", tokenizer
    return tokenizer, None


def tokenizer_to_prepare(data_cfg, source, tokenizer=None):
    """What prepare_for_config would tokenize an empty data.dir with (arguments alike), built without writing; None
    for a mixture or a data.dir that holds something."""
    if getattr(data_cfg, "sources", None):
        return None
    tokenizer, path = _tokenizer_args(data_cfg, tokenizer)
    return planned_tokenizer(source, data_cfg.dir, tokenizer, data_cfg.vocab_size, path)


def dataset_meta(data_cfg) -> dict:
    if getattr(data_cfg, "sources", None):
        return _mixture_meta(data_cfg)
    return {**read_meta(data_cfg.dir), "dir": str(data_cfg.dir)}


def open_split(data_cfg, split: str, seq_len: int) -> TokenData:
    where = list(data_cfg.sources) if getattr(data_cfg, "sources", None) else Path(data_cfg.dir)
    return TokenData(where, split, seq_len, mode=getattr(data_cfg, "mode", "random"),
                     packing=getattr(data_cfg, "packing", "auto"), overlong=getattr(data_cfg, "overlong", "truncate"))
