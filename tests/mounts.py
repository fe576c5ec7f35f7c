"""Folders with hostile file systems for the reliability tests: read-only, and nearly full.

A small tmpfs is mounted where the test process may (root with CAP_SYS_ADMIN, as in CI containers run as root);
elsewhere a read-only folder is a chmod 555 folder (effective for a non-root user) and a full disk is a file-size
limit (RLIMIT_FSIZE: writes past it fail with EFBIG, which paratrain reports like ENOSPC).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
from pathlib import Path


def _mount(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10)


@contextlib.contextmanager
def read_only_folder(folder: Path):
    """`folder`, empty and read-only for this process."""
    if _mount(folder, "ro,size=64k"):
        try:
            yield folder
        finally:
            _unmount(folder)
        return
    if os.geteuid() == 0:
        raise RuntimeError("cannot make a read-only folder: root without mount rights ignores chmod")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)


@contextlib.contextmanager
def small_disk(folder: Path, size_bytes: int):
    """(folder, preexec_fn): a folder on a tmpfs of `size_bytes`, or, where nothing can be mounted, an ordinary
    folder and a preexec_fn that limits the size of any file the child writes to `size_bytes`."""
    if _mount(folder, f"size={size_bytes}"):
        try:
            yield folder, None
        finally:
            _unmount(folder)
        return
    folder.mkdir(parents=True, exist_ok=True)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_bytes, size_bytes))

    yield folder, limit
