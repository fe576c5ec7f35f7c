"""`paratrain prepare --input PATH|'GLOB' --out DIR`: tokenize a corpus into a folder of token shards
(paratrain/data/prepare.py streams it; neither it nor its worker processes load torch)."""

from __future__ import annotations

import sys

from paratrain.data.prepare import DEFAULT_SAMPLE_MB, DEFAULT_SHARD_TOKENS, SPLITS, prepare_dataset
from paratrain.errors import OneLineArgumentParser


def main(argv: list[str]) -> int:
    p = OneLineArgumentParser(prog="paratrain prepare", description="Tokenize a corpus into a folder of token shards.")
    p.add_argument("--input", required=True, action="append",
                   help="a file (.txt, .jsonl or .json: JSON lines or one array, each also .gz or .zst, .parquet), a folder (searched recursively, or one "
                        "written by datasets' save_to_disk), or a quoted glob pattern; may be repeated")
    p.add_argument("--out", required=True, help="dataset folder to create")
    p.add_argument("--tokenizer", default="char", help="byte, char, bpe, or a path to an existing tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=None, help="vocab size for --tokenizer bpe (>= 257)")
    p.add_argument("--sample-mb", type=float, default=DEFAULT_SAMPLE_MB,
                   help="text sampled (spread over the input files) to train --tokenizer bpe on")
    p.add_argument("--text-field", default="text", help="JSON field / parquet column holding the document text")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of documents held out for validation")
    p.add_argument("--val-input", action="append", default=None, help="validation documents instead of --val-fraction")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: the machine's cores, or this "
                                                              "process for an input under 4 MB; 0: this process)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file at most")
    p.add_argument("--dtype", choices=["uint16", "uint32"], default=None, help="token dtype (default: by vocab size)")
    p.add_argument("--chat", action="store_true", help="every line is a conversation (\"messages\", or \"prompt\" and "
                   "\"completion\"), rendered with the tokenizer's chat template, with a loss mask")
    p.add_argument("--chat-template", default=None, help="a .jinja chat template instead of the tokenizer's own")
    p.add_argument("--loss-on", choices=["assistant", "last", "all"], default="assistant",
                   help="chat data: the tokens that are targets (assistant turns, the last one, or all)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    echo = (lambda *_: None) if a.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    meta = prepare_dataset(a.input if len(a.input) > 1 else a.input[0], a.out, tokenizer=a.tokenizer,
                           vocab_size=a.vocab_size, val_fraction=a.val_fraction, dtype=a.dtype, overwrite=a.overwrite,
                           val_input=a.val_input, text_field=a.text_field, workers=a.workers,
                           shard_tokens=a.shard_tokens, sample_mb=a.sample_mb, echo=echo, chat=a.chat,
                           chat_template=a.chat_template, loss_on=a.loss_on)
    n_shards = sum(len(meta["splits"][s]["shards"]) for s in SPLITS)
    print(f"prepared {a.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['train_documents']:,} + {meta['val_documents']:,} documents, {n_shards} shards), "
          f"{meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,}, {meta['dtype']}, {meta['seconds']:.1f}s")
    if a.chat:
        c = meta["chat"]
        print(f"chat: {c['conversations']:,} conversations ({c['instructions']:,} prompt/completion), "
              f"{c['target_tokens']:,} target tokens (--loss-on {c['loss_on']}), template {c['template']}")
    return 0
