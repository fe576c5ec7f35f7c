"""Imported by the ranks' forkserver only (paratrain.distributed.launch.PRELOAD), before the trainer's modules.

The forkserver hands each rank's exit code to the launcher; a SIGTERM or SIGHUP sent to the whole job (a scheduler
signals the process group) must not end it before the ranks it forked have saved and exited, or the launcher would
read every rank's exit code as 255. Each rank restores the default handlers first thing (`launch._rank_main`).

Whatever ends the launcher, SIGKILL included (a scheduler's hard kill, the OOM killer), ends the forkserver with it
(the parent-death signal), and each rank dies with the forkserver the same way: no rank trains on, or writes another
checkpoint, without its launcher."""

import os
import signal

from paratrain.distributed.orphans import LAUNCHER_ENV, SERVER_ENV, die_with_parent

for _signal in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)
die_with_parent(int(os.environ.get(LAUNCHER_ENV, "0")) or None)
os.environ[SERVER_ENV] = str(os.getpid())  # what the ranks forked from here expect as their parent
