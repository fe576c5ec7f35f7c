"""Checking checkpoints the way `resume=auto` does, saying what is wrong (`paratrain checkpoint verify PATH [PATH ...]`).

PATH is a step-N folder, a run folder or its checkpoints folder (every step-N folder in it). Each checkpoint is
OK or BAD with its reasons (missing marker or files, truncated shards, checksum mismatches); leftovers of
interrupted saves are listed. Exit code 0 when every checkpoint checked is OK, 1 when one is not, 2 when PATH
holds no checkpoint at all.
"""

from __future__ import annotations

import re
from pathlib import Path

from paratrain.errors import UserError
from paratrain.training import integrity
from paratrain.training.checkpoint import MARKER, checkpoint_problem, step_folders, step_of

_LEFTOVER = re.compile(r"^\.step-\d+\.(tmp|old)$")


def _targets(path: Path) -> tuple[list[Path], list[Path], bool]:
    """(checkpoint folders, leftovers of interrupted saves, whether path is a run or checkpoints folder)."""
    if not path.exists():
        raise UserError(f"{path}: no such folder")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a checkpoint folder")
    if (path / MARKER).exists() or step_of(path) >= 0 or (path / integrity.CHECKSUMS).exists():
        return [path], [], False
    for root in (path / "checkpoints", path):
        if root.is_dir():
            found = step_folders(root)
            leftovers = sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name))
            if found or leftovers:
                return found, leftovers, True
    raise UserError(f"{path} holds no paratrain checkpoint (no step-N folders, no {MARKER} marker)")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def verify(path: Path, out=print) -> bool:
    """Print one line per checkpoint under path; True when all are OK."""
    checkpoints, leftovers, several = _targets(path)
    ok, newest_good = True, None
    for ckpt in checkpoints:
        problem = checkpoint_problem(ckpt)
        if problem:
            ok = False
            out(f"BAD  {ckpt}: {problem}")
            continue
        newest_good = ckpt
        digests = integrity.read_checksums(ckpt)
        how = (f"{len(digests)} files match their {integrity.ALGORITHM} checksums" if isinstance(digests, dict)
               else f"no {integrity.CHECKSUMS} (saved before checksums): only sizes checked")
        out(f"OK   {ckpt}: {how}, {_size(ckpt) / 2**20:.1f} MiB")
    for p in leftovers:
        out(f"note {p}: left by an interrupted save; never loaded, removed when the run starts again")
    if several:
        out(f"resume=auto would use {newest_good}" if newest_good else "resume=auto would find no usable checkpoint")
    return ok

