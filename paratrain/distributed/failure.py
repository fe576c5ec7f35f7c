"""One error path for every failure after launch.

The rank that fails prints one `error:` line naming the cause and the file involved; its peers, which then see a
broken process group or are told to stop by the launcher, exit quietly with the same code. Which rank failed first
is settled in the process group's store (an atomic counter), so the line appears once even when every rank raises
the same error (DCP gathers a failed write to all ranks). Exit codes tell the launcher whether a restart can help:

    1  a crash (a bug: traceback printed; a rank killed: the launcher names it): restarted by --max-restarts
    2  bad input or environment (config, data, paths, a full or read-only disk): never restarted
    3  a collective timed out (resilience.collective_timeout_s): restarted
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from paratrain.errors import PeerFailed, UserError, causes, environment_problem

EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_COLLECTIVE_TIMEOUT = 3
EXIT_INTERRUPTED = 130
# A Ctrl-C reaches a rank twice (from the terminal, and relayed by the launcher a moment later): one press. A second
# SIGINT after this long is a second press: stop at once (training/preemption.py, launch.StopRelay).
INTERRUPT_REPEAT_S = 1.0

_COUNTER, _RECORD = "paratrain/failures", "paratrain/first_failure"
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "communicator was aborted",
              "remote process exited", "connection refused")


@dataclass
class Failure:
    code: int
    line: str | None  # the `error:` line's text; None: print the traceback (a crash), or nothing (interrupted)
    own: bool = True  # False: a consequence of another rank's failure (that rank reports it)


def is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and ("gloo" in text or "nccl" in text or "collective" in text)


def _peer_lost(error: BaseException) -> bool:
    return any(s in str(e).lower() for e in causes(error) for s in _PEER_LOST)


def collective_failed(error: BaseException) -> bool:
    """A collective timed out, or a peer it needed is gone: the ranks' collective histories tell which."""
    return not isinstance(error, (UserError, PeerFailed)) and (is_collective_timeout(error) or _peer_lost(error))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def classify(error: BaseException, collective_timeout_s: float, run_dir=None) -> Failure:
    if isinstance(error, KeyboardInterrupt):
        return Failure(EXIT_INTERRUPTED, None)
    if isinstance(error, PeerFailed):
        return Failure(EXIT_CRASH, None, own=False)
    if isinstance(error, UserError):
        return Failure(error.exit_code, str(error))
    problem = environment_problem(error)
    if problem is not None:
        return Failure(EXIT_USER_ERROR, problem)
    if is_collective_timeout(error):
        hint = f"; every rank's collective history: paratrain doctor --hang {run_dir}" if run_dir else ""
        return Failure(EXIT_COLLECTIVE_TIMEOUT,
                       f"a collective did not complete within resilience.collective_timeout_s={collective_timeout_s:g} "
                       f"s; another rank is stuck or dead ({first_line(error)}){hint}")
    if _peer_lost(error):  # another rank died: it, or the launcher when it was killed, reports that
        return Failure(EXIT_CRASH, None, own=False)
    return Failure(EXIT_CRASH, None)


def _store():
    """The process group's store with a short timeout, or None (no group yet, or it is gone)."""
    try:
        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        import torch.distributed as dist

        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        from paratrain.distributed.env import default_store

        if not dist.is_initialized():
            return None
        store = default_store()
        store.set_timeout(timedelta(seconds=5))
        return store
    except Exception:  # noqa: BLE001 - no store: fall back to rank 0 reporting
        return None


def _first_record(store) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that failed first, once one has said so."""
    try:
        if store is not None and store.check([_RECORD]):
            rank, code = store.get(_RECORD).decode().split(":")
            return int(rank), int(code)
    except Exception:  # noqa: BLE001 - the store may be gone with the launcher
        pass
    return None


def _first_failure(store) -> int | None:
    """The exit code of the rank that failed first, if one has said so."""
    first = _first_record(store)
    return first[1] if first else None


def first_failed_rank() -> int | None:
    """The rank that failed first (it reports for the job), once one has said so."""
    first = _first_record(_store())
    return first[0] if first else None


def _claim(store, rank: int, code: int) -> bool:
    """True for the first rank to fail (it reports); False for the others."""
    if store is None:
        return rank == 0
    try:
        first = store.add(_COUNTER, 1) == 1
        if first:
            store.set(_RECORD, f"{rank}:{code}")
        return first
    except Exception:  # noqa: BLE001
        return rank == 0


def report(error: BaseException, rank: int, world: int, collective_timeout_s: float, run_dir=None) -> int:
    """Print what this rank has to say about `error` (at most one line, or a crash's traceback) and return its exit
    code. `run_dir`: where a collective timeout's histories go (named in its line)."""
    failure = classify(error, collective_timeout_s, run_dir)
    store = _store()
    if not failure.own:  # quiet, with the exit code of the rank that failed (it wrote its record before exiting)
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            code = _first_failure(store)
            if code is not None:
                return code
            time.sleep(0.05)
        return failure.code
    prefix = f"[rank {rank}] " if world > 1 and store is not None else ""
    if _claim(store, rank, failure.code) or (failure.line is None and failure.code == EXIT_CRASH):
        if failure.line is not None:
            print(f"error: {prefix}{failure.line}", file=sys.stderr, flush=True)
        elif failure.code == EXIT_CRASH:  # a bug: the traceback is the report
            import traceback

            print(f"[rank {rank}] " + "".join(traceback.format_exception(error)), file=sys.stderr, flush=True)
    return failure.code


def stop_if_peer_failed() -> None:
    """On SIGTERM from the launcher: if another rank has failed, this is the launcher stopping the job, not a
    preemption; leave at once and quietly with that rank's exit code."""
    code = _first_failure(_store())
    if code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
