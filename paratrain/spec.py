"""What a config asks for, resolved without torch: the model's dimensions (`model_args_from`)."""

from __future__ import annotations

import math

from paratrain.errors import ConfigError
from paratrain.models.args import ModelArgs
from paratrain.models.presets import preset_args, preset_fields

VOCAB_PAD = 64  # pad small vocabularies so embedding/output split evenly over tensor-parallel ranks
MODEL_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "rope_theta",
                   "tie_embeddings")


def model_args_from(cfg, data_vocab: int | None = None) -> ModelArgs:
    """The model's dimensions from a config (`config.Config`): the preset, then the `[model]` overrides.

    The vocabulary is `model.vocab_size` when set, else the preset's, else the data's (`data_vocab`, the
    tokenizer's size) padded to a multiple of VOCAB_PAD. data_vocab=None (no data prepared): a preset that takes its
    vocabulary from the data then needs `model.vocab_size`, or it is a ConfigError. The sequence length is checked
    against max_seq_len with the batch, by `Layout.validate`."""
    m = cfg.model
    overrides = {k: getattr(m, k) for k in MODEL_OVERRIDES}
    overrides.update({k: v for k, v in vars(m).items() if k.startswith("moe_")})  # mixture-of-experts settings
    vocab = m.vocab_size
    if vocab is None and data_vocab is not None:
        vocab = math.ceil(data_vocab / VOCAB_PAD) * VOCAB_PAD
    if vocab is None and preset_fields(m.preset)["vocab_size"] is None:
        raise ConfigError(f"model preset '{m.preset}' takes its vocab size from the dataset: set model.vocab_size")
    args = preset_args(m.preset, vocab_size=vocab, **overrides)
    if data_vocab is not None and args.vocab_size < data_vocab:
        raise ConfigError(f"model vocab size {args.vocab_size} is smaller than the dataset's {data_vocab}")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: "
                          "dim must divide by n_heads and n_heads by n_kv_heads")
    return args
