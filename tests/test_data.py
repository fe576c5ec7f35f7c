"""Data pipeline: tokenizers, streamed prepare (formats, EOS/BOS, shards, errors, atomicity, restart),
deterministic loader (random and sequential windows, shards, mixtures, data-parallel rows, resume)."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from paratrain.errors import ConfigError, UserError
from paratrain.data import DEFAULT_CORPUS, TokenData, choose_dtype, ensure_prepared, load_tokenizer, prepare_dataset, read_meta
from paratrain.data import parse_sources
from paratrain.commands import prepare as prepare_command
from paratrain.data import prepare as prep
from paratrain.data import sources as srcmod
from paratrain.data.loader import Shards, permute
from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer

from conftest import fast_config

CORPUS = DEFAULT_CORPUS.read_text()[:20_000]
SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
# Documents for the format tests: a few of them, one with non-ASCII text and one with a literal EOS string.
DOCS = [CORPUS[i * 700:(i + 1) * 700] for i in range(9)] + ["héllo wörld €", "a <|endoftext|> b"]


def raises_one_line(fn, *args, match=None, **kw):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value) and str(e.value)
    return str(e.value)


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def split_tokens(data_dir, split):
    meta = read_meta(data_dir)
    return np.concatenate([np.fromfile(data_dir / s["file"], dtype=meta["dtype"]) for s in meta["splits"][split]["shards"]])


def tokens(data_dir):
    return [split_tokens(data_dir, s) for s in ("train", "val")]


def expected_stream(tok, docs):
    """Each whole document encoded at once (special-token strings in it stay text), BOS/EOS around it."""
    out = []
    for d in docs:
        out += ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_arrays([d])[0].tolist() + [tok.eos_id]
    return out


def listing(path):
    return sorted(p.name for p in path.iterdir())


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    HFTokenizer.train_bpe([CORPUS], 300).save(d)
    return d / "tokenizer.json"


# ---------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "tokenizer.json"])
def test_tokenizer_round_trip(kind, tmp_path, bpe_file):
    tok = {"byte": ByteTokenizer, "char": lambda: CharTokenizer.from_text(CORPUS),
           "bpe": lambda: HFTokenizer.train_bpe([CORPUS], 300),
           "tokenizer.json": lambda: HFTokenizer.from_file(bpe_file)}[kind]()
    assert tok.kind == kind
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE and max(ids) < tok.vocab_size
    assert tok.eos_id is not None and tok.eos_id not in ids and tok.bos_id is None
    assert [a.tolist() for a in tok.encode_arrays([SAMPLE, "ab"])] == [ids, tok.encode("ab")]
    assert tok.decode(ids + [tok.eos_id]) == SAMPLE  # EOS decodes to nothing
    tok.save(tmp_path)
    back = load_tokenizer(tmp_path)
    assert (back.kind, back.vocab_size, back.encode(SAMPLE), back.eos_id, back.bos_id) == \
        (kind, tok.vocab_size, ids, tok.eos_id, tok.bos_id)
    if kind in ("bpe", "tokenizer.json"):
        assert len(ids) < len(SAMPLE) and tok.vocab_size == 300 and tok.eos_id == 0  # merges happened


def test_special_ids():
    byte, char = ByteTokenizer(), CharTokenizer.from_text("ab")
    assert (byte.vocab_size, byte.eos_id, byte.bos_id) == (257, 256, None)
    assert (char.vocab_size, char.eos_id, char.encode("ba")) == (3, 2, [1, 0])
    assert ByteTokenizer(eos=False).vocab_size == 256 and CharTokenizer("ab", eos=False).vocab_size == 2


def test_hf_special_tokens_from_config(tmp_path, bpe_file):
    tok = HFTokenizer.from_file(bpe_file)
    tok.tok.add_special_tokens(["<s>", "</s>"])
    tok.tok.save(str(tmp_path / "tokenizer.json"))
    plain = HFTokenizer.from_file(tmp_path / "tokenizer.json")  # no config: well-known names
    vocab = plain.tok.get_vocab(with_added_tokens=True)
    assert (plain.eos_id, plain.bos_id) == (0, vocab["<s>"])  # <|endoftext|> comes first in EOS_NAMES
    write(tmp_path / "tokenizer_config.json", json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    configured = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert (configured.eos_id, configured.bos_id) == (vocab["</s>"], vocab["<s>"])


def test_byte_tokenizer_unicode_and_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo €")) == "héllo €"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # truncated UTF-8 is replaced, not an error


def test_char_outside_vocab():
    tok = CharTokenizer.from_text(CORPUS)
    msg = raises_one_line(tok.encode, "Zebra costs 5€\n", match="not in the char-level")
    assert "'€'" in msg and "'F'" not in msg
    raises_one_line(tok.encode_arrays, ["fine", "Zebra costs 5€\n"], match="'€'")


def test_bad_tokenizer_file(tmp_path):
    raises_one_line(HFTokenizer.from_file, tmp_path / "nope.json", match="not found")
    raises_one_line(HFTokenizer.from_file, write(tmp_path / "bad.json", "{not json"), match="cannot read")
    src = write(tmp_path / "a.txt", CORPUS)
    raises_one_line(prepare_dataset, src, tmp_path / "d", tokenizer=str(tmp_path / "nope.json"), match="not found")
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------- prepare: formats

def write_format(folder, fmt, docs, field="text"):
    """The same documents in one of the input formats; returns what to pass as --input."""
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if fmt == "txt-folder":  # one document per file, in nested folders (found recursively, sorted)
        for i, d in enumerate(docs):
            write(folder / f"part{i // 4}" / f"doc{i:02d}.txt", d)
        write(folder / "notes.md", "not a document")
        return folder
    if fmt == "jsonl":
        return write(folder / "a.jsonl", lines)
    if fmt == "jsonl.gz":  # several shards, matched by a pattern
        half = len(docs) // 2
        write(folder / "s0.jsonl.gz", gzip.compress("".join(lines.splitlines(True)[:half]).encode()))
        write(folder / "s1.jsonl.gz", gzip.compress("".join(lines.splitlines(True)[half:]).encode()))
        return str(folder / "*.jsonl.gz")
    if fmt == "jsonl.zst":
        import zstandard

        return write(folder / "a.jsonl.zst", zstandard.ZstdCompressor().compress(lines.encode()))
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), folder / "a.parquet", row_group_size=3)
        return folder / "a.parquet"
    if fmt == "hf":
        import datasets

        datasets.Dataset.from_dict({field: docs}).save_to_disk(str(folder / "saved"))
        return folder / "saved"
    raise ValueError(fmt)


@pytest.mark.parametrize("fmt", ["txt-folder", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"])
def test_every_input_format(tmp_path, fmt):
    src = write_format(tmp_path / "in", fmt, DOCS, field="body")
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="byte", text_field="body", val_fraction=0.2)
    tok = ByteTokenizer()
    val_docs = [d for i, d in enumerate(DOCS) if prep.is_validation_doc(i, 0.2)]
    train_docs = [d for d in DOCS if d not in val_docs]
    assert len(val_docs) == 2 and meta["val_split"] == "documents"
    train, val = tokens(tmp_path / "d")
    assert train.tolist() == expected_stream(tok, train_docs) and val.tolist() == expected_stream(tok, val_docs)
    assert (meta["train_documents"], meta["val_documents"]) == (9, 2)
    assert sum(s["documents"] for s in meta["sources"]) == len(DOCS)
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in meta["sources"])
    assert ".partial" not in " ".join(listing(tmp_path))


def test_eos_and_bos_placement_and_document_index(tmp_path, bpe_file):
    # A tokenizer.json whose config names a BOS and an EOS: every document is BOS + text + EOS.
    base = HFTokenizer.from_file(bpe_file)
    base.tok.add_special_tokens(["<s>", "</s>"])
    (tmp_path / "tok").mkdir()
    base.tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    write(tmp_path / "tok" / "tokenizer_config.json", json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    src = write_format(tmp_path / "in", "jsonl", DOCS)
    meta = prepare_dataset(src, tmp_path / "d", tokenizer=str(tmp_path / "tok" / "tokenizer.json"), val_fraction=0.2,
                           shard_tokens=333)
    tok = load_tokenizer(tmp_path / "d")
    assert (meta["eos_id"], meta["bos_id"]) == (tok.eos_id, tok.bos_id) and None not in (tok.eos_id, tok.bos_id)
    train_docs = [d for i, d in enumerate(DOCS) if not prep.is_validation_doc(i, 0.2)]
    train = split_tokens(tmp_path / "d", "train")
    assert train.tolist() == expected_stream(tok, train_docs)
    assert "a <|endoftext|> b" in train_docs and (train == tok.eos_id).sum() == len(train_docs)  # literal text stays text
    assert len(meta["splits"]["train"]["shards"]) > 3 and all(s["tokens"] <= 333 for s in meta["splits"]["train"]["shards"])
    # The index records where every document ends, across shards.
    ends = Shards(tmp_path / "d", "train", meta).document_ends()
    assert ends.tolist() == (np.flatnonzero(train == tok.eos_id) + 1).tolist()
    assert ends[-1] == len(train) and sum(s["documents"] for s in meta["splits"]["train"]["shards"]) == len(train_docs)


def test_single_text_file_gets_one_eos_and_a_token_split(tmp_path):
    meta = prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", tokenizer="char")
    train, val = tokens(tmp_path / "d")
    assert meta["dtype"] == "uint16" and train.dtype == np.uint16 and meta["val_split"].startswith("tokens")
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val)) == (18_000, 2_001)
    tok = load_tokenizer(tmp_path / "d")
    stream = np.concatenate([train, val])
    assert stream[-1] == tok.eos_id and (stream == tok.eos_id).sum() == 1
    assert tok.decode(stream.tolist()) == CORPUS
    assert (meta["train_documents"], meta["val_documents"]) == (0, 1)
    assert meta["source_sha256"] == prep.source_checksum(tmp_path / "a.txt")
    assert listing(tmp_path) == ["a.txt", "d"]  # no temp folders left


def test_streamed_equals_whole_file(tmp_path, bpe_file, monkeypatch):
    """Long documents in pieces, small tasks, small shards, two worker processes: the same tokens as
    encoding each whole document at once."""
    monkeypatch.setattr(srcmod, "PIECE_CHARS", 1000)
    monkeypatch.setattr(srcmod, "READ_BYTES", 777)
    monkeypatch.setattr(prep, "TASK_CHARS", 3000)
    long_docs = [CORPUS, CORPUS[5000:17000], "short one", CORPUS[:9000]]
    write(tmp_path / "in" / "a.txt", CORPUS)
    write(tmp_path / "in" / "b.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in long_docs[1:]))
    whole = HFTokenizer.from_file(bpe_file)
    for workers in (0, 2):
        meta = prepare_dataset(tmp_path / "in", tmp_path / f"d{workers}", tokenizer=str(bpe_file), val_fraction=0.25,
                               shard_tokens=1000, workers=workers)
        train, val = tokens(tmp_path / f"d{workers}")
        assert train.tolist() == expected_stream(whole, [d for i, d in enumerate(long_docs) if not prep.is_validation_doc(i, 0.25)])
        assert val.tolist() == expected_stream(whole, [long_docs[3]])
        assert meta["vocab_size"] == 300 and len(meta["splits"]["train"]["shards"]) > 5


def test_bpe_trained_on_a_bounded_sample(tmp_path):
    src = write_format(tmp_path / "in", "jsonl.gz", DOCS)
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="bpe", vocab_size=300, val_fraction=0.2, sample_mb=0.001)
    tok = load_tokenizer(tmp_path / "d")
    assert meta["vocab_size"] == 300 and meta["requested_vocab_size"] == 300 and tok.eos_id == 0
    train, val = tokens(tmp_path / "d")
    assert tok.decode(np.concatenate([train, val]).tolist()).count("héllo wörld €") == 1


def test_val_input(tmp_path):
    train_src = write_format(tmp_path / "t", "jsonl", DOCS[:4])
    val_src = write(tmp_path / "v.txt", "held out")
    meta = prepare_dataset(train_src, tmp_path / "d", tokenizer="byte", val_input=val_src)
    train, val = tokens(tmp_path / "d")
    assert train.tolist() == expected_stream(ByteTokenizer(), DOCS[:4]) and bytes(val[:-1].astype(np.uint8)) == b"held out"
    assert meta["val_split"] == "val-input" and meta["val_sources"][0]["path"].endswith("v.txt")


def test_choose_dtype():
    assert choose_dtype(65) == choose_dtype(65536) == "uint16"
    assert choose_dtype(65537) == choose_dtype(100_000) == "uint32"
    assert choose_dtype(300, "uint32") == "uint32"
    msg = raises_one_line(choose_dtype, 100_000, "uint16")
    assert msg == "vocab size 100000 does not fit in uint16 (max 65536); use --dtype uint32"


def test_forced_uint32(tmp_path):
    meta = prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", dtype="uint32")
    assert meta["dtype"] == "uint32" and tokens(tmp_path / "d")[0].dtype == np.uint32


def _truncated_gz(tmp_path):
    data = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode())
    return data[:len(data) // 2]


def _parquet(tmp_path, name, table):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), tmp_path / name)


@pytest.mark.parametrize("name, content, kw, match", [
    ("missing.txt", None, {}, "not found"),
    ("empty.txt", "", {}, "empty"),
    ("blank.txt", " \n\t\n", {}, "empty"),
    ("bad.txt", b"abc\xffdef", {}, "bad.txt is not valid UTF-8.*offset 3"),
    ("a.jsonl", '{"text": "ok"}\n{"txt": "no"}\n', {}, "a.jsonl line 2.*text"),
    ("a.jsonl", '{"text": "ok"}\n{"text": 5}\n', {}, "line 2.*text"),
    ("b.jsonl", '{"text": "ok"}\n{oops\n', {}, "b.jsonl line 2: not valid JSON"),
    ("c.jsonl.gz", gzip.compress(b'{"text": "ok"}\n{"text": "caf\xe9"}\n', mtime=0), {}, r"c.jsonl.gz line 2: not valid UTF-8: bad byte 0xe9 at byte offset 28"),
    ("d.jsonl.gz", "truncated", {}, r"d.jsonl.gz: truncated gzip stream: the file ends at byte offset \d+ .*after line \d+"),
    ("e.jsonl.gz", b"not gzip at all\n", {}, r"e.jsonl.gz: corrupt gzip data at compressed byte offset 0\.\.\d+ .*after line 0"),
    ("m.parquet", "parquet-missing", dict(text_field="content"), r"m.parquet: no column 'content' \(columns: id, text\)"),
    ("n.parquet", "parquet-null", {}, r"n.parquet row 3: column 'text' holds null"),
    ("p.parquet", b"PAR1 not really", {}, "p.parquet: not a readable parquet file"),
    ("few.jsonl", "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)), {}, "leaves no validation document"),
    ("a.txt", CORPUS, dict(tokenizer="wordpiece"), "unknown tokenizer"),
    ("a.txt", CORPUS, dict(tokenizer="bpe"), "needs --vocab-size"),
    ("a.txt", CORPUS, dict(tokenizer="bpe", vocab_size=256), "at least 257"),
    ("a.txt", CORPUS, dict(tokenizer="char", vocab_size=300), "only applies"),
    ("a.txt", CORPUS, dict(val_fraction=0.6), "val fraction"),
    ("a.txt", CORPUS, dict(val_fraction=0), "val fraction"),
    ("a.txt", CORPUS, dict(dtype="int8"), "unknown dtype"),
    ("a.txt", CORPUS, dict(workers=-1), "workers"),
    ("a.txt", CORPUS, dict(shard_tokens=0), "shard tokens"),
    ("tiny.txt", "abc", {}, "too small"),
])
def test_bad_inputs(tmp_path, name, content, kw, match):
    if content == "truncated":
        content = _truncated_gz(tmp_path)
    if content == "parquet-missing":
        _parquet(tmp_path, name, {"id": [1, 2], "text": ["a", "b"]})
    elif content == "parquet-null":
        _parquet(tmp_path, name, {"text": ["a", "b", None, "d"]})
    elif content is not None:
        write(tmp_path / name, content)
    raises_one_line(prepare_dataset, tmp_path / name, tmp_path / "d", match=match, **kw)
    assert listing(tmp_path) == ([] if content is None else [name])  # nothing written


def test_input_patterns_and_folders(tmp_path):
    raises_one_line(prepare_dataset, str(tmp_path / "*.jsonl.gz"), tmp_path / "d", match=r"pattern .*\*.jsonl.gz matches no files")
    write(tmp_path / "src" / "notes.md", "text")
    raises_one_line(prepare_dataset, tmp_path / "src", tmp_path / "d", match="has no .txt, .jsonl")
    raises_one_line(prepare_dataset, tmp_path / "src" / "notes.md", tmp_path / "d", val_input=tmp_path / "nope.txt",
                    match="validation input not found")
    assert listing(tmp_path) == ["src"]


def test_existing_out_dir(tmp_path):
    src = write(tmp_path / "a.txt", CORPUS)
    prepare_dataset(src, tmp_path / "d", tokenizer="char")
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}
    raises_one_line(prepare_dataset, src, tmp_path / "d", tokenizer="byte", match="--overwrite")
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before
    # a failing overwrite (bad input) also keeps the old data
    raises_one_line(prepare_dataset, write(tmp_path / "e.txt", ""), tmp_path / "d", overwrite=True, match="empty")
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="byte", overwrite=True)
    assert read_meta(tmp_path / "d")["tokenizer"] == meta["tokenizer"] == "byte"
    assert not (tmp_path / "d" / "chars.json").exists()
    assert listing(tmp_path) == ["a.txt", "d", "e.txt"]
    # a folder holding someone else's files is never replaced
    write(tmp_path / "d" / "notes.txt", "mine")
    raises_one_line(prepare_dataset, src, tmp_path / "d", overwrite=True, match="not part of a dataset")


def test_old_format_is_prepared_again(tmp_path):
    src = write(tmp_path / "a.txt", CORPUS)
    old = tmp_path / "d"
    old.mkdir()
    np.arange(100, dtype=np.uint16).tofile(old / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(old / "val.bin")
    write(old / "meta.json", json.dumps({"tokenizer": "char", "vocab_size": 65, "dtype": "uint16"}))
    raises_one_line(read_meta, old, match="older paratrain.*prepare it again")
    raises_one_line(TokenData, old, "train", 16, match="older paratrain")
    meta = ensure_prepared(src, old)
    assert meta["format"] == prep.FORMAT and not (old / "train.bin").exists() and read_meta(old)["train_tokens"] == 18_000


def test_truncated_shard_is_detected(tmp_path):
    prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", shard_tokens=5000)
    os.truncate(tmp_path / "d" / "train-00001.bin", 100)
    raises_one_line(read_meta, tmp_path / "d", match="train-00001.bin is missing or has the wrong size")


def test_read_meta_and_ensure_prepared(tmp_path, monkeypatch):
    """A prepared folder is reused as it is; only the same source files, changed, are prepared again; a folder of
    another tokenizer, vocabulary or corpus is a one-line error and stays byte-identical."""
    raises_one_line(read_meta, tmp_path, match="not a prepared dataset")
    src = write(tmp_path / "a.txt", CORPUS)
    meta = ensure_prepared(src, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}
    calls = []
    monkeypatch.setattr(prep, "prepare_dataset", lambda *a, **k: calls.append(k) or {})
    assert ensure_prepared(src, tmp_path / "d") == meta and not calls  # up to date: reused
    assert ensure_prepared(None, tmp_path / "d", tokenizer=None) == meta and not calls  # nothing given: its own
    os.utime(src, ns=(0, 0))
    assert ensure_prepared(src, tmp_path / "d") == meta and not calls  # touched, same bytes: still reused
    raises_one_line(ensure_prepared, src, tmp_path / "d", tokenizer="byte", match="--tokenizer=byte is another tokenizer")
    raises_one_line(ensure_prepared, src, tmp_path / "d", tokenizer="bpe", vocab_size=300, match="another tokenizer")
    other = write(tmp_path / "b.txt", CORPUS[:5000])
    raises_one_line(ensure_prepared, other, tmp_path / "d", match="is another corpus")
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before and not calls
    write(src, CORPUS + "more")
    ensure_prepared(src, tmp_path / "d")  # the same file, changed: redone
    assert len(calls) == 1 and calls[0]["overwrite"]
    (tmp_path / "e").mkdir()
    raises_one_line(ensure_prepared, None, tmp_path / "e", match="holds no prepared dataset")


def test_interrupted_prepare_starts_clean(tmp_path):
    """A prepare killed mid-way leaves only the hidden .partial folder (never a dataset that looks complete);
    the next prepare removes it and starts clean. A live prepare's folder is left alone."""
    src = write_format(tmp_path / "in", "jsonl", DOCS * 20)
    script = (
        "import sys, time\n"
        "from paratrain.data import prepare as p\n"
        "real = p.SplitWriter.write\n"
        "def slow(self, ids, end):\n"
        "    real(self, ids, end)\n"
        "    print('wrote', flush=True); time.sleep(0.05)\n"
        "p.SplitWriter.write = slow\n"
        "p.TASK_CHARS = 500\n"
        f"p.prepare_dataset({str(src)!r}, {str(tmp_path / 'd')!r}, tokenizer='byte', workers=0, shard_tokens=2000)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(5):
        assert proc.stdout.readline().startswith("wrote")
    proc.kill()
    proc.wait()
    partial = tmp_path / ".d.partial"
    assert not (tmp_path / "d").exists() and partial.is_dir() and not (partial / "meta.json").exists()
    assert any(p.suffix == ".bin" for p in partial.iterdir())
    raises_one_line(read_meta, partial, match="not a prepared dataset")
    messages = []
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="byte", echo=messages.append)
    assert any("interrupted prepare" in m for m in messages) and not partial.exists()
    assert meta["train_documents"] + meta["val_documents"] == len(DOCS) * 20
    # a prepare that is still running (a live pid on this host) is not disturbed
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        partial.mkdir()
        write(partial / "owner.json", json.dumps({"pid": sleeper.pid, "host": prep.socket.gethostname()}))
        raises_one_line(prepare_dataset, src, tmp_path / "d", tokenizer="byte", overwrite=True, match=f"pid {sleeper.pid}")
        assert (partial / "owner.json").exists() and read_meta(tmp_path / "d") == meta
    finally:
        sleeper.kill()
        sleeper.wait()


def test_main_prepare(tmp_path, capsys):
    src = write(tmp_path / "a.txt", CORPUS)
    assert prepare_command.main(["--input", str(src), "--out", str(tmp_path / "d"), "--tokenizer", "byte", "--quiet"]) == 0
    assert "byte" in capsys.readouterr().out and read_meta(tmp_path / "d")["train_tokens"] == 18_000
    with pytest.raises(UserError):
        prepare_command.main(["--input", str(src), "--out", str(tmp_path / "d")])


def test_cli_prepare_error_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "paratrain", "prepare", "--input", str(tmp_path / "*.jsonl.zst"),
                           "--out", str(tmp_path / "d")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: input pattern") and listing(tmp_path) == []


# ---------------------------------------------------------------------------- loader

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """tinyshakespeare in shards of 100k tokens: windows cross shard boundaries."""
    d = tmp_path_factory.mktemp("ds") / "shakespeare"
    prepare_dataset(DEFAULT_CORPUS, d, tokenizer="char", shard_tokens=100_000)
    return d


def test_batches_shift_and_types(data_dir):
    data = TokenData(data_dir, "train", 64)
    assert len(data.streams[0].files) == 11
    x, y = data.global_batch(0, 8, seed=1)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    raw = split_tokens(data_dir, "train")
    o = int(data.offsets(0, 8, 1)[3])
    assert torch.equal(y[3], torch.from_numpy(raw[o + 1:o + 65].astype(np.int64)))
    crossing = data.streams[0].read(100_000 - 10, 65)  # across the first shard boundary
    assert crossing.tolist() == raw[100_000 - 10:100_000 + 55].tolist()


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_batches_deterministic(data_dir, mode):
    a, b = TokenData(data_dir, "train", 32, mode), TokenData(data_dir, "train", 32, mode)
    x5, _ = a.global_batch(5, 16, seed=7)
    a.global_batch(0, 16, seed=7)  # call order and history must not matter
    assert torch.equal(b.global_batch(5, 16, seed=7)[0], x5)
    assert torch.equal(a.global_batch(5, 16, seed=7)[0], x5)
    assert not torch.equal(a.global_batch(6, 16, seed=7)[0], x5)
    assert not torch.equal(a.global_batch(5, 16, seed=8)[0], x5)
    assert not torch.equal(TokenData(data_dir, "val", 32, mode).offsets(5, 16, 7), a.offsets(5, 16, 7))


@pytest.mark.parametrize("mode", ["random", "sequential"])
@pytest.mark.parametrize("dp_size, accum", [(1, 1), (2, 1), (4, 2), (1, 8), (8, 2)])
def test_dp_sharding_matches_global(data_dir, dp_size, accum, mode):
    data = TokenData(data_dir, "train", 16, mode)
    gx, gy = data.global_batch(3, 16, seed=0)
    parts = [mb for r in range(dp_size) for mb in data.micro_batches(3, 16, 0, r, dp_size, accum)]
    assert len(parts) == dp_size * accum and all(x.shape == (16 // (dp_size * accum), 16) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), gx) and torch.equal(torch.cat([y for _, y in parts]), gy)


def test_sequential_visits_every_window_once_per_epoch(tmp_path):
    prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", tokenizer="char", shard_tokens=3000)
    data = TokenData(tmp_path / "d", "train", 32, "sequential")
    n_windows = data.windows[0]
    assert n_windows == (18_000 - 1) // 32
    batch = 8
    steps = 3 * n_windows // batch + 1
    starts = np.concatenate([data.offsets(s, batch, seed=3).numpy() for s in range(steps)])
    epochs = [starts[e * n_windows:(e + 1) * n_windows] for e in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == [w * 32 for w in range(n_windows)]  # each window exactly once
    assert epochs[0].tolist() != epochs[1].tolist() != epochs[2].tolist()  # a new order every epoch
    assert epochs[0].tolist() != sorted(epochs[0].tolist())  # shuffled
    p = data.progress(steps, batch)
    assert p["data_epoch"] == pytest.approx(steps * batch / n_windows) and p["data_tokens"] == {"d": steps * batch * 32}


def test_permutation_is_a_bijection():
    for n in (1, 2, 3, 17, 1000, 4097):
        out = permute(np.arange(n), n, key=12345)
        assert sorted(out.tolist()) == list(range(n))
    assert permute(np.arange(1000), 1000, 1).tolist() != permute(np.arange(1000), 1000, 2).tolist()


def test_loader_errors(data_dir, tmp_path):
    with pytest.raises(ValueError):
        TokenData(data_dir, "train", 16).micro_batches(0, 10, 0, 0, 4, 1)
    raises_one_line(TokenData, data_dir, "val", 200_000, match="val split.*tokens")
    raises_one_line(TokenData, tmp_path, "train", 16, match="not a prepared dataset")
    raises_one_line(TokenData, data_dir, "train", 16, "shuffled", match="data mode")


def test_eval_sequences_fixed(data_dir):
    """The evaluation set is a pure function of (seed, index): any slice of it reads the same sequences."""
    data = TokenData(data_dir, "val", 32)
    x, y = data.eval_sequences(0, 150)
    assert torch.equal(x, data.eval_sequences(0, 150)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    for first, count in ((0, 7), (5, 90), (63, 2), (100, 50)):  # across the read blocks
        xs, ys = data.eval_sequences(first, count)
        assert torch.equal(xs, x[first:first + count]) and torch.equal(ys, y[first:first + count])
    assert not torch.equal(x[0], x[1]) and not torch.equal(x, data.eval_sequences(0, 150, seed=1)[0])


# ---------------------------------------------------------------------------- mixtures

@pytest.fixture(scope="module")
def mixture_dirs(tmp_path_factory, bpe_file):
    """Three small datasets with the same byte tokenizer (and one with another tokenizer)."""
    root = tmp_path_factory.mktemp("mix")
    dirs = {}
    for name, text in (("a", CORPUS), ("b", CORPUS[::-1]), ("c", CORPUS.upper())):
        dirs[name] = root / name
        prepare_dataset(write(root / f"{name}.txt", text), dirs[name], tokenizer="byte", shard_tokens=4000)
    dirs["other"] = root / "other"
    prepare_dataset(root / "a.txt", dirs["other"], tokenizer=str(bpe_file))
    return dirs


def test_mixture_weights_hold(mixture_dirs):
    spec = [{"dir": str(mixture_dirs["a"]), "weight": 0.6}, {"dir": str(mixture_dirs["b"]), "weight": 0.3},
            {"dir": str(mixture_dirs["c"]), "weight": 0.1}]
    data = TokenData(spec, "train", 16)
    batch, steps = 8, 1000
    which = np.concatenate([data.windows_for(np.arange(s * batch, (s + 1) * batch), 0, batch)[0] for s in range(steps)])
    share = np.bincount(which, minlength=3) / (batch * steps)
    assert np.abs(share - [0.6, 0.3, 0.1]).max() < 0.02
    # rows really come from their dataset: c is upper-case text, b is reversed
    x, _ = data.global_batch(0, 10, seed=0)
    w, starts = data.windows_for(np.arange(10), 0, 10)
    for row, (i, o) in enumerate(zip(w.tolist(), starts.tolist())):
        assert x[row].tolist() == data.streams[i].read(o, 17)[:16].tolist()
    p = data.progress(steps, batch)
    assert sum(p["data_tokens"].values()) == steps * batch * 16 and set(p["data_epochs"]) == {"a", "b", "c"}
    # every data-parallel rank reads only its rows, and together they make the global batch
    for mode in ("random", "sequential"):
        data = TokenData(spec, "train", 16, mode)
        gx, _ = data.global_batch(7, 16, seed=1)
        parts = [x for r in range(4) for x, _ in data.micro_batches(7, 16, 1, r, 4, 2)]
        assert torch.equal(torch.cat(parts), gx)


def test_mixture_errors(mixture_dirs, tmp_path):
    a, other = str(mixture_dirs["a"]), str(mixture_dirs["other"])
    raises_one_line(TokenData, [{"dir": a, "weight": 0.5}, {"dir": other, "weight": 0.5}], "train", 16,
                    match="different tokenizer")
    for bad, match in (([{"dir": a, "weight": -1}], "weight must be a number >= 0"),
                       ([{"dir": a, "weight": 0}, {"dir": other, "weight": 0.0}], "all zero"),
                       ([{"path": a}], "must be a table with a 'dir'"),
                       ([{"dir": a, "weight": 1, "wieght": 2}], "unknown key"),
                       ([], "non-empty")):
        with pytest.raises(ConfigError, match=match) as e:
            parse_sources(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="all zero"):
        fast_config(a, tmp_path, "mix", f'data.sources=[{{dir = "{a}", weight = 0}}]')
    assert listing(tmp_path) == []


def test_mixture_trains_and_logs_tokens_per_source(mixture_dirs, tmp_path):
    from paratrain.api import train_rank as train

    sources = f'data.sources=[{{dir = "{mixture_dirs["a"]}", weight = 3}}, {{dir = "{mixture_dirs["b"]}", weight = 1}}]'
    result = train(fast_config("unused", tmp_path, "mix", sources, "training.steps=3", "training.eval_every=0"))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open() if '"loss"' in line]
    assert records[-1]["data_tokens"] == {"a": 3 * 4 * 32 * 3 // 4, "b": 3 * 4 * 32 // 4}
    assert 0 < records[-1]["data_epoch"] < 1 and result.val_loss is not None
    from paratrain.config import load_config

    saved = load_config(result.run_dir / "config.toml").data.sources  # the run's config.toml replays the mixture
    assert saved == [{"dir": str(mixture_dirs["a"]), "weight": 3}, {"dir": str(mixture_dirs["b"]), "weight": 1}]


# ---------------------------------------------------------------------------- training on shards

def test_sequential_crash_mid_epoch_and_resume_is_exact(tmp_path):
    """Sequential mode over a dataset of 4 steps per epoch: a run SIGKILLed before step 7 (checkpoint at step 5,
    mid-epoch) and resumed gives bitwise the losses of a straight 10-step run that crosses two epoch ends."""
    from paratrain.config import load_config
    from paratrain.api import train_rank as train

    from conftest import fast_overrides

    d = tmp_path / "small"
    src = write(tmp_path / "a.txt", CORPUS[:600])
    prepare_dataset(src, d, tokenizer="char", shard_tokens=100)
    common = [f"data.source={src}", "data.mode=sequential", "training.steps=10", "training.eval_every=0",
              "optimizer.warmup_steps=2", "checkpoint.every=5"]
    straight = train(fast_config(d, tmp_path, "straight", *common))
    records = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").open() if '"loss"' in line]
    epochs = [r["data_epoch"] for r in records]
    assert epochs[4] == 5 / 4 and epochs[-1] == 10 / 4  # 16 windows of 32, 4 per step: the save is mid-epoch

    overrides = ["--" + o for o in fast_overrides(d, tmp_path, "crashed", *common)]
    env = {**os.environ, "PARATRAIN_FAULTS": "kill@7", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *overrides], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and (tmp_path / "crashed" / "checkpoints" / "step-5").is_dir(), proc.stderr[-2000:]
    resumed = train(load_config(None, fast_overrides(d, tmp_path, "crashed", *common, "checkpoint.resume=auto")))
    assert resumed.losses == straight.losses[5:]  # bitwise
    assert resumed.val_loss == straight.val_loss


def test_verify_rows_pass_on_a_sharded_dataset(tmp_path):
    from paratrain.verify import run_verify

    d = tmp_path / "sharded"
    prepare_dataset(DEFAULT_CORPUS, d, tokenizer="char", shard_tokens=50_000)
    assert len(read_meta(d)["splits"]["train"]["shards"]) > 10
    # sequential windows (the new path; random windows run in tests/test_distributed.py), across shard boundaries
    rows, _ = run_verify(["ddp2", "fsdp2"], steps=5, tolerance=1e-5,
                         extra_args=[f"data.dir={d}", "data.mode=sequential"], echo=lambda line: None)
    assert len(rows) == 2 and all(r.passed for r in rows), [(r.layout, r.max_loss_diff, r.max_weight_diff, r.note) for r in rows]


class _CountingReader:
    """A file's bytes that count how much was read."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def _array_items(data: bytes, monkeypatch, block: int = 100):
    monkeypatch.setattr(srcmod, "READ_BYTES", block)
    reader = _CountingReader(data)
    items = srcmod.json_array_items(reader, srcmod.Path("a.json"), lambda fn, line: fn())
    return reader, items


def test_a_broken_json_array_item_fails_where_it_is_not_at_the_end_of_the_file(monkeypatch):
    """A malformed item is reported once the text past it is read, not after reading the rest of the file; a long
    string item cut across many blocks still parses (read on in doubling steps)."""
    tail = b"".join(b', {"text": "%d"}' % i for i in range(20_000))  # ~300 KB after the broken item
    reader, items = _array_items(b'[{"text": "fine"},\n {"text": "a" "b"}' + tail + b"]", monkeypatch)
    assert next(items) == (1, {"text": "fine"})
    with pytest.raises(UserError, match=r"a.json line 2: not a valid JSON array \(Expecting ','"):
        next(items)
    assert reader.pos < 1000, reader.pos
    long_text = "x" * 50_000 + "\\u00e9" + "y" * 50_000
    reader, items = _array_items(b'[{"text": "' + long_text.encode() + b'"}, {"text": "z"}]', monkeypatch)
    assert [value["text"] for _, value in items] == [json.loads(f'"{long_text}"'), "z"]
    _, items = _array_items(b'[{"text": "never closed' + b"x" * 5000, monkeypatch)
    with pytest.raises(UserError, match="Unterminated string"):
        list(items)
