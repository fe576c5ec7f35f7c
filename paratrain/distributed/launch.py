"""Start N local ranks with PyTorch's elastic launcher (what `torchrun` runs), and collect rank 0's result."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from paratrain.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inside_launcher() -> bool:
    """True in a rank started by torchrun / elastic (or srun torchrun): the world is already set up for us."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


# Exit codes of a rank: 2 is bad input (deterministic: never restarted), 3 a collective timeout.
EXIT_USER_ERROR = 2
EXIT_COLLECTIVE_TIMEOUT = 3


def launch(entrypoint, args: tuple, nproc: int, max_restarts: int = 0):
    """Run `entrypoint(*args)` on `nproc` local ranks; returns rank 0's return value.

    When a rank dies (a crash, SIGKILL, a timeout), all ranks are stopped and launched again, up to
    `max_restarts` times; the relaunched ranks see PARATRAIN_ATTEMPT > 0 and resume from the newest
    checkpoint. Bad input (exit code 2) is never retried: it would fail the same way.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from paratrain.faults import ATTEMPT_ENV

    for attempt in range(max_restarts + 1):
        os.environ[ATTEMPT_ENV] = str(attempt)
        try:
            return _launch_once(entrypoint, args, nproc)
        except ChildFailedError as e:
            codes = sorted({f.exitcode for f in e.failures.values()})
            if codes == [EXIT_USER_ERROR]:
                raise LaunchedUserError() from None
            summary = f"{len(e.failures)} of {nproc} ranks failed (exit codes {codes})"
            if attempt == max_restarts:
                hint = "" if max_restarts else "; --max-restarts N relaunches from the last checkpoint"
                raise UserError(f"{summary}; see their messages above{hint}") from None
            print(f"warning: {summary}; restarting all ranks from the last checkpoint "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
        finally:
            os.environ.pop(ATTEMPT_ENV, None)


def _launch_once(entrypoint, args: tuple, nproc: int):
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host must not each take every core
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.1)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                                                  "torch.multiprocessing")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, entrypoint)(*args)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return results.get(0)


class LaunchedUserError(UserError):
    """The ranks already printed the user error; the parent only sets the exit code."""

    def __init__(self):
        super().__init__("")
