"""Named model sizes. Llama dimensions are the published ones (Meta's params.json)."""

from __future__ import annotations

import difflib

from paratrain.errors import UserError
from paratrain.models.llama import ModelArgs

LLAMA3_VOCAB = 128256

# vocab_size None means "take it from the prepared dataset" (small models trained on our corpora).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256),
    # nanoGPT's CPU recipe for tinyshakespeare (4 layers, 4 heads, width 128, context 64),
    # with a SwiGLU hidden size chosen to match its 4*C two-matrix MLP in parameters.
    "shakespeare-char": dict(vocab_size=None, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=352, max_seq_len=256),
    "llama3.2-1b": dict(vocab_size=LLAMA3_VOCAB, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True),
    "llama3.2-3b": dict(vocab_size=LLAMA3_VOCAB, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192,
                        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True),
    "llama3-8b": dict(vocab_size=LLAMA3_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=LLAMA3_VOCAB, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=LLAMA3_VOCAB, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        max_seq_len=8192, rope_theta=500000.0),
}


def preset_fields(name: str) -> dict:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(PRESETS)})"
        raise UserError(f"unknown model preset '{name}'{hint}")
    return dict(PRESETS[name])


def preset_args(name: str, vocab_size: int | None = None, **overrides) -> ModelArgs:
    fields = preset_fields(name)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields["vocab_size"] is None:
        if vocab_size is None:
            raise UserError(f"preset '{name}' takes its vocab size from the dataset; none was given")
        fields["vocab_size"] = vocab_size
    return ModelArgs(**fields)


def count_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Exact parameter count from the dimensions, without building the model."""
    hd = args.head_dim
    attn = args.dim * args.n_heads * hd * 2 + args.dim * args.n_kv_heads * hd * 2  # wq, wo, wk, wv
    ffn = 3 * args.dim * args.ffn_hidden
    block = attn + ffn + 2 * args.dim  # two RMSNorm gains
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * block + args.dim + output
    return total if include_embedding else total - embedding


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N for the matmuls, plus causal-free attention 12 L C T.

    The PaLM appendix convention, as used by nanoGPT and torchtitan, so MFU figures are comparable.
    """
    # The input lookup does no matmul; a tied embedding does, as the output projection.
    n = count_params(args, include_embedding=args.tie_embeddings)
    return 6 * n + 12 * args.n_layers * args.dim * seq_len
