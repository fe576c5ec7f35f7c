"""Imported by the ranks' forkserver only (paratrain.distributed.launch.PRELOAD), before the trainer's modules.

The forkserver hands each rank's exit code to the launcher; a SIGTERM or SIGHUP sent to the whole job (a scheduler
signals the process group) must not end it before the ranks it forked have saved and exited, or the launcher would
read every rank's exit code as 255. The forkserver ends when the launcher does (multiprocessing closes its pipe).
Each rank restores the default handlers first thing (`launch._rank_main`)."""

import signal

for _signal in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)
