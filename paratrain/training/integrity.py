"""Checkpoint integrity: a SHA-256 per file, written at save and verified before a checkpoint is trusted.

A committed checkpoint folder holds `CHECKSUMS` beside its `COMPLETE` marker: one line per file (every DCP shard,
the DCP `.metadata`, `trainer.pt`, the tokenizer files) in the format of `sha256sum`, so an operator can also check
a folder with `cd step-N && sha256sum -c CHECKSUMS`. The ranks hash the files at save (each rank a share of them,
read back from the page cache right after the write) and rank 0 writes the list before the marker; `resume=auto`,
`paratrain generate`, `paratrain export` and `paratrain checkpoint verify` recompute them.

Torch-free: hashing is plain file reading (hashlib releases the GIL, so several files are hashed in threads).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUMS = "CHECKSUMS"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
MAX_CHECKSUMS_BYTES = 16 << 20
# Files of a checkpoint folder that are not covered by CHECKSUMS: the marker written after it, and itself.
UNLISTED = ("COMPLETE", CHECKSUMS)


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def listed_files(folder: Path) -> list[str]:
    """The files CHECKSUMS covers: every regular file of the folder but the marker and the list itself."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in UNLISTED)


def share(names: list[str], index: int, count: int) -> list[str]:
    """This rank's part of the hashing: every count-th file of the sorted list (the same split on every rank)."""
    return names[index::count]


def hash_files(folder: Path, names: list[str], threads: int | None = None) -> dict[str, str]:
    """{name: sha256} of files in folder, several at once (hashlib releases the GIL while hashing)."""
    if not names:
        return {}
    threads = threads or min(len(names), 4, os.cpu_count() or 1)
    if threads <= 1:
        return {n: hash_file(folder / n) for n in names}
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(lambda n: hash_file(folder / n), names)))


def write_checksums(folder: Path, digests: dict[str, str]) -> None:
    text = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    path = folder / CHECKSUMS
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_checksums(folder: Path) -> dict[str, str] | str | None:
    """{name: sha256} from CHECKSUMS; a string saying why it cannot be read; None if there is none (a checkpoint
    saved before paratrain wrote checksums)."""
    path = folder / CHECKSUMS
    try:
        size = path.stat().st_size
        if size > MAX_CHECKSUMS_BYTES:  # one line per file: a few KiB for any real checkpoint
            return f"{CHECKSUMS} is {size} bytes, larger than any checkpoint's list ({MAX_CHECKSUMS_BYTES} bytes)"
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable {CHECKSUMS} ({type(e).__name__})"
    digests = {}
    for number, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name \
                or "/" in name or name in UNLISTED or name in (".", ".."):
            return f"{CHECKSUMS} line {number} is damaged"
        if name in digests:
            return f"{CHECKSUMS} lists {name} twice (line {number})"
        digests[name] = digest
    if not digests:
        return f"{CHECKSUMS} is empty"
    return digests


def verify_files(folder: Path, digests: dict[str, str], names: list[str]) -> list[str]:
    """What is wrong with `names` (a subset of `digests`) in folder: missing files, unreadable files, mismatches."""
    problems, present = [], []
    for name in names:
        if not (folder / name).is_file():
            problems.append(f"missing file {name}")
        else:
            present.append(name)
    try:
        actual = hash_files(folder, present)
    except OSError as e:
        return problems + [f"cannot read {Path(e.filename or '').name or 'a file'} ({e.strerror or e})"]
    for name in present:
        if actual[name] != digests[name]:
            problems.append(f"checksum mismatch in {name} ({ALGORITHM} {actual[name][:12]}..., "
                            f"{CHECKSUMS} says {digests[name][:12]}...)")
    return problems
