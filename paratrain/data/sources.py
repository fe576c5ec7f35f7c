"""Reading a corpus one document at a time, whatever it is stored as.

    resolve_inputs("data/fineweb/*.jsonl.gz")  ->  [Source(...), ...]   (checked before anything is read)
    for text, first, last in source.pieces("text"): ...                 (one document = one or more pieces)

Formats: `.txt` (a whole file is one document), `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object
per line, the document in its `text_field`), `.json`, `.json.gz`, `.json.zst` (the same JSON lines, or
one JSON array of such objects: C4's shards are `c4-train.*.json.gz`), `.parquet` (a string column),
and a folder written by Hugging Face `datasets`' `save_to_disk`. An input is a file, a folder (searched
recursively for those formats, in sorted order, prepared paratrain datasets inside it left out) or a glob
pattern. `.zst`, `.parquet` and saved datasets need the optional packages zstandard, pyarrow and datasets.

A document longer than PIECE_CHARS comes in pieces cut at a lone newline between two non-space
characters, where our byte-level BPE pre-tokenizer always cuts anyway, so encoding the pieces gives
the same tokens as encoding the whole document (exactly for byte/char/bpe; a foreign tokenizer.json
may differ by a token at a cut). Memory is bounded by the piece size, not the document or file size.

Every bad input is a one-line UserError naming the file and the line, row or byte offset.
"""

from __future__ import annotations

import glob
import codecs
import hashlib
import io
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import UserError, one_line

PIECE_CHARS = 1 << 20  # characters per piece of a long document
MAX_PIECE_CHARS = 16 * PIECE_CHARS  # a piece without any cut point is cut here anyway (at a space if possible)
READ_BYTES = 1 << 20
_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # a lone newline between two non-space characters
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
SUFFIXES = {".jsonl.gz": "jsonl.gz", ".jsonl.zst": "jsonl.zst", ".jsonl": "jsonl", ".json.gz": "json.gz",
            ".json.zst": "json.zst", ".json": "json", ".parquet": "parquet", ".txt": "txt"}
JSON_FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "json", "json.gz", "json.zst")  # read by Source.records
COMPRESSION = {".gz": "gzip", ".zst": "zstd"}  # a JSON format's ending -> Decompressed's kind
JSON_SHAPES = "a .json file holds one JSON object per line, or one array of objects"
FORMAT_LIST = ".txt, .jsonl, .json (each also .gz or .zst) or .parquet"
OPTIONAL = {"jsonl.zst": ("zstandard", "zstandard"), "json.zst": ("zstandard", "zstandard"),
            "parquet": ("pyarrow", "pyarrow"), "hf": ("datasets", "datasets")}


def file_format(path: Path):
    name = path.name.lower()
    return next((fmt for suffix, fmt in SUFFIXES.items() if name.endswith(suffix)), None)


def is_saved_dataset(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                      and (path / "dataset_info.json").is_file())


@dataclass
class Source:
    """One input file (or saved dataset folder); after a complete read: its size, checksum, documents."""

    path: Path
    fmt: str
    bytes: int = 0
    sha256: str = ""
    documents: int = 0
    files: list = field(default_factory=list)  # a saved dataset: the files it is made of

    def record_path(self) -> str:
        return str(self.path.resolve())

    def record(self) -> dict:
        return {"path": self.record_path(), "format": self.fmt, "bytes": self.bytes, "sha256": self.sha256,
                "documents": self.documents}

    def stat_files(self) -> list:
        return self.files or [self.path]

    def fingerprint(self) -> list:
        """Cheap change detection: (path, size, mtime) of every file."""
        out = []
        for f in self.stat_files():
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return out

    def checksum(self) -> str:
        """sha256 of the raw bytes (of every file, with its name, for a saved dataset)."""
        h = hashlib.sha256()
        for f in self.stat_files():
            if self.files:
                h.update(str(f.relative_to(self.path)).encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(READ_BYTES), b""):
                    h.update(block)
        return h.hexdigest()

    def pieces(self, text_field: str = "text"):
        """Yield (text, first, last) for every document: `first`/`last` mark its first and last piece.
        Empty documents are skipped. A complete read fills in bytes, sha256 and documents."""
        reader = {"txt": self._txt, "parquet": self._parquet, "hf": self._saved,
                  **{fmt: self._jsonl for fmt in JSON_FORMATS}}[self.fmt]
        self.documents = 0
        for doc in reader(text_field):
            pending = None
            for piece in doc:
                if not piece:
                    continue
                if pending is not None:
                    yield pending, first, False
                    first = False
                else:
                    first = True
                pending = piece
            if pending is not None:
                self.documents += 1
                yield pending, first, True

    # -- the formats -------------------------------------------------------------------------------
    def _open_hashed(self):
        raw = _HashingReader(open(self.path, "rb", buffering=0))
        return raw, io.BufferedReader(raw, READ_BYTES)

    def _finish_hash(self, raw):
        self.bytes, self.sha256 = raw.count, raw.hash.hexdigest()

    def _txt(self, text_field):
        raw, stream = self._open_hashed()
        with stream:
            yield _txt_text(self.path, stream)
            self._finish_hash(raw)

    def _jsonl(self, text_field):
        for lineno, obj in self.records():
            text = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                chat = " (a chat dataset? prepare it with --chat)" if isinstance(obj, dict) and (
                    "messages" in obj or "prompt" in obj) else ""
                raise UserError(f'{self.path} line {lineno}: expected a JSON object with a string "{text_field}" '
                                f"field (choose another with --text-field){chat}")
            yield _split_long(text)

    def records(self):
        """(line number, JSON value) of every non-blank line of a .jsonl[.gz|.zst] file, or of a .json[.gz|.zst]
        file's JSON lines or of the objects of its one JSON array (the line each starts on); a complete read fills
        in bytes and sha256."""
        if self.fmt not in JSON_FORMATS:
            raise UserError(f"{self.path}: chat data is read from .jsonl or .json files (also .gz or .zst), "
                            f"not {self.fmt}")
        raw, stream = self._open_hashed()
        with stream:
            kind = COMPRESSION.get(Path(self.fmt).suffix, "")
            data = io.BufferedReader(Decompressed(stream, kind, self.path), READ_BYTES) if kind else stream
            if not self.fmt.startswith("jsonl"):  # .json: JSON lines, or one array (told by its first character)
                start = _read(lambda: _first_character(data), 0)
                if start == b"[":
                    yield from json_array_items(data, self.path, _read)
                    self._finish_hash(raw)
                    return
                if start not in (b"{", b""):
                    raise UserError(f"{self.path}: neither JSON lines nor a JSON array (it starts with {start.decode(errors='replace')!r}); "
                                    + JSON_SHAPES)
            yield from self._lines(data, kind)
            self._finish_hash(raw)

    def _lines(self, lines, kind):
        lineno, offset = 0, 0
        hint = "" if self.fmt.startswith("jsonl") else "; " + JSON_SHAPES
        while True:
            line = _read(lines.readline, lineno)
            if not line:
                break
            lineno += 1
            start, offset = offset, offset + len(line)
            if line.isspace():
                continue  # blank lines (a trailing newline, say) are harmless
            try:
                obj = json.loads(line)
            except UnicodeDecodeError as e:
                raise UserError(f"{self.path} line {lineno}: not valid UTF-8: bad byte 0x{line[e.start]:02x} at "
                                f"byte offset {start + e.start}{' of the decompressed data' if kind else ''}") from None
            except ValueError as e:
                raise UserError(f"{self.path} line {lineno}: not valid JSON "
                                f"({one_line(getattr(e, 'msg', e))}){hint}") from None
            yield lineno, obj

    def _parquet(self, text_field):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for anything that is not parquet
            raise UserError(f"{self.path}: not a readable parquet file ({one_line(e)})") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            raise UserError(f"{self.path}: no column {text_field!r} (columns: {', '.join(names) or 'none'}); "
                            "choose one with --text-field")
        rows = [0]
        try:
            batches = (b.column(0).to_pylist() for b in pf.iter_batches(batch_size=1024, columns=[text_field]))
            yield from self._column(batches, text_field, rows)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{self.path}: cannot read parquet data after row {rows[0]} ({one_line(e)})") from None
        self.bytes, self.sha256 = self.path.stat().st_size, self.checksum()

    def _saved(self, text_field):
        import datasets

        try:
            ds = datasets.load_from_disk(str(self.path))
        except Exception as e:
            raise UserError(f"{self.path}: cannot load the saved dataset ({one_line(e)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserError(f"{self.path}: a dataset dict without a 'train' split (splits: {', '.join(ds)}); "
                                "save the split you want with save_to_disk")
            ds = ds["train"]
        if text_field not in ds.column_names:
            raise UserError(f"{self.path}: no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
                            "choose one with --text-field")
        batches = (b[text_field] for b in ds.select_columns([text_field]).iter(batch_size=1024))
        yield from self._column(batches, text_field, [0])
        self.bytes, self.sha256 = sum(f.stat().st_size for f in self.files), self.checksum()


    def _column(self, batches, text_field, rows):
        """Documents from batches of column values; rows[0] counts the rows read (for error messages)."""
        for values in batches:
            for value in values:
                rows[0] += 1
                if not isinstance(value, str):
                    raise UserError(f"{self.path} row {rows[0]}: column {text_field!r} holds "
                                    f"{'null' if value is None else type(value).__name__}, not a string")
                yield _split_long(value)


def _read(read, line: int):
    """`read()` of a file's (decompressed) data; a corrupt or cut-short compressed file is one line."""
    try:
        return read()
    except CompressedDataError as e:
        raise UserError(f"{e} (after line {line})") from None


def _first_character(data) -> bytes:
    """The first byte of `data` that is not white space (b"" for none), left unread: `data.peek` shows it."""
    while True:
        head = data.peek(READ_BYTES)
        if not head:
            return b""
        stripped = head.lstrip()
        if stripped:
            data.read(len(head) - len(stripped))
            return stripped[:1]
        data.read(len(head))


def json_array_items(data, path: Path, read):
    """(line, value) of every item of the one JSON array in `data` (its first character is "["), read a block at a
    time: memory is bounded by the largest item, not the file. `read(fn, line)` calls fn, reporting a corrupt
    compressed stream as one line."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    text, pos, line, done = "", 0, 1, False  # the text not yet parsed starts at text[pos], on `line`

    def more() -> None:
        nonlocal text, pos, done
        block = read(lambda: data.read(READ_BYTES), line)
        try:
            decoded = utf8.decode(block, final=not block)
        except UnicodeDecodeError:
            raise UserError(f"{path} line {line}: not valid UTF-8") from None
        text, pos, done = text[pos:] + decoded, 0, not block

    def next_character() -> str:
        """The next character that is not white space (left unread), "" at the end of the file."""
        nonlocal pos, line
        while True:
            end = _JSON_SPACE.match(text, pos).end()
            line += text.count("\n", pos, end)
            pos = end
            if pos < len(text) or done:
                return text[pos:pos + 1]
            more()

    def bad(what: str) -> UserError:
        found = repr(text[pos:pos + 20]) if pos < len(text) else "the end of the file"
        return UserError(f"{path} line {line}: not a valid JSON array ({what}, found {found}); " + JSON_SHAPES)

    if next_character() != "[":  # (the caller saw it)
        raise bad("expected [")
    pos += 1
    state = "first"  # what may come next: "first" (an item or "]"), "item", "sep" ("," or "]"), "end" (nothing)
    while True:
        char = next_character()
        if state == "end":
            if char:
                raise bad("nothing may follow the array's closing ]")
            return
        if char == "]" and state in ("first", "sep"):
            pos, state = pos + 1, "end"
            continue
        if state == "sep":
            if char != ",":
                raise bad("expected , or ]" if char else "the array is not closed")
            pos, state = pos + 1, "item"
            continue
        if not char:
            raise bad("the array is not closed")
        blocks = 1  # an item cut off reads on 1, 2, 4, ... blocks before the next try: linear in a long item, not
        while True:  # quadratic. An item: parse it, reading on while it is cut off at the end of the text so far
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                if done or not _cut_off(e, text):
                    raise bad(one_line(e.msg)) from None
                for _ in range(blocks):
                    if not done:
                        more()
                blocks *= 2
                continue
            if end < len(text) or done:  # (a number at the end of the text may go on in the next block)
                break
            more()
        yield line, value
        line += text.count("\n", pos, end)
        pos, state = end, "sep"


def _cut_off(error: json.JSONDecodeError, text: str) -> bool:
    """Whether more of the file could mend this parse error: a string still open (its start is reported, however
    long it is), or an error within the last few characters read (a literal, number or escape cut by the block's
    end). Anything else is broken whatever follows: said now, not after reading to the end of the file."""
    return error.msg.startswith("Unterminated string") or error.pos >= len(text) - 8


class CompressedDataError(Exception):
    """A compressed stream that is corrupt or cut short: the file and the compressed byte offset."""


class Decompressed(io.RawIOBase):
    """The decompressed bytes of a gzip or zstd file, every member (frame) in turn; the file must end where a member
    ends, so a transfer cut short is an error, not a shorter corpus. Errors name the file and the compressed byte
    offset (of the block being decompressed: 64 KiB at most before the fault)."""

    BLOCK = 1 << 16

    def __init__(self, raw, kind: str, path: Path):
        self.raw, self.kind, self.path = raw, kind, path
        self.offset = 0  # compressed bytes consumed by finished blocks
        self.input, self.output = b"", b""
        self.decoder = None  # the member being decompressed
        self.done = False

    def readable(self):
        return True

    def _decoder(self):
        if self.kind == "gzip":
            return zlib.decompressobj(wbits=31)  # gzip header, deflate data, CRC-32 and length checked
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def _errors(self):
        if self.kind == "gzip":
            return (zlib.error,)
        import zstandard

        return (zstandard.ZstdError,)

    def _step(self) -> None:
        if not self.input:
            self.input = self.raw.read(self.BLOCK)
            if not self.input:
                if self.decoder is not None:
                    raise CompressedDataError(f"{self.path}: truncated {self.kind} stream: the file ends at byte "
                                              f"offset {self.offset} inside a {self._unit()} (cut short in a "
                                              "transfer?)")
                self.done = True
                return
        if self.decoder is None:
            if self.kind == "gzip":  # gzip allows zero bytes of padding after its last member
                stripped = self.input.lstrip(b"\0")
                self.offset += len(self.input) - len(stripped)
                self.input = stripped
                if not stripped:
                    return
            self.decoder = self._decoder()
        data, self.input = self.input, b""
        try:
            self.output = self.decoder.decompress(data)
        except self._errors() as e:
            raise CompressedDataError(f"{self.path}: corrupt {self.kind} data at compressed byte offset "
                                      f"{self.offset}..{self.offset + len(data)} ({one_line(e)})") from None
        if self.decoder.eof:
            self.input = self.decoder.unused_data
            self.decoder = None
        self.offset += len(data) - len(self.input)

    def _unit(self) -> str:
        return "member" if self.kind == "gzip" else "frame"

    def readinto(self, b):
        while not self.output and not self.done:
            self._step()
        n = min(len(b), len(self.output))
        b[:n] = self.output[:n]
        self.output = self.output[n:]
        return n


class _HashingReader(io.RawIOBase):
    """A raw file that hashes and counts the bytes read through it (checksums in the same pass)."""

    def __init__(self, f):
        self.f, self.hash, self.count = f, hashlib.sha256(), 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        if n:
            self.hash.update(memoryview(b)[:n])
            self.count += n
        return n

    def close(self):
        self.f.close()
        super().close()


def _complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n
        if b >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n  # only continuation bytes: let the strict decode report it


def _txt_text(path: Path, stream):
    """The text of a .txt file in pieces, read in blocks; bad UTF-8 names the byte offset."""
    buf, pending, offset = "", b"", 0
    while True:
        block = stream.read(READ_BYTES)
        data = pending + block
        cut = _complete_utf8(data) if block else len(data)
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not valid UTF-8 text: bad byte 0x{data[e.start]:02x} at byte offset "
                            f"{offset + e.start}") from None
        offset, pending = offset + cut, data[cut:]
        buf += text
        while len(buf) >= 2 * PIECE_CHARS:
            end = _cut_point(buf)
            yield buf[:end]
            buf = buf[end:]
        if not block:
            break
    yield buf


def _cut_point(text: str) -> int:
    m = _CUT.search(text, PIECE_CHARS)
    if m and m.start() <= MAX_PIECE_CHARS:
        return m.start()
    if len(text) <= MAX_PIECE_CHARS:
        return len(text)
    space = text.rfind(" ", PIECE_CHARS, MAX_PIECE_CHARS)  # no clean cut: bounded memory over exactness
    return space if space > 0 else MAX_PIECE_CHARS


def _split_long(text: str):
    """A document as pieces (usually one)."""
    start = 0
    while len(text) - start > 2 * PIECE_CHARS:
        end = start + _cut_point(text[start:start + MAX_PIECE_CHARS + 2])
        yield text[start:end]
        start = end
    yield text[start:]


# ---------------------------------------------------------------------------- finding the inputs

def _check_optional(fmt: str, where: Path):
    if fmt in OPTIONAL:
        module, package = OPTIONAL[fmt]
        try:
            __import__(module)
        except ImportError:
            raise UserError(f"reading {where} needs the {package} package: pip install {package}") from None


def _folder_sources(folder: Path) -> list:
    if is_saved_dataset(folder):
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return [Source(folder, "hf", files=files)]
    found = []
    for root, dirs, names in os.walk(folder):
        # hidden folders, and prepared datasets (their index and tokenizer are .json files, not a corpus)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not _is_prepared(Path(root) / d))
        for name in names:
            p = Path(root) / name
            fmt = file_format(p)
            if fmt and not name.startswith("."):
                found.append(Source(p, fmt))
    if not found:
        raise UserError(f"input folder {folder} has no {FORMAT_LIST} files")
    return sorted(found, key=lambda s: str(s.path.relative_to(folder)))


def _is_prepared(folder: Path) -> bool:
    """A dataset `paratrain prepare` wrote: its meta.json beside its token shards."""
    return (folder / "meta.json").is_file() and any(folder.glob("*.bin"))


def resolve_inputs(inputs, what: str = "input") -> list:
    """Files to read, in a fixed order; every problem is reported now, before anything is read."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    sources, seen = [], set()
    for item in inputs:
        text = str(item)
        if any(ch in text for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            if not matches:
                raise UserError(f"{what} pattern {text} matches no files")
            found = []
            for m in matches:
                found += _folder_sources(m) if m.is_dir() else [Source(m, file_format(m) or "txt")]
        else:
            path = Path(text)
            if not path.exists():
                raise UserError(f"{what} not found: {path}")
            found = _folder_sources(path) if path.is_dir() else [Source(path, file_format(path) or "txt")]
        for s in found:
            key = s.path.resolve()
            if key not in seen:
                seen.add(key)
                _check_optional(s.fmt, s.path)
                sources.append(s)
    if not sources:
        raise UserError(f"no {what} given")
    return sources
