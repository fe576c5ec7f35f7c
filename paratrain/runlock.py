"""One live writer per run folder.

A run holds an exclusive OS lock (`flock`) on its run folder itself for its life: the launcher of `paratrain train
--nproc N` (its ranks die with it: distributed/orphans.py), the process itself without one, global rank 0 under
torchrun. The kernel drops the lock when the holder ends, however it ends, so a killed run never leaves it held, and
no lock file is ever written. A second train or resume of the same folder, or a command that would write into it
(`export --overwrite`, `report`), gets one line naming the live run's pid and host, and writes nothing. Torch-free.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from paratrain.errors import UserError


class RunLock:
    """The lock of one run folder, held until `release()` or this process ends."""

    def __init__(self, folder: Path, fd: int, created: list[Path]):
        self.folder, self.fd, self.created = folder, fd, created  # created: the folders taking it made, innermost first

    def release(self) -> None:
        """Drop the lock; a folder that taking it made and that is still empty (the run was refused before it wrote
        anything) goes too."""
        if self.fd is not None:
            os.close(self.fd)  # (closing drops the lock)
            self.fd = None
            for made in self.created:
                if not made.is_dir() or any(made.iterdir()):
                    break
                made.rmdir()


def holder(folder: Path) -> str:
    """Who holds a folder's lock: 'pid P on host H' (the kernel's table of locks, /proc/locks; the lock is local to
    this host)."""
    pid = None
    try:
        inode = os.stat(folder).st_ino
        with open("/proc/locks") as table:  # e.g. "1: FLOCK  ADVISORY  WRITE 2915 fd:00:1836033 0 EOF"
            for line in table:
                fields = line.split()
                if "->" not in fields and len(fields) > 5 and fields[1] == "FLOCK" \
                        and fields[5].rsplit(":", 1)[-1] == str(inode):
                    pid = int(fields[4])
                    break
    except (OSError, ValueError):
        pass
    return f"pid {pid} on host {socket.gethostname()}" if pid else f"another process on host {socket.gethostname()}"


def hold_run_folder(folder: Path, what: str = "this train") -> RunLock:
    """Take the run folder's lock for this process's life (making the folder if it is new); UserError naming the
    live run when another process holds it. Taken once a run's checks have passed, so a refused launch writes
    nothing (`refuse_if_live` names a live run before them)."""
    folder = Path(folder)
    created = [f for f in (folder, *folder.parents) if not f.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(_in_use(folder, what)) from None
    return RunLock(folder, fd, created)


def _in_use(folder: Path, what: str) -> str:
    return (f"{folder} is in use by a live run ({holder(folder)}): {what} would write into it; wait for it to end, "
            "stop it, or choose another --run.name")


def refuse_if_live(folder: Path, what: str) -> None:
    """UserError when a live run holds `folder` or a folder it is in (a run folder, or any folder inside one): `what`
    would write there. Only looks (a shared lock, at once released): writes nothing."""
    folder = Path(folder).resolve()
    for candidate in (folder, *folder.parents):
        if not candidate.is_dir():
            continue
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # a folder this user cannot open holds no run of theirs
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(_in_use(candidate, what)) from None
        finally:
            os.close(fd)
