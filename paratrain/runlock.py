"""One live writer per run folder.

A run holds an exclusive OS lock (`flock`) on RUN_DIR/.lock for its life: the launcher of `paratrain train --nproc
N` (its ranks die with it: distributed/orphans.py), the process itself without one, global rank 0 under torchrun.
The kernel drops the lock when the holder ends, however it ends, so a killed run never leaves it held. A second
train or resume of the same folder, or a command that would write over it (`export --overwrite` into it, `report`
into it), gets one line naming the live run's pid and host, and writes nothing. Torch-free.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from paratrain.errors import UserError

LOCK_NAME = ".lock"  # in the run folder; never counted as an earlier run's file, never deleted by run.overwrite


class RunLock:
    """The lock of one run folder, held until `release()` or this process ends."""

    def __init__(self, folder: Path, fd: int, created: bool):
        self.folder, self.fd, self.created = folder, fd, created

    def claim(self) -> None:
        """Write this process into the lock file (what a refused second run names): once the run's checks have
        passed, so that a refused launch changes nothing in an existing folder."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (closing drops the lock; the file stays for the next run)
            self.fd = None

    def abandon(self) -> None:
        """A launch refused after the lock was taken: release it, and remove the folder if taking it made the folder
        and nothing else was written there (a refused launch leaves nothing behind)."""
        self.release()
        if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
            (self.folder / LOCK_NAME).unlink()
            self.folder.rmdir()


def holder(folder: Path) -> str:
    """Who holds a run folder's lock, as its lock file says: 'pid P on host H since T'."""
    try:
        pid, host, since = (folder / LOCK_NAME).read_text().split()[:3]
        return f"pid {pid} on host {host} since {time.strftime('%H:%M:%S', time.localtime(float(since)))}"
    except (OSError, ValueError):
        return "another process"


def hold_run_folder(folder: Path, what: str = "train") -> RunLock:
    """Take the run folder's lock for this process's life (the folder is made if it is new; `claim` it once the
    run's checks pass); UserError naming the live run when another process holds it (nothing written then)."""
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"{folder} is in use by a live run ({holder(folder)}): {what} would write into it; wait for "
                        "it to end, stop it, or choose another --run.name") from None
    lock = RunLock(folder, fd, created)
    if created:
        lock.claim()
    return lock


def refuse_if_live(folder: Path, what: str) -> None:
    """UserError when a live run holds `folder` (a run folder, or any folder inside one): `what` would write there."""
    folder = Path(folder).resolve()
    for candidate in (folder, *folder.parents):
        lock = candidate / LOCK_NAME
        if not lock.is_file():
            continue
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{candidate} is in use by a live run ({holder(candidate)}): {what} would write into "
                            "it; wait for the run to end or write elsewhere") from None
        finally:
            os.close(fd)
        return
