"""Tokenizers: byte, char, locally trained byte-level BPE, or an existing tokenizer.json.

All share one tiny interface (encode / decode / vocab_size / kind / save) so the trainer and
the sampler never care which one a dataset was built with. `save(dir)` writes the tokenizer
file(s) plus the `tokenizer` and `vocab_size` keys of dir/meta.json, which is all that
`load_tokenizer(dir)` needs.
"""

import json
import shutil
from pathlib import Path

import tokenizers as hf  # HuggingFace `tokenizers` (absolute import, not this module)

from paratrain.errors import UserError, one_line

KINDS = ("byte", "char", "bpe", "tokenizer.json")


def _update_meta(directory: Path, **fields):
    path = Path(directory) / "meta.json"
    meta = json.loads(path.read_text()) if path.exists() else {}
    meta.update(fields)
    path.write_text(json.dumps(meta, indent=2) + "\n")


class Tokenizer:
    kind: str = ""
    vocab_size: int = 0
    files: tuple = ()  # files save() writes besides meta.json

    def encode(self, text: str) -> list:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts) -> list:
        return [self.encode(t) for t in texts]

    def save(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        _update_meta(directory, tokenizer=self.kind, vocab_size=self.vocab_size)

    def _save_files(self, directory: Path):
        pass


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: no training, no files, any text encodes."""

    kind, vocab_size = "byte", 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        # A model can emit any id (and a padded vocab can exceed 255); drop what is not a byte.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class CharTokenizer(Tokenizer):
    """One id per distinct character of the corpus (nanoGPT's shakespeare_char)."""

    kind, files = "char", ("chars.json",)

    def __init__(self, chars):
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str):
        return cls(sorted(set(text)))

    def encode(self, text):
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            bad = list(dict.fromkeys(c for c in text if c not in self.stoi))  # unique, in order
            shown = ", ".join(repr(c) for c in bad[:10]) + (", ..." if len(bad) > 10 else "")
            raise UserError(f"prompt contains characters not in the char-level vocabulary: {shown}") from None

    def decode(self, ids):
        n = self.vocab_size
        return "".join(self.chars[i] if 0 <= i < n else "\ufffd" for i in map(int, ids))

    def _save_files(self, directory):
        (directory / "chars.json").write_text(json.dumps(self.chars, ensure_ascii=False))


class HFTokenizer(Tokenizer):
    """Wraps a HuggingFace tokenizer: our own byte-level BPE (kind "bpe") or a user's file."""

    files = ("tokenizer.json",)

    def __init__(self, tok: "hf.Tokenizer", kind: str, source_file=None):
        self.tok, self.kind, self.source_file = tok, kind, source_file
        # max id + 1 rather than get_vocab_size(): some files have holes or added tokens past it.
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def train_bpe(cls, texts, vocab_size: int):
        """Byte-level BPE: the 256 byte symbols are the base alphabet, so any text encodes."""
        tok = hf.Tokenizer(hf.models.BPE())
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, "bpe")

    @classmethod
    def from_file(cls, path, kind="tokenizer.json"):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"tokenizer file not found: {path}")
        try:
            tok = hf.Tokenizer.from_file(str(path))
            return cls(tok, kind, source_file=path)
        except Exception as e:  # the Rust side raises plain Exception on bad JSON / unknown model
            raise UserError(f"cannot read tokenizer file {path}: {one_line(e)}") from None

    def encode(self, text):
        # No BOS/EOS: we build one flat token stream, not padded documents.
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def _save_files(self, directory):
        dest = directory / "tokenizer.json"
        if self.source_file is not None and self.source_file.resolve() != dest.resolve():
            shutil.copyfile(self.source_file, dest)  # keep the user's file byte for byte
        elif self.source_file is None:
            self.tok.save(str(dest))


def load_tokenizer(directory) -> Tokenizer:
    """Rebuild the tokenizer a dataset (or anything `save()`d into `directory`) was made with."""
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"no tokenizer in {directory}: meta.json is missing")
    try:
        kind = json.loads(meta_path.read_text())["tokenizer"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta_path} is not a valid dataset meta file ({one_line(e)})") from None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        try:
            chars = json.loads((directory / "chars.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {directory / 'chars.json'}: {one_line(e)}") from None
        return CharTokenizer(chars)
    if kind in ("bpe", "tokenizer.json"):
        tok = HFTokenizer.from_file(directory / "tokenizer.json", kind=kind)
        tok.source_file = None  # loaded copy: save() re-serializes instead of copying onto itself
        return tok
    raise UserError(f"{meta_path}: unknown tokenizer kind {kind!r} (expected one of {', '.join(KINDS)})")
