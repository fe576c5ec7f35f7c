"""Turn text into train.bin / val.bin token files (nanoGPT's prepare.py, made safe).

    paratrain prepare --input corpus.txt --out data/shakespeare --tokenizer char

A dataset folder holds train.bin and val.bin (flat uint16/uint32 arrays, raw `tofile`),
meta.json and the tokenizer file(s). It is built in a hidden sibling folder and renamed into
place at the end, so a crash or a bad input never leaves a half-written dataset behind.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from paratrain.errors import OneLineArgumentParser, UserError, one_line
from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer

DATASET_FILES = {"train.bin", "val.bin", "meta.json", "chars.json", "tokenizer.json"}
CHUNK_CHARS = 1 << 20  # encode ~1M characters at a time so the token list never holds the corpus
_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # a lone newline between two non-space characters


def choose_dtype(vocab_size: int, dtype=None) -> str:
    """Smallest unsigned dtype that holds every id, or check the user's forced choice."""
    if dtype not in (None, "uint16", "uint32"):
        raise UserError(f"unknown dtype {dtype!r}; use uint16 or uint32")
    if dtype is None:
        return "uint16" if vocab_size <= 65536 else "uint32"
    if dtype == "uint16" and vocab_size > 65536:
        raise UserError(f"vocab size {vocab_size} does not fit in uint16 (max 65536); use --dtype uint32")
    return dtype


# ---------------------------------------------------------------------------- reading the source

def _source_files(source: Path) -> list:
    if not source.exists():
        raise UserError(f"input not found: {source}")
    if source.is_dir():
        files = sorted(p for p in source.glob("*.txt") if p.is_file())
        if not files:
            raise UserError(f"input folder {source} has no .txt files")
        return files
    return [source]


def source_checksum(source) -> str:
    """sha256 of the raw input bytes (and file names, for a folder): detects a changed corpus."""
    source = Path(source)
    h = hashlib.sha256()
    for f in _source_files(source):
        if source.is_dir():
            h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _decode_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid UTF-8 text: bad byte 0x{data[e.start]:02x} at byte offset {e.start}") from None


def _jsonl_texts(path: Path, text: str) -> list:
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue  # blank lines (a trailing newline, say) are harmless
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path} line {lineno}: not valid JSON ({one_line(getattr(e, 'msg', e))})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise UserError(f'{path} line {lineno}: expected a JSON object with a string "text" field')
        docs.append(obj["text"])
    return docs


def read_source(source) -> str:
    """The whole corpus as one string: a text file, a folder of .txt files, or a .jsonl file."""
    source = Path(source)
    files = _source_files(source)
    if source.suffix == ".jsonl" and source.is_file():
        docs = _jsonl_texts(source, _decode_utf8(source))
    else:
        docs = [_decode_utf8(f) for f in files]
    text = "\n".join(docs)  # documents are separated by a newline, nothing fancier
    if not text.strip():
        raise UserError(f"input {source} is empty (no text to tokenize)")
    return text


def _chunks(text: str, size: int = 0):
    """Split at a lone newline between non-space characters. Our byte-level BPE pre-tokenizer
    always cuts there, so chunk-by-chunk encoding equals whole-text encoding (exactly for
    byte/char/bpe; a foreign tokenizer.json may differ by a token at each ~1M-char cut)."""
    size, start = size or CHUNK_CHARS, 0
    while start < len(text):
        m = _CUT.search(text, start + size)
        end = m.start() if m else len(text)
        yield text[start:end]
        start = end


# ---------------------------------------------------------------------------- building a dataset

def _tokenizer_kind(tokenizer: str, tokenizer_path):
    """Normalize `tokenizer` to (kind, path): a path ending in .json means an existing tokenizer.json."""
    if tokenizer in ("byte", "char", "bpe"):
        return tokenizer, None
    if tokenizer == "tokenizer.json" and tokenizer_path is not None:
        return "tokenizer.json", Path(tokenizer_path)
    if isinstance(tokenizer, (str, os.PathLike)) and str(tokenizer).endswith(".json"):
        return "tokenizer.json", Path(tokenizer)
    raise UserError(f"unknown tokenizer {tokenizer!r} (expected byte, char, bpe or a path to a tokenizer.json file)")


def _build_tokenizer(kind, path, vocab_size, text):
    if vocab_size is not None and kind != "bpe":
        raise UserError(f"--vocab-size only applies to --tokenizer bpe (got tokenizer {kind})")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "bpe":
        if vocab_size is None:
            raise UserError("--tokenizer bpe needs --vocab-size (at least 257: 256 bytes plus merges)")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
            raise UserError(f"bpe vocab size must be an integer of at least 257 (256 bytes plus merges), got {vocab_size!r}")
        return HFTokenizer.train_bpe(_chunks(text), vocab_size)
    return HFTokenizer.from_file(path)


def _check_out_dir(out_dir: Path, overwrite: bool):
    """Refuse early, before any work, if writing out_dir could destroy something."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a folder")
    if not out_dir.is_dir():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in DATASET_FILES)
    if foreign:  # replacing the folder would delete these: never do that
        raise UserError(f"output folder {out_dir} holds files that are not part of a dataset ({', '.join(foreign[:3])}); choose another --out")
    if (out_dir / "train.bin").exists() and not overwrite:
        raise UserError(f"output folder {out_dir} already holds a prepared dataset; pass --overwrite to replace it")


def _write_tokens(tok, text, path: Path, dtype: str) -> int:
    n = 0
    with open(path, "wb") as f:
        chunks = list(_chunks(text))
        for i in range(0, len(chunks), 16):  # batches of chunks let HF tokenizers use all cores
            for ids in tok.encode_batch(chunks[i:i + 16]):
                np.asarray(ids, dtype=dtype).tofile(f)
                n += len(ids)
        f.flush()
        os.fsync(f.fileno())
    return n


def _split(tmp: Path, n: int, dtype: str, val_fraction: float):
    """Move the last val_fraction of the stream from train.bin to val.bin (copy tail, truncate)."""
    n_val = int(n * val_fraction)
    if n_val < 1 or n - n_val < 1:
        raise UserError(f"input is too small: {n} tokens cannot be split into non-empty train and val sets (val fraction {val_fraction})")
    itemsize = np.dtype(dtype).itemsize
    val = np.fromfile(tmp / "train.bin", dtype=dtype, count=n_val, offset=(n - n_val) * itemsize)
    with open(tmp / "val.bin", "wb") as f:
        val.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.truncate(tmp / "train.bin", (n - n_val) * itemsize)
    return n - n_val, n_val


def _swap_into_place(tmp: Path, out_dir: Path):
    """Rename tmp to out_dir. An old out_dir is moved aside first and only deleted once the new
    one is in place, so at every moment one complete dataset exists on disk."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
    os.rename(out_dir, old / "d")
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old / "d", out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def prepare_dataset(source, out_dir, tokenizer="char", vocab_size=None, tokenizer_path=None,
                    val_fraction=0.1, dtype=None, overwrite=False) -> dict:
    source, out_dir = Path(source), Path(out_dir)
    kind, tok_path = _tokenizer_kind(tokenizer, tokenizer_path)
    if not (isinstance(val_fraction, (int, float)) and 0 < val_fraction <= 0.5):
        raise UserError(f"val fraction must be in (0, 0.5], got {val_fraction!r}")
    choose_dtype(0, dtype)  # reject a bad dtype name before the slow part
    _check_out_dir(out_dir, overwrite)
    text = read_source(source)
    tok = _build_tokenizer(kind, tok_path, vocab_size, text)
    dtype = choose_dtype(tok.vocab_size, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the dataset should read like any folder
    try:
        n = _write_tokens(tok, text, tmp / "train.bin", dtype)
        n_train, n_val = _split(tmp, n, dtype, val_fraction)
        tok.save(tmp)
        meta = json.loads((tmp / "meta.json").read_text())  # tokenizer + vocab_size from save()
        meta.update(dtype=dtype, train_tokens=n_train, val_tokens=n_val, val_fraction=val_fraction,
                    source=str(source.resolve()), source_sha256=source_checksum(source),
                    tokenizer_files=list(tok.files))
        if tok_path is not None:
            meta["tokenizer_source"] = str(tok_path.resolve())
        if kind == "bpe":  # BPE may stop short of the asked size; remember what was asked
            meta["requested_vocab_size"] = vocab_size
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _check_out_dir(out_dir, overwrite)  # again: someone may have written there meanwhile
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def read_meta(data_dir) -> dict:
    """meta.json of a prepared dataset folder, or a UserError saying how to make one."""
    data_dir = Path(data_dir)
    for name in ("meta.json", "train.bin", "val.bin"):
        if not (data_dir / name).is_file():
            raise UserError(f"{data_dir} is not a prepared dataset (no {name}); run: paratrain prepare --input TEXT --out {data_dir}")
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        meta["tokenizer"], meta["vocab_size"], meta["dtype"]  # the keys everything else relies on
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{data_dir / 'meta.json'} is damaged ({one_line(e)}); prepare the dataset again with --overwrite") from None
    return meta


def ensure_prepared(source, out_dir, tokenizer="char", **kw) -> dict:
    """Prepare out_dir from source unless it already holds this exact corpus and tokenizer."""
    kind, _ = _tokenizer_kind(tokenizer, kw.get("tokenizer_path"))
    try:
        meta = read_meta(out_dir)
    except UserError:
        meta = None
    if meta is not None and meta.get("tokenizer") == kind and meta.get("source_sha256") == source_checksum(source):
        if kind != "bpe" or meta.get("requested_vocab_size") == kw.get("vocab_size"):
            return meta
    return prepare_dataset(source, out_dir, tokenizer=tokenizer, overwrite=True, **kw)


def main_prepare(argv) -> int:
    p = OneLineArgumentParser(prog="paratrain prepare", description="Tokenize text into train.bin / val.bin.")
    p.add_argument("--input", required=True, help="a text file, a folder of .txt files, or a .jsonl file with a 'text' field")
    p.add_argument("--out", required=True, help="dataset folder to create")
    p.add_argument("--tokenizer", default="char", help="byte, char, bpe, or a path to an existing tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=None, help="vocab size for --tokenizer bpe (>= 257)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of tokens held out for validation")
    p.add_argument("--dtype", choices=["uint16", "uint32"], default=None, help="token dtype (default: by vocab size)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    a = p.parse_args(argv)
    meta = prepare_dataset(a.input, a.out, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                           val_fraction=a.val_fraction, dtype=a.dtype, overwrite=a.overwrite)
    print(f"prepared {a.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
          f"{meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,}, {meta['dtype']}")
    return 0
