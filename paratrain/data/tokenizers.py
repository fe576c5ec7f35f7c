"""Tokenizers: byte, char, locally trained byte-level BPE, or an existing tokenizer.json.

All share one tiny interface (encode / decode / vocab_size / kind / eos_id / bos_id / save) so the
trainer and the sampler never care which one a dataset was built with. `save(dir)` writes the
tokenizer file(s) plus the `tokenizer`, `vocab_size`, `eos_id` and `bos_id` keys of dir/meta.json,
which is all that `load_tokenizer(dir)` needs.

Document ends: every tokenizer has an `eos_id` (None only for a tokenizer.json that defines no
end-of-text token) and a `bos_id` (None unless the tokenizer defines one). The byte and char
tokenizers gain one extra id after their symbols for EOS; our BPE reserves `<|endoftext|>` (id 0).
`prepare` writes BOS before and EOS after every document.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import tokenizers as hf  # HuggingFace `tokenizers` (absolute import, not this module)

from paratrain.errors import UserError, one_line

KINDS = ("byte", "char", "bpe", "tokenizer.json")
BPE_EOS = "<|endoftext|>"
# Special-token names tried, in order, for a tokenizer.json without a tokenizer_config.json beside it.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


def _read_meta_file(directory: Path) -> dict:
    path = Path(directory) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _update_meta(directory: Path, **fields):
    meta = _read_meta_file(directory)
    meta.update(fields)
    (Path(directory) / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


class Tokenizer:
    kind: str = ""
    vocab_size: int = 0
    eos_id = None  # id appended after every document by `prepare`; None: the tokenizer has none
    bos_id = None  # id put before every document; None: the tokenizer has none
    files: tuple = ()  # files save() writes besides meta.json

    def encode(self, text: str) -> list:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts) -> list:
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts) -> list:
        """One numpy array of ids per text (what `prepare` writes); subclasses make it fast."""
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]

    def save(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        _update_meta(directory, tokenizer=self.kind, vocab_size=self.vocab_size, eos_id=self.eos_id, bos_id=self.bos_id)

    def _save_files(self, directory: Path):
        pass

    def spec(self):
        """A small picklable description a worker process rebuilds the tokenizer from (`from_spec`)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes (ids 0-255) plus EOS = 256: no training, no files, any text encodes."""

    kind = "byte"

    def __init__(self, eos: bool = True):
        self.eos_id = 256 if eos else None
        self.vocab_size = 257 if eos else 256  # a dataset made before EOS existed has 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def encode_arrays(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids):
        # A model can emit any id (and a padded vocab can exceed 255); drop what is not a byte.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def spec(self):
        return ("byte", self.eos_id is not None)


class CharTokenizer(Tokenizer):
    """One id per distinct character of the corpus (nanoGPT's shakespeare_char), then EOS."""

    kind, files = "char", ("chars.json",)

    def __init__(self, chars, eos: bool = True):
        self.chars = list(chars)
        self.eos_id = len(self.chars) if eos else None
        self.vocab_size = len(self.chars) + (1 if eos else 0)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # Vectorised encoding: code points sorted, with the id of each.
        cps = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        order = np.argsort(cps, kind="stable")
        self._cps, self._ids = cps[order], order.astype(np.int64)

    @classmethod
    def from_text(cls, text: str):
        return cls(sorted(set(text)))

    def _unknown(self, text, what="text"):
        bad = list(dict.fromkeys(c for c in text if c not in self.stoi))  # unique, in order
        shown = ", ".join(repr(c) for c in bad[:10]) + (", ..." if len(bad) > 10 else "")
        return UserError(f"{what} contains characters not in the char-level vocabulary: {shown}")

    def encode(self, text):
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            raise self._unknown(text, "prompt") from None  # encode() serves prompts; prepare uses encode_arrays

    def encode_arrays(self, texts):
        out = []
        for text in texts:
            cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
            if not len(self._cps):
                if len(cps):
                    raise self._unknown(text)
                out.append(np.zeros(0, np.int64))
                continue
            pos = np.minimum(np.searchsorted(self._cps, cps), len(self._cps) - 1)
            if not np.array_equal(self._cps[pos], cps):
                raise self._unknown(text)
            out.append(self._ids[pos])
        return out

    def decode(self, ids):
        n = len(self.chars)
        return "".join(self.chars[i] if 0 <= i < n else ("" if i == self.eos_id else "\ufffd") for i in map(int, ids))

    def _save_files(self, directory):
        (directory / "chars.json").write_text(json.dumps(self.chars, ensure_ascii=False))

    def spec(self):
        return ("char", self.chars, self.eos_id is not None)


def token_name(value):
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_ids(tok: "hf.Tokenizer", path=None):
    """(eos_id, bos_id) of a HuggingFace tokenizer: from tokenizer_config.json beside the file when there
    is one (how HF models name their special tokens), else from well-known special-token names."""
    vocab = tok.get_vocab(with_added_tokens=True)
    config = Path(path).parent / "tokenizer_config.json" if path is not None else None
    if config is not None and config.is_file():
        try:
            c = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {config}: {one_line(e)}") from None
        if not isinstance(c, dict):
            raise UserError(f"{config} is not a JSON object")
        ids = []
        for key in ("eos_token", "bos_token"):
            value = c.get(key)
            name = token_name(value)
            if value is not None and name is None:
                raise UserError(f"{config}: {key} must be a token (a string or {{\"content\": ...}}), got {value!r}")
            if name is not None and name not in vocab:
                raise UserError(f"{config}: {key} {name!r} is not a token of {Path(path).name}")
            ids.append(vocab[name] if name else None)
        return ids[0], ids[1]
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    eos = next((vocab[n] for n in EOS_NAMES if n in special), None)
    bos = next((vocab[n] for n in BOS_NAMES if n in special), None)
    return eos, bos


def _check_added_tokens(tok: "hf.Tokenizer", path: Path) -> None:
    """Each added token has the id the file gives it (the tokenizers library silently renumbers an added token whose
    id is not the next free one: a model trained with the original ids would read other tokens)."""
    try:
        added = json.loads(Path(path).read_text(encoding="utf-8")).get("added_tokens") or []
    except (OSError, ValueError, AttributeError):
        return  # the library read it: its own format
    for entry in added if isinstance(added, list) else []:
        if not isinstance(entry, dict):
            continue
        token, wanted = entry.get("content"), entry.get("id")
        actual = tok.token_to_id(token) if isinstance(token, str) else None
        if actual is not None and actual != wanted:
            raise UserError(f"{path}: added_tokens gives {token!r} the id {wanted!r}, but the tokenizer numbers it "
                            f"{actual} (an id must follow the vocabulary without gaps)")


class HFTokenizer(Tokenizer):
    """Wraps a HuggingFace tokenizer: our own byte-level BPE (kind "bpe") or a user's file."""

    files = ("tokenizer.json",)

    def __init__(self, tok: "hf.Tokenizer", kind: str, source_file=None, eos_id=None, bos_id=None):
        self.tok, self.kind, self.source_file = tok, kind, source_file
        self.eos_id, self.bos_id = eos_id, bos_id
        # max id + 1 rather than get_vocab_size(): some files have holes or added tokens past it.
        ids = tok.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise UserError(f"tokenizer {source_file or ''} has an empty vocabulary")
        self.vocab_size = max(ids) + 1
        if self.vocab_size > MAX_VOCAB:
            raise UserError(f"tokenizer {source_file or ''} has an id {self.vocab_size - 1}, beyond uint32")
        self._fast = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets: faster

    @classmethod
    def train_bpe(cls, texts, vocab_size: int):
        """Byte-level BPE: the 256 byte symbols are the base alphabet, so any text encodes; id 0 is EOS."""
        tok = hf.Tokenizer(hf.models.BPE())
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[BPE_EOS],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, "bpe", eos_id=tok.token_to_id(BPE_EOS))

    @classmethod
    def from_file(cls, path, kind="tokenizer.json"):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"tokenizer file not found: {path}")
        try:
            tok = hf.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON / unknown model
            raise UserError(f"cannot read tokenizer file {path}: {one_line(e)}") from None
        _check_added_tokens(tok, path)
        return cls(tok, kind, path, *_special_ids(tok, path))

    def encode(self, text):
        # No BOS/EOS here: `prepare` adds them around whole documents.
        return self._encodings([text])[0].ids

    def encode_batch(self, texts):
        return [e.ids for e in self._encodings(list(texts))]

    def _encodings(self, texts: list):
        try:
            return self._fast(texts, add_special_tokens=False)
        except Exception as e:  # the Rust side raises plain Exception, e.g. a WordLevel model without an unk token
            raise UserError(f"the tokenizer ({self.kind}) cannot encode this text: {one_line(e)}; a tokenizer must "
                            "encode any text (a WordLevel or WordPiece model needs an unknown token)") from None

    def encode_arrays(self, texts):
        # Document text that happens to contain "<|endoftext|>" is text, not a document end.
        old = getattr(self.tok, "encode_special_tokens", None)
        if old is not None:
            self.tok.encode_special_tokens = True
        try:
            return [np.array(e.ids, dtype=np.int64) for e in self._encodings(list(texts))]
        finally:
            if old is not None:
                self.tok.encode_special_tokens = old

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def _save_files(self, directory):
        dest = directory / "tokenizer.json"
        if self.source_file is not None and self.source_file.resolve() != dest.resolve():
            shutil.copyfile(self.source_file, dest)  # keep the user's file byte for byte
            config = self.source_file.parent / "tokenizer_config.json"
            if config.is_file():
                shutil.copyfile(config, directory / "tokenizer_config.json")
        elif self.source_file is None:
            self.tok.save(str(dest))

    def spec(self):
        return ("hf", self.tok.to_str(), self.kind, self.eos_id, self.bos_id)


def from_spec(spec) -> Tokenizer:
    if spec[0] == "byte":
        return ByteTokenizer(spec[1])
    if spec[0] == "char":
        return CharTokenizer(spec[1], spec[2])
    _, text, kind, eos, bos = spec
    return HFTokenizer(hf.Tokenizer.from_str(text), kind, eos_id=eos, bos_id=bos)


def meta_problem(meta) -> str | None:
    """What is wrong with the tokenizer fields of a meta.json (naming the field), or None."""
    if not isinstance(meta, dict):
        return f"is a JSON {type(meta).__name__}, not an object"
    kind = meta.get("tokenizer")
    if kind not in KINDS:
        return f"tokenizer: unknown kind {kind!r} (expected one of {', '.join(KINDS)})"
    vocab = meta.get("vocab_size")
    if not _is_count(vocab) or not 1 <= vocab <= MAX_VOCAB:
        return f"vocab_size must be an integer from 1 to {MAX_VOCAB}, got {vocab!r}"
    for key in ("eos_id", "bos_id"):
        value = meta.get(key)
        if value is not None and (not _is_count(value) or not 0 <= value < vocab):
            return f"{key} {value!r} is not an id of the vocabulary (vocab_size {vocab})"
    return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_VOCAB = (1 << 32) - 1  # ids are stored as uint32 at most


def load_tokenizer(directory) -> Tokenizer:
    """Rebuild the tokenizer a dataset (or anything `save()`d into `directory`) was made with; every field of its
    meta.json and chars.json is checked, and the rebuilt tokenizer must agree with the vocab_size recorded."""
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"no tokenizer in {directory}: meta.json is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path} is not a valid dataset meta file ({one_line(e)})") from None
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{meta_path}: {problem}")
    kind = meta["tokenizer"]
    if kind == "byte":
        if meta["vocab_size"] not in (256, 257):
            raise UserError(f"{meta_path}: vocab_size {meta['vocab_size']} is not the byte tokenizer's (256 or 257)")
        return ByteTokenizer(eos=meta["vocab_size"] > 256)
    if kind == "char":
        chars_path = directory / "chars.json"
        try:
            chars = json.loads(chars_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {chars_path}: {one_line(e)}") from None
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars) \
                or len(set(chars)) != len(chars):
            raise UserError(f"{chars_path} must be a list of distinct single characters")
        tok = CharTokenizer(chars, eos=meta.get("eos_id") is not None)  # older datasets had no EOS
    else:
        tok = HFTokenizer.from_file(directory / "tokenizer.json", kind=kind)
        tok.source_file = None  # loaded copy: save() re-serializes instead of copying onto itself
        if "eos_id" in meta:  # what prepare recorded wins over detection
            tok.eos_id, tok.bos_id = meta["eos_id"], meta.get("bos_id")
    if tok.vocab_size != meta["vocab_size"] or (kind == "char" and meta.get("eos_id") not in (None, tok.eos_id)):
        raise UserError(f"{meta_path}: vocab_size {meta['vocab_size']} (eos_id {meta.get('eos_id')}) does not match "
                        f"the tokenizer's files ({tok.vocab_size} ids)")
    return tok


def tokenizer_identity(tok) -> str:
    """sha256 of what decides the ids: every (token, id) of the vocabulary and the special tokens. Two tokenizers
    with the same identity encode every text to the same ids."""
    import hashlib

    if tok.kind == "byte":
        vocab = [["byte", 256]]
    elif tok.kind == "char":
        vocab = [[c, i] for i, c in enumerate(tok.chars)]
    else:
        vocab = sorted([t, i] for t, i in tok.tok.get_vocab(with_added_tokens=True).items())
        vocab.append(["model", json.loads(tok.tok.to_str()).get("model", {}).get("type")])
    data = json.dumps([tok.kind if tok.kind in ("byte", "char") else "hf", vocab, tok.vocab_size, tok.eos_id,
                       tok.bos_id], ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()
