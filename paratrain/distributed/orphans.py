"""No process outlives the one that started it: the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`).

The launcher's forkserver and the ranks it forks call `die_with_parent()` first thing: when their parent ends, by any
means (SIGKILL included, which no handler sees), the kernel sends them SIGKILL. A kill, not a stop signal: a rank's
SIGTERM handler would save a checkpoint, and a launcher that is gone cannot collect it. Torch-free.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_ENV = "PARATRAIN_LAUNCHER_PID"  # the launcher's pid, for its forkserver (set before the server starts)
SERVER_ENV = "PARATRAIN_RANK_SERVER_PID"  # the forkserver's pid, in its environment: its ranks' expected parent


def die_with_parent(parent: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends; if the parent already ended (this process was
    re-parented before asking: its parent is no longer `parent`, the pid that started it), end now. False where the
    platform has no such signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = parent or os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)
    return True
