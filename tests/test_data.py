"""Data pipeline: tokenizers, prepare (formats, dtype, errors, atomicity), deterministic loader."""


import numpy as np
import pytest
import torch

from paratrain.errors import UserError
from paratrain.data import DEFAULT_CORPUS, TokenData, choose_dtype, ensure_prepared, load_tokenizer, prepare_dataset, read_meta
from paratrain.data import prepare as prep
from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer

CORPUS = DEFAULT_CORPUS.read_text()[:20_000]
SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def raises_one_line(fn, *args, match=None, **kw):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value) and str(e.value)
    return str(e.value)


def write(path, content):
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def tokens(data_dir):
    meta = read_meta(data_dir)
    return [np.fromfile(data_dir / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]


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
    tok.save(tmp_path)
    back = load_tokenizer(tmp_path)
    assert (back.kind, back.vocab_size, back.encode(SAMPLE)) == (kind, tok.vocab_size, ids)
    if kind in ("bpe", "tokenizer.json"):
        assert len(ids) < len(SAMPLE) and tok.vocab_size == 300  # merges happened


def test_byte_tokenizer_unicode_and_bad_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.decode(tok.encode("héllo €")) == "héllo €"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # truncated UTF-8 is replaced, not an error


def test_char_outside_vocab():
    msg = raises_one_line(CharTokenizer.from_text(CORPUS).encode, "Zebra costs 5€\n", match="not in the char-level")
    assert "'€'" in msg and "'F'" not in msg


def test_bad_tokenizer_file(tmp_path):
    raises_one_line(HFTokenizer.from_file, tmp_path / "nope.json", match="not found")
    raises_one_line(HFTokenizer.from_file, write(tmp_path / "bad.json", "{not json"), match="cannot read")
    src = write(tmp_path / "a.txt", CORPUS)
    raises_one_line(prepare_dataset, src, tmp_path / "d", tokenizer=str(tmp_path / "nope.json"), match="not found")
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------- prepare

def test_prepare_txt_file(tmp_path):
    meta = prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", tokenizer="char")
    train, val = tokens(tmp_path / "d")
    assert meta["dtype"] == "uint16" and train.dtype == np.uint16
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val)) == (18_000, 2_000)
    assert load_tokenizer(tmp_path / "d").decode(np.concatenate([train, val]).tolist()) == CORPUS
    assert meta["source_sha256"] == prep.source_checksum(tmp_path / "a.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "d"]  # no temp folders left


def test_prepare_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write(src / "b.txt", "world")
    write(src / "a.txt", "hello")
    write(src / "skip.md", "ignored")
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="byte", val_fraction=0.5)
    train, val = tokens(tmp_path / "d")
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == b"hello\nworld"  # sorted, newline-joined
    assert meta["vocab_size"] == 256 and (len(train), len(val)) == (6, 5)


def test_prepare_jsonl(tmp_path):
    src = write(tmp_path / "a.jsonl", '{"text": "ab"}\n\n{"text": "cd", "id": 2}\n')
    meta = prepare_dataset(src, tmp_path / "d", tokenizer="char", val_fraction=0.2)
    train, val = tokens(tmp_path / "d")
    assert meta["vocab_size"] == 5 and load_tokenizer(tmp_path / "d").decode(list(train) + list(val)) == "ab\ncd"


def test_prepare_bpe_and_existing_tokenizer(tmp_path, bpe_file, monkeypatch):
    src = write(tmp_path / "a.txt", CORPUS)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 1000)  # many chunks: must still equal whole-text encoding
    whole = HFTokenizer.from_file(bpe_file).encode(CORPUS)
    for name, kw in [("bpe", dict(tokenizer="bpe", vocab_size=300)), ("file", dict(tokenizer=str(bpe_file)))]:
        meta = prepare_dataset(src, tmp_path / name, **kw)
        train, val = tokens(tmp_path / name)
        assert meta["vocab_size"] == 300 and len(train) + len(val) == len(whole)
        assert load_tokenizer(tmp_path / name).decode(np.concatenate([train, val]).tolist()) == CORPUS
    assert meta["tokenizer"] == "tokenizer.json" and (tmp_path / "file" / "tokenizer.json").read_bytes() == bpe_file.read_bytes()


def test_choose_dtype():
    assert choose_dtype(65) == choose_dtype(65536) == "uint16"
    assert choose_dtype(65537) == choose_dtype(100_000) == "uint32"
    assert choose_dtype(300, "uint32") == "uint32"
    msg = raises_one_line(choose_dtype, 100_000, "uint16")
    assert msg == "vocab size 100000 does not fit in uint16 (max 65536); use --dtype uint32"


def test_forced_uint32(tmp_path):
    meta = prepare_dataset(write(tmp_path / "a.txt", CORPUS), tmp_path / "d", dtype="uint32")
    assert meta["dtype"] == "uint32" and tokens(tmp_path / "d")[0].dtype == np.uint32


@pytest.mark.parametrize("name, content, kw, match", [
    ("missing.txt", None, {}, "not found"),
    ("empty.txt", "", {}, "empty"),
    ("blank.txt", " \n\t\n", {}, "empty"),
    ("bad.txt", b"abc\xffdef", {}, "bad.txt is not valid UTF-8.*offset 3"),
    ("a.jsonl", '{"text": "ok"}\n{"txt": "no"}\n', {}, "line 2.*text"),
    ("a.jsonl", '{"text": "ok"}\n{"text": 5}\n', {}, "line 2.*text"),
    ("b.jsonl", '{"text": "ok"}\n{oops\n', {}, "line 2: not valid JSON"),
    ("a.txt", CORPUS, dict(tokenizer="wordpiece"), "unknown tokenizer"),
    ("a.txt", CORPUS, dict(tokenizer="bpe"), "needs --vocab-size"),
    ("a.txt", CORPUS, dict(tokenizer="bpe", vocab_size=256), "at least 257"),
    ("a.txt", CORPUS, dict(tokenizer="char", vocab_size=300), "only applies"),
    ("a.txt", CORPUS, dict(val_fraction=0.6), "val fraction"),
    ("a.txt", CORPUS, dict(val_fraction=0), "val fraction"),
    ("a.txt", CORPUS, dict(dtype="int8"), "unknown dtype"),
    ("tiny.txt", "abc", {}, "too small"),
])
def test_bad_inputs(tmp_path, name, content, kw, match):
    src = tmp_path / name if content is None else write(tmp_path / name, content)
    raises_one_line(prepare_dataset, src, tmp_path / "d", match=match, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else [name])  # nothing written


def test_empty_folder(tmp_path):
    (tmp_path / "src").mkdir()
    write(tmp_path / "src" / "notes.md", "text")
    raises_one_line(prepare_dataset, tmp_path / "src", tmp_path / "d", match="no .txt files")


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "d", "e.txt"]
    # a folder holding someone else's files is never replaced
    write(tmp_path / "d" / "notes.txt", "mine")
    raises_one_line(prepare_dataset, src, tmp_path / "d", overwrite=True, match="not part of a dataset")


def test_read_meta_and_ensure_prepared(tmp_path, monkeypatch):
    raises_one_line(read_meta, tmp_path, match="not a prepared dataset")
    src = write(tmp_path / "a.txt", CORPUS)
    meta = ensure_prepared(src, tmp_path / "d")
    calls = []
    monkeypatch.setattr(prep, "prepare_dataset", lambda *a, **k: calls.append(k) or {})
    assert ensure_prepared(src, tmp_path / "d") == meta and not calls  # up to date: reused
    ensure_prepared(src, tmp_path / "d", tokenizer="byte")  # other tokenizer: redone
    write(src, CORPUS + "more")
    ensure_prepared(src, tmp_path / "d")  # changed corpus: redone
    assert len(calls) == 2 and all(k["overwrite"] for k in calls)


def test_main_prepare(tmp_path, capsys):
    src = write(tmp_path / "a.txt", CORPUS)
    assert prep.main_prepare(["--input", str(src), "--out", str(tmp_path / "d"), "--tokenizer", "byte"]) == 0
    assert "byte" in capsys.readouterr().out and read_meta(tmp_path / "d")["train_tokens"] == 18_000
    with pytest.raises(UserError):
        prep.main_prepare(["--input", str(src), "--out", str(tmp_path / "d")])


# ---------------------------------------------------------------------------- loader

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds") / "shakespeare"
    prepare_dataset(DEFAULT_CORPUS, d, tokenizer="char")
    return d


def test_batches_shift_and_types(data_dir):
    data = TokenData(data_dir, "train", 64)
    x, y = data.global_batch(0, 8, seed=1)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    raw = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    o = int(data.offsets(0, 8, 1)[3])
    assert torch.equal(y[3], torch.from_numpy(raw[o + 1:o + 65].astype(np.int64)))


def test_batches_deterministic(data_dir):
    a, b = TokenData(data_dir, "train", 32), TokenData(data_dir, "train", 32)
    x5, _ = a.global_batch(5, 16, seed=7)
    a.global_batch(0, 16, seed=7)  # call order and history must not matter
    assert torch.equal(b.global_batch(5, 16, seed=7)[0], x5)
    assert torch.equal(a.global_batch(5, 16, seed=7)[0], x5)
    assert not torch.equal(a.global_batch(6, 16, seed=7)[0], x5)
    assert not torch.equal(a.global_batch(5, 16, seed=8)[0], x5)
    assert not torch.equal(TokenData(data_dir, "val", 32).offsets(5, 16, 7), a.offsets(5, 16, 7))


@pytest.mark.parametrize("dp_size, accum", [(1, 1), (2, 1), (4, 2), (1, 8), (8, 2)])
def test_dp_sharding_matches_global(data_dir, dp_size, accum):
    data = TokenData(data_dir, "train", 16)
    gx, gy = data.global_batch(3, 16, seed=0)
    parts = [mb for r in range(dp_size) for mb in data.micro_batches(3, 16, 0, r, dp_size, accum)]
    assert len(parts) == dp_size * accum and all(x.shape == (16 // (dp_size * accum), 16) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), gx) and torch.equal(torch.cat([y for _, y in parts]), gy)


def test_loader_errors(data_dir, tmp_path):
    with pytest.raises(ValueError):
        TokenData(data_dir, "train", 16).micro_batches(0, 10, 0, 0, 4, 1)
    raises_one_line(TokenData, data_dir, "val", 200_000, match="val split.*tokens")
    raises_one_line(TokenData, tmp_path, "train", 16, match="not a prepared dataset")


def test_eval_batches_fixed(data_dir):
    data = TokenData(data_dir, "val", 32)
    a, b = data.eval_batches(3, 4), data.eval_batches(3, 4)
    assert len(a) == 3 and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
