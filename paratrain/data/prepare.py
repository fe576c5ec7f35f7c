"""Turn a corpus into a folder of token shards, streamed: memory does not grow with the corpus.

    paratrain prepare --input 'corpus/*.jsonl.gz' --out data/mycorpus --tokenizer bpe --vocab-size 32000

Documents are read one at a time (`sources.py`), tokenized in `--workers` processes (the tokenizers
library's batch encoding inside each), and appended to shards of at most `--shard-tokens` tokens:

    out/
      meta.json            the index: tokenizer, vocab size, eos/bos ids, dtype, per split its shards with
                           token and document counts, every source with its size and sha256
      train-00000.bin      tokens (flat uint16/uint32, raw), BOS (if any) + document + EOS, document after document
      train-00000.docs     uint64 end offset (inside the shard, just after the EOS) of every document ending there
      train-00000.mask     chat data (--chat): one byte per token, 1 where the token is a target (data/chat.py)
      val-00000.bin ...
      chars.json | tokenizer.json (+ tokenizer_config.json, chat_template.jinja)

Validation is whole documents: every round(1/val_fraction)-th document (spread over the corpus), or all of
`--val-input`. A corpus of a single document (one text file) is the exception: its last val_fraction of
tokens becomes the validation split, as before.

The dataset is built in a hidden sibling folder `.NAME.partial` and renamed into place at the end, so a
crash or a bad input never leaves a dataset that looks complete; a restarted prepare removes what an
interrupted one left and starts clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from paratrain.data.chat import chat_encoder, write_conversations
from paratrain.data.sources import resolve_inputs
from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, from_spec, load_tokenizer
from paratrain.data.tokenizers import tokenizer_identity
from paratrain.data.tokenizers import meta_problem as tokenizer_problem
from paratrain.errors import UserError, one_line
from paratrain.files import atomic_dir, holds

FORMAT = "paratrain-shards-1"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MiB of uint16 per shard
TASK_CHARS = 1 << 20  # characters handed to a worker at a time
SMALL_INPUT_BYTES = 4 << 20  # below this, tokenizing in this process beats starting workers
DEFAULT_SAMPLE_MB = 64  # text the BPE trainer sees
_SHARD_FILE = re.compile(r"^(train|val)(-\d{5})?\.(bin|docs|mask)$")
DATASET_FILES = {"meta.json", "chars.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
MAX_BPE_VOCAB = 1 << 31
MIN_SHARD_TOKENS = 64  # below this a corpus becomes a file per handful of tokens
MAX_SHARDS = 100_000  # per split: a --shard-tokens typo must not fill the disk with files


def choose_dtype(vocab_size: int, dtype=None) -> str:
    """Smallest unsigned dtype that holds every id, or check the user's forced choice."""
    if dtype not in (None, "uint16", "uint32"):
        raise UserError(f"unknown dtype {dtype!r}; use uint16 or uint32")
    if dtype is None:
        return "uint16" if vocab_size <= 65536 else "uint32"
    if dtype == "uint16" and vocab_size > 65536:
        raise UserError(f"vocab size {vocab_size} does not fit in uint16 (max 65536); use --dtype uint32")
    return dtype


def _is_dataset_file(name: str) -> bool:
    return name in DATASET_FILES or bool(_SHARD_FILE.match(name))


# ---------------------------------------------------------------------------- sources and checksums

def source_fingerprint(sources) -> list:
    return [fp for s in sources for fp in s.fingerprint()]


def combined_checksum(records) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(f"{Path(r['path']).name}\0{r['sha256']}\0".encode())
    return h.hexdigest()


def source_checksum(source) -> str:
    """One sha256 for a whole input (file, folder or pattern): detects a changed corpus."""
    sources = resolve_inputs(source)
    return combined_checksum([{"path": str(s.path), "sha256": s.checksum()} for s in sources])


# ---------------------------------------------------------------------------- tokenizers

def _tokenizer_kind(tokenizer: str, tokenizer_path):
    """Normalize `tokenizer` to (kind, path): a path ending in .json means an existing tokenizer.json."""
    if tokenizer in ("byte", "char", "bpe"):
        return tokenizer, None
    if tokenizer == "tokenizer.json" and tokenizer_path is not None:
        return "tokenizer.json", Path(tokenizer_path)
    if isinstance(tokenizer, (str, os.PathLike)) and str(tokenizer).endswith(".json"):
        return "tokenizer.json", Path(tokenizer)
    raise UserError(f"unknown tokenizer {tokenizer!r} (expected byte, char, bpe or a path to a tokenizer.json file)")


def _check_vocab_args(kind, vocab_size):
    if vocab_size is not None and kind != "bpe":
        raise UserError(f"--vocab-size only applies to --tokenizer bpe (got tokenizer {kind})")
    if kind == "bpe":
        if vocab_size is None:
            raise UserError("--tokenizer bpe needs --vocab-size (at least 257: 256 bytes plus end-of-text)")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
            raise UserError(f"bpe vocab size must be an integer of at least 257 (256 bytes plus end-of-text), "
                            f"got {vocab_size!r}")
        if vocab_size > MAX_BPE_VOCAB:
            raise UserError(f"--vocab-size {vocab_size} is more than {MAX_BPE_VOCAB} (ids are stored as uint32; "
                            "a typo?)")


def sample_texts(sources, text_field: str, budget_chars: int):
    """A bounded, streamed sample for BPE training: the first budget/len(sources) characters of each source."""
    per_source = max(1 << 16, budget_chars // len(sources))
    for src in sources:
        taken = 0
        gen = src.pieces(text_field)
        for text, _, _ in gen:
            yield text[:per_source - taken]
            taken += len(text)
            if taken >= per_source:
                gen.close()
                break


def _build_tokenizer(kind, path, vocab_size, sources, text_field, sample_chars, echo):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        chars = set()  # one streamed pass: the vocabulary is every character of the corpus
        for src in sources:
            for text, _, _ in src.pieces(text_field):
                chars.update(text)
        return CharTokenizer(sorted(chars))
    if kind == "bpe":
        echo(f"training BPE (vocab {vocab_size}) on a sample of at most {sample_chars / 1e6:.0f}M characters")
        tok = HFTokenizer.train_bpe(sample_texts(sources, text_field, sample_chars), vocab_size)
        if tok.vocab_size < vocab_size:  # a small corpus runs out of pairs to merge: the model is built on fewer ids
            echo(f"vocabulary: {tok.vocab_size:,} ids (asked {vocab_size:,}: the corpus has no more merges)")
        return tok
    return HFTokenizer.from_file(path)


# ---------------------------------------------------------------------------- writing shards

class SplitWriter:
    """Appends one split's tokens to shards of at most shard_tokens, document ends to .docs files and, with `masks`,
    each token's loss mask (one byte) to .mask files."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int, masks: bool = False):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.masks = masks
        self.shards, self.tokens, self.documents = [], 0, 0
        self._f = self._docs_f = self._mask_f = None
        self._n = self._shard_docs = 0
        self._ends = []

    def _roll(self):
        if len(self.shards) >= MAX_SHARDS:
            raise UserError(f"the {self.split} split needs more than {MAX_SHARDS} shards of --shard-tokens "
                            f"{self.shard_tokens}; raise --shard-tokens")
        self._close_shard()
        name = f"{self.split}-{len(self.shards):05d}"
        self._f = open(self.folder / f"{name}.bin", "wb")
        self._docs_f = open(self.folder / f"{name}.docs", "wb")
        self._mask_f = open(self.folder / f"{name}.mask", "wb") if self.masks else None
        self._n = self._shard_docs = 0
        self.shards.append({"file": f"{name}.bin", "docs_file": f"{name}.docs", "tokens": 0, "documents": 0,
                            **({"mask_file": f"{name}.mask"} if self.masks else {})})

    def write(self, ids: np.ndarray, ends_document: bool, mask: np.ndarray | None = None):
        if self._f is None:
            self._roll()
        while len(ids):
            if self._n == self.shard_tokens:
                self._roll()
            take = min(len(ids), self.shard_tokens - self._n)
            ids[:take].astype(self.dtype, copy=False).tofile(self._f)
            if self._mask_f is not None:
                mask[:take].astype(np.uint8, copy=False).tofile(self._mask_f)
                mask = mask[take:]
            self._n, self.tokens, ids = self._n + take, self.tokens + take, ids[take:]
        if ends_document:  # the last token written is in the open shard
            self._ends.append(self._n)
            self._shard_docs += 1
            self.documents += 1
            if len(self._ends) >= 1 << 16:
                self._flush_ends()

    def _flush_ends(self):
        if self._ends:
            np.asarray(self._ends, dtype="<u8").tofile(self._docs_f)
            self._ends = []

    def _close_shard(self):
        if self._f is None:
            return
        self._flush_ends()
        for f in (self._f, self._docs_f, self._mask_f):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        self.shards[-1].update(tokens=self._n, documents=self._shard_docs)
        self._f = self._docs_f = self._mask_f = None

    def close(self) -> dict:
        self._close_shard()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def _move_tail(folder: Path, train: dict, val: SplitWriter, n_val: int, dtype: str):
    """Single-document corpus: move the last n_val tokens of train's shards to val (the old token split)."""
    cut = train["tokens"] - n_val
    start = 0
    for shard in train["shards"]:
        end = start + shard["tokens"]
        if end > cut:
            local = max(0, cut - start)
            data = np.memmap(folder / shard["file"], dtype=dtype, mode="r", shape=(shard["tokens"],))
            for i in range(local, shard["tokens"], 1 << 22):
                val.write(np.array(data[i:i + (1 << 22)]), ends_document=False)
            del data
        start = end
    val._ends.append(val._n)  # the document's end moved with its tail
    val._shard_docs += 1
    val.documents += 1
    kept, start = [], 0
    for shard in train["shards"]:
        end, local = start + shard["tokens"], cut - start
        if local <= 0:
            (folder / shard["file"]).unlink()
            (folder / shard["docs_file"]).unlink()
        else:
            if local < shard["tokens"]:
                os.truncate(folder / shard["file"], local * np.dtype(dtype).itemsize)
            open(folder / shard["docs_file"], "wb").close()  # the only document no longer ends in train
            kept.append({**shard, "tokens": min(local, shard["tokens"]), "documents": 0})
        start = end
    return {"tokens": cut, "documents": 0, "shards": kept}


# ---------------------------------------------------------------------------- tokenizing in workers

_WORKER_TOK = None


def _init_worker(spec):
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; the workers are the parallelism
    _WORKER_TOK = from_spec(spec)


def _encode(tok, texts, flags):
    """Token ids of each piece with BOS before a document's first piece and EOS after its last."""
    bos, eos = tok.bos_id, tok.eos_id
    out = []
    for ids, (first, last) in zip(tok.encode_arrays(texts), flags):
        if (first and bos is not None) or (last and eos is not None):
            ids = np.concatenate([[bos]] * (first and bos is not None) + [ids] + [[eos]] * (last and eos is not None))
        out.append(ids)
    lengths = np.array([len(a) for a in out], dtype=np.int64)
    return (np.concatenate(out) if out else np.zeros(0, np.int64)).astype(np.uint32), lengths


def _encode_task(texts, flags):
    return _encode(_WORKER_TOK, texts, flags)


def _tasks(stream):
    """Group (text, first, last, split) pieces into tasks of about TASK_CHARS characters."""
    texts, meta, size = [], [], 0
    for text, first, last, split in stream:
        texts.append(text)
        meta.append((first, last, split))
        size += len(text)
        if size >= TASK_CHARS:
            yield texts, meta
            texts, meta, size = [], [], 0
    if texts:
        yield texts, meta


class _Progress:
    def __init__(self, echo, every_s: float = 10.0):
        self.echo, self.every_s, self.start = echo, every_s, time.perf_counter()
        self.last, self.chars, self.docs, self.tokens = self.start, 0, 0, 0

    def add(self, texts, meta, n_tokens):
        self.add_counts(sum(len(t) for t in texts), sum(1 for _, last, _ in meta if last), n_tokens)

    def add_counts(self, chars: int, docs: int, n_tokens: int):
        self.chars += chars
        self.docs += docs
        self.tokens += n_tokens
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            self.echo(f"  {self.docs:,} documents, {self.tokens:,} tokens, {self.chars / 1e6:,.0f}M characters "
                      f"({self.chars / 1e6 / (now - self.start):.1f}M chars/s)")


def _tokenize_into(stream, tok, writers, workers: int, progress: _Progress):
    def consume(texts, meta, result):
        ids, lengths = result
        progress.add(texts, meta, len(ids))
        pos = 0
        for (first, last, split), n in zip(meta, lengths.tolist()):
            writers[split].write(ids[pos:pos + n], last)
            pos += n

    if workers == 0:
        for texts, meta in _tasks(stream):
            consume(texts, meta, _encode(tok, texts, [(f, l) for f, l, _ in meta]))
        return
    import multiprocessing as mp

    # spawn: workers start clean (no inherited threads, tokenizer state or process groups)
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tok.spec(),)) as pool:
        pending = deque()
        for texts, meta in _tasks(stream):
            pending.append((texts, meta, pool.apply_async(_encode_task, (texts, [(f, l) for f, l, _ in meta]))))
            while len(pending) > 2 * workers:  # bounded: the reader never runs far ahead of the workers
                t, m, r = pending.popleft()
                consume(t, m, r.get())
        while pending:
            t, m, r = pending.popleft()
            consume(t, m, r.get())


# ---------------------------------------------------------------------------- the output folder

def _check_out_dir(out_dir: Path, overwrite: bool):
    """Refuse early, before any work, if writing out_dir could destroy something."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a folder")
    if not out_dir.is_dir():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if not _is_dataset_file(p.name))
    if foreign:  # replacing the folder would delete these: never do that
        raise UserError(f"output folder {out_dir} holds files that are not part of a dataset ({', '.join(foreign[:3])}); choose another --out")
    if any(p.name == "meta.json" or p.suffix == ".bin" for p in out_dir.iterdir()) and not overwrite:
        raise UserError(f"output folder {out_dir} already holds a prepared dataset; pass --overwrite to replace it")


def max_workers() -> int:
    return max(8, 4 * (os.cpu_count() or 1))


def _check_keeps_inputs(out_dir: Path, sources, val_sources) -> None:
    """Replacing out_dir must never delete what this prepare reads: an input file or folder inside it."""
    for flag, group in (("--input", sources), ("--val-input", val_sources)):
        for s in group:
            if holds(out_dir, s.path):
                raise UserError(f"--out {out_dir} would delete {flag} {s.path}, which lies inside it: choose another "
                                "--out, or move the input out of it first")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim_partial(out_dir: Path, echo) -> Path:
    """The hidden build folder `.NAME.partial`; what an interrupted prepare left there is removed."""
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    if tmp.exists():
        try:
            owner = json.loads((tmp / "owner.json").read_text())
        except (OSError, ValueError):
            owner = {}
        if owner.get("host") == socket.gethostname() and _pid_alive(int(owner.get("pid", -1))) \
                and int(owner.get("pid", -1)) != os.getpid():
            raise UserError(f"another paratrain prepare (pid {owner['pid']}) is writing {out_dir}; wait for it, "
                            f"or stop it and remove {tmp}")
        echo(f"removing the unfinished dataset an interrupted prepare left in {tmp}; starting clean")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                "started": time.time()}))
    return tmp


def is_validation_doc(doc: int, fraction: float) -> bool:
    """Every 1/fraction-th document, evenly spread: floor((i+1) f) > floor(i f)."""
    return int((doc + 1) * fraction) > int(doc * fraction)


def _document_stream(sources, val_sources, text_field, val_fraction, counters):
    for src in sources:
        for text, first, last in src.pieces(text_field):
            doc = counters["docs"]
            counters["text"] = counters["text"] or not text.isspace()
            yield text, first, last, ("train" if val_sources else "val" if is_validation_doc(doc, val_fraction) else "train")
            if last:
                counters["docs"] += 1
    for src in val_sources:
        for text, first, last in src.pieces(text_field):
            counters["text"] = counters["text"] or not text.isspace()
            yield text, first, last, "val"


def default_workers(sources) -> int:
    size = sum(f.stat().st_size for s in sources for f in s.stat_files())
    return 0 if size < SMALL_INPUT_BYTES else (os.cpu_count() or 1)


def prepare_dataset(source, out_dir, tokenizer="char", vocab_size=None, tokenizer_path=None,
                    val_fraction=0.1, dtype=None, overwrite=False, *, val_input=None, text_field="text",
                    workers=None, shard_tokens=DEFAULT_SHARD_TOKENS, sample_mb=DEFAULT_SAMPLE_MB, echo=None,
                    chat: bool = False, chat_template: str | None = None, loss_on: str = "assistant") -> dict:
    """Tokenize `source` (file, folder, glob pattern, or a list of them) into a sharded dataset in out_dir.
    workers: tokenizer processes (0: this process; None: the machine's cores, or 0 for a small input).
    chat: every line is a conversation, rendered with the tokenizer's chat template (or `chat_template`, a .jinja
    file) and stored with a loss mask on the tokens `loss_on` names (data/chat.py); tokenized in this process."""
    echo = echo or (lambda *_: None)
    out_dir = Path(out_dir)
    kind, tok_path = _tokenizer_kind(tokenizer, tokenizer_path)
    _check_prepare_options(kind, vocab_size, val_fraction, shard_tokens, sample_mb, workers, text_field, chat,
                           chat_template, loss_on)
    choose_dtype(0, dtype)  # reject a bad dtype name before the slow part
    sources = resolve_inputs(source)
    val_sources = resolve_inputs(val_input, "validation input") if val_input else []
    if not (out_dir.exists() and not out_dir.is_dir()):  # a file there: _check_out_dir says so
        _check_keeps_inputs(out_dir, sources, val_sources)
    _check_out_dir(out_dir, overwrite)
    tok = _build_tokenizer(kind, tok_path, vocab_size, sources + val_sources, text_field, int(sample_mb * 1e6), echo)
    dtype = choose_dtype(tok.vocab_size, dtype)
    workers = default_workers(sources + val_sources) if workers is None else workers

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _claim_partial(out_dir, echo)
    encoder = None
    if chat:
        encoder = chat_encoder(tok, tok_path, chat_template, loss_on)
    with atomic_dir(tmp, out_dir):  # the dataset appears whole, or not at all (an old one stays until then)
        start = time.perf_counter()
        writers = {s: SplitWriter(tmp, s, dtype, int(shard_tokens), masks=chat) for s in SPLITS}
        counters = {"docs": 0, "text": False}
        progress = _Progress(echo)
        if chat:
            split_of = (lambda doc: "train") if val_sources else (
                lambda doc: "val" if is_validation_doc(doc, val_fraction) else "train")
            chat_stats = write_conversations(encoder, sources, val_sources, split_of, writers, progress, counters)
        else:
            stream = _document_stream(sources, val_sources, text_field, val_fraction, counters)
            _tokenize_into(stream, tok, writers, workers, progress)
        if not counters["text"]:
            raise UserError(f"input {source} is empty (no text to tokenize)")
        train, val, val_split = _close_splits(tmp, writers, tok, dtype, counters["docs"], val_fraction,
                                              bool(val_sources), chat)
        tok.save(tmp)
        meta = json.loads((tmp / "meta.json").read_text())  # tokenizer, vocab_size, eos_id, bos_id from save()
        meta.update(_dataset_record(source, sources, val_sources, tok, dtype, train, val, val_fraction, val_split,
                                    progress.chars, shard_tokens, text_field, start))
        if tok_path is not None:
            meta["tokenizer_source"] = str(tok_path.resolve())
        if chat:
            meta.update(loss_mask=True, chat=encoder.record(chat_stats, tmp))
        if kind == "bpe":  # BPE may stop short of the asked size; remember what was asked
            meta["requested_vocab_size"] = vocab_size
        (tmp / "owner.json").unlink()
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # written last: the commit point
        _check_out_dir(out_dir, overwrite)  # again: someone may have written there meanwhile
    return meta


def _check_prepare_options(kind, vocab_size, val_fraction, shard_tokens, sample_mb, workers, text_field, chat,
                           chat_template, loss_on) -> None:
    """prepare's options, each refused in one line before anything is read or written."""
    _check_vocab_args(kind, vocab_size)
    if chat and kind != "tokenizer.json":
        raise UserError(f"--chat renders conversations with a Hugging Face tokenizer and its chat template: give "
                        f"--tokenizer path/to/tokenizer.json (not {kind})")
    if not chat and (chat_template is not None or loss_on != "assistant"):
        raise UserError("--chat-template and --loss-on apply to chat data: add --chat")
    if not (isinstance(val_fraction, (int, float)) and 0 < val_fraction <= 0.5):
        raise UserError(f"val fraction must be in (0, 0.5], got {val_fraction!r}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard tokens must be a positive integer, got {shard_tokens!r}")
    if shard_tokens < MIN_SHARD_TOKENS:
        raise UserError(f"--shard-tokens {shard_tokens} is below {MIN_SHARD_TOKENS}: a shard file per handful of "
                        "tokens (the default is 268435456)")
    if isinstance(sample_mb, bool) or not isinstance(sample_mb, (int, float)) or not sample_mb > 0:
        raise UserError(f"--sample-mb must be positive, got {sample_mb!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise UserError(f"workers must be an integer >= 0 (0: tokenize in this process), got {workers!r}")
    if workers is not None and workers > max_workers():
        raise UserError(f"--workers {workers} is more than this machine runs ({max_workers()}: 4 per core, at "
                        "least 8)")
    if not text_field:
        raise UserError("--text-field must not be empty")


def _close_splits(tmp: Path, writers: dict, tok, dtype: str, n_docs: int, val_fraction, val_input: bool,
                  chat: bool) -> tuple[dict, dict, str]:
    """(train, val, how the validation split was made): the splits' writers closed, a single document's tail moved
    to the validation split, an empty split refused."""
    train, val = writers["train"].close(), writers["val"]
    if val_input:
        val_split = "val-input"
    elif n_docs == 1 and not chat:  # one document (a single text file): cut it, its tail is the validation split
        n = train["tokens"] - (tok.bos_id is not None) - (tok.eos_id is not None)  # the text's own tokens
        n_val = int(n * val_fraction)  # as before EOS existed: the same train tokens, val gains the EOS
        if n_val < 1 or n - n_val < 1:
            raise UserError(f"input is too small: {n} tokens cannot be split into non-empty train and val sets "
                            f"(val fraction {val_fraction})")
        tail = n_val + (tok.eos_id is not None)
        train, val_split = _move_tail(tmp, train, val, tail, dtype), "tokens of the single document"
    else:
        val_split = "documents"
    val = val.close()
    if val["tokens"] == 0:
        raise UserError(f"--val-fraction {val_fraction} of {n_docs} documents leaves no validation document; "
                        "use a larger --val-fraction, more documents, or --val-input")
    if train["tokens"] == 0:
        raise UserError(f"no training documents left ({n_docs} documents in the input)")
    return train, val, val_split


def _dataset_record(source, sources, val_sources, tok, dtype: str, train: dict, val: dict, val_fraction,
                    val_split: str, chars: int, shard_tokens, text_field: str, start: float) -> dict:
    """The index's description of the dataset: its splits, its sources and their checksums, its tokenizer."""
    records = [s.record() for s in sources]
    return dict(format=FORMAT, dtype=dtype, train_tokens=train["tokens"], val_tokens=val["tokens"],
                train_documents=train["documents"], val_documents=val["documents"],
                val_fraction=None if val_sources else val_fraction, val_split=val_split,
                text_characters=chars, splits={"train": train, "val": val}, shard_tokens=int(shard_tokens),
                text_field=text_field,
                source=[str(s) for s in source] if isinstance(source, (list, tuple)) else str(source),
                source_sha256=combined_checksum(records), sources=records,
                source_fingerprint=source_fingerprint(sources),
                val_sources=[s.record() for s in val_sources], tokenizer_files=list(tok.files),
                tokenizer_sha256=tokenizer_identity(tok), seconds=round(time.perf_counter() - start, 3))


# ---------------------------------------------------------------------------- reading the index

def read_meta(data_dir) -> dict:
    """The index (meta.json) of a prepared dataset folder, or a UserError saying how to make one."""
    data_dir = Path(data_dir)
    redo = f"paratrain prepare --input TEXT --out {data_dir} --overwrite"
    if not (data_dir / "meta.json").is_file():
        raise UserError(f"{data_dir} is not a prepared dataset (no meta.json); run: paratrain prepare --input TEXT --out {data_dir}")
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        meta["tokenizer"], meta["vocab_size"], meta["dtype"]  # the keys everything else relies on
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{data_dir / 'meta.json'} is damaged ({one_line(e)}); prepare the dataset again with --overwrite") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{data_dir} was prepared by an older paratrain (one train.bin, no shard index); prepare it "
                        f"again: {redo}")
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{data_dir / 'meta.json'}: {problem}; prepare the dataset again: {redo}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            files = [(data_dir / shard["file"], itemsize)]
            if meta.get("loss_mask"):  # one byte per token
                files.append(((data_dir / shard["file"]).with_suffix(".mask"), 1))
            for path, size in files:
                if not path.is_file() or path.stat().st_size != shard["tokens"] * size:
                    raise UserError(f"{path} is missing or has the wrong size; prepare the dataset again: {redo}")
    return meta


def meta_problem(meta: dict) -> str | None:
    """What is wrong with a prepared dataset's index, naming the field: the tokenizer fields, the dtype against the
    vocabulary, and per split its shards (file names inside the folder, token and document counts that add up)."""
    problem = tokenizer_problem(meta)
    if problem:
        return problem
    if meta["dtype"] not in ("uint16", "uint32"):
        return f"dtype {meta['dtype']!r} is not uint16 or uint32"
    if meta["dtype"] == "uint16" and meta["vocab_size"] > 65536:
        return f"dtype uint16 cannot hold vocab_size {meta['vocab_size']}"
    if not isinstance(meta.get("loss_mask", False), bool):
        return f"loss_mask must be true or false, got {meta['loss_mask']!r}"
    splits = meta.get("splits")
    if not isinstance(splits, dict) or any(not isinstance(splits.get(s), dict) for s in SPLITS):
        return "splits must hold a train and a val table"
    for split in SPLITS:
        table = splits[split]
        shards = table.get("shards")
        if not isinstance(shards, list):
            return f"splits.{split}.shards must be a list"
        for i, shard in enumerate(shards):
            where = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                return f"{where} must be a table"
            for key in ("file", "docs_file", "mask_file"):
                name = shard.get(key)
                if key in shard or key == "file":
                    if not isinstance(name, str) or not _SHARD_FILE.match(name):
                        return f"{where}.{key} {name!r} is not a file name of the dataset ({split}-NNNNN.bin)"
            for key in ("tokens", "documents"):
                value = shard.get(key, 0)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    return f"{where}.{key} must be an integer >= 0, got {value!r}"
        for key in ("tokens", "documents"):
            total = table.get(key)
            if total is not None and total != sum(sh.get(key, 0) for sh in shards):
                return f"splits.{split}.{key} {total!r} is not the sum of its shards'"
    return None


def ensure_prepared(source, out_dir, tokenizer="char", vocab_size=None, tokenizer_path=None, echo=None,
                    names=None, **kw) -> dict:
    """The dataset in out_dir, prepared from `source` only when out_dir is empty (or missing), or holds a dataset of
    the same source files with the same tokenizer whose text changed (or of an older format). None for `source`,
    `tokenizer` or `vocab_size`: not given, the dataset's own is used. A dataset that contradicts a given option is a
    UserError naming it (`names` maps "source", "tokenizer", "vocab_size" to the option names the user knows);
    nothing the user made is replaced."""
    names = {"source": "--input", "tokenizer": "--tokenizer", "vocab_size": "--vocab-size", **(names or {})}
    echo = echo or (lambda *_: None)
    out_dir = Path(out_dir)
    meta, problem = _existing_dataset(out_dir)
    if meta is None and problem is None:  # nothing there yet
        if source is None:
            raise UserError(f"{out_dir} holds no prepared dataset and {names['source']} is not given: prepare one "
                            f"(paratrain prepare --input TEXT --out {out_dir}) or give {names['source']}")
        kind = _tokenizer_kind(tokenizer or "char", tokenizer_path)[0]
        if kind == "bpe" and vocab_size is None:
            raise UserError(f"{names['tokenizer']}=bpe needs {names['vocab_size']} (at least 257: 256 bytes plus "
                            "end-of-text)")
        resolve_inputs(source)  # a missing input is the one line, not after a "preparing" one
        echo(f"preparing {out_dir} from {source} ({kind} tokenizer)")
        return prepare_dataset(source, out_dir, tokenizer=tokenizer or "char", vocab_size=vocab_size,
                               tokenizer_path=tokenizer_path, echo=echo, **kw)
    redo = f"choose another data folder, or replace it: paratrain prepare --input ... --out {out_dir} --overwrite"
    if problem is not None:
        if not problem.startswith("older") or source is None:
            raise UserError(f"{out_dir}: {problem}")
    else:
        clash = _contradiction(meta, out_dir, tokenizer, vocab_size, tokenizer_path, names)
        if clash:
            raise UserError(f"{out_dir} holds a dataset prepared from {_described_source(meta)} with the "
                            f"{meta['tokenizer']} tokenizer (vocab {meta['vocab_size']}); {clash}: leave it unset to "
                            f"use that dataset, or {redo}")
        if source is None or _same_corpus(meta, source):
            return meta
        if sorted(r["path"] for r in meta.get("sources", [])) != sorted(s.record_path() for s in resolve_inputs(source)):
            raise UserError(f"{out_dir} holds a dataset prepared from {_described_source(meta)}; "
                            f"{names['source']}={source} is another corpus: {redo}")
        problem = f"{source} changed since it was prepared"
    kind = meta["tokenizer"] if meta else None
    echo(f"preparing {out_dir} again from {source}: {problem}")
    return prepare_dataset(source, out_dir, tokenizer=tokenizer or kind or "char", vocab_size=vocab_size,
                           tokenizer_path=tokenizer_path, overwrite=True, echo=echo, **kw)


def planned_tokenizer(source, out_dir, tokenizer=None, vocab_size=None, tokenizer_path=None):
    """The tokenizer `ensure_prepared` would prepare an empty (or missing) out_dir with, built now and nothing written
    (BPE trained on the same sample: the same ids); None when out_dir holds something (nothing to prepare, or
    ensure_prepared's own answer) or no source is given."""
    meta, problem = _existing_dataset(Path(out_dir))
    if meta is not None or problem is not None or source is None:
        return None
    kind, path = _tokenizer_kind(tokenizer or "char", tokenizer_path)
    if kind == "bpe" and vocab_size is None:
        return None  # ensure_prepared names the missing option
    _check_vocab_args(kind, vocab_size)
    return _build_tokenizer(kind, path, vocab_size, resolve_inputs(source), "text", int(DEFAULT_SAMPLE_MB * 1e6),
                            lambda *_: None)


def _existing_dataset(out_dir: Path) -> tuple[dict | None, str | None]:
    """(meta, None) for a complete dataset, (None, None) for a missing or empty folder, (None, why) otherwise."""
    if not out_dir.exists():
        return None, None
    if not out_dir.is_dir():
        return None, "is a file, not a dataset folder"
    if not any(out_dir.iterdir()):
        return None, None
    try:
        return read_meta(out_dir), None
    except UserError as e:
        why = str(e)
        return None, ("older format" if "older paratrain" in why else why)


def _contradiction(meta: dict, out_dir: Path, tokenizer, vocab_size, tokenizer_path, names) -> str:
    """What a given option says that the prepared dataset contradicts ('' when nothing)."""
    def said(key, value):  # an option as the user wrote it, or a description such as "the imported model's"
        return names[key] if " " in names[key] else f"{names[key]}={value}"

    if tokenizer is not None:
        kind, path = _tokenizer_kind(tokenizer, tokenizer_path)
        if path is not None:  # a file: the same content is the same tokenizer, whatever the dataset recorded it as
            other = tokenizer_identity(HFTokenizer.from_file(path)) != tokenizer_identity(load_tokenizer(out_dir))
        else:
            other = kind != meta["tokenizer"]
        if other:
            return f"{said('tokenizer', tokenizer_path or tokenizer)} is another tokenizer"
    if vocab_size is not None and vocab_size not in (meta.get("requested_vocab_size"), meta["vocab_size"]):
        return f"{said('vocab_size', vocab_size)} contradicts it"
    return ""


def _described_source(meta: dict) -> str:
    paths = [Path(r["path"]).name for r in meta.get("sources", [])]
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "") if paths else "an unknown source"


def _same_corpus(meta: dict, source) -> bool:
    sources = resolve_inputs(source)
    if meta.get("source_fingerprint") == source_fingerprint(sources):
        return True  # same files, sizes and modification times
    return meta.get("source_sha256") == source_checksum(source)

