"""Writing a folder as a whole: the one place that replaces a folder (datasets, checkpoints, exports).

    with atomic_dir(tmp, final) as folder:   # fill `folder` (the hidden build folder tmp)
        ...
    # on success `final` is the new folder; on any failure tmp is gone and `final` is as it was

A reader never sees a half-written folder: the new one is renamed into place, an old one is moved aside first and
deleted only once the new one is there, and put back if the rename fails.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the folder tmp to final; an existing final is moved aside first, deleted once the new one is in place,
    and restored if the rename fails."""
    import shutil, tempfile  # lazy: most commands replace no folder

    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.replace(tmp, final)
        return
    aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
    os.replace(final, aside / "d")
    try:
        os.replace(tmp, final)
    except BaseException:  # any failure (also an interrupt) between the two renames: the old folder goes back
        os.replace(aside / "d", final)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def holds(folder, path) -> bool:
    """Whether `path` is `folder` or lies inside it (links resolved): deleting folder would delete path."""
    folder, path = Path(os.path.realpath(folder)), Path(os.path.realpath(path))
    return path == folder or folder in path.parents


@contextmanager
def atomic_dir(tmp: Path, final: Path):
    """Yield the build folder `tmp` (created if missing); on success it replaces `final` (see replace_dir), on any
    failure, an interrupt included, it is removed and `final` is left as it was."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
