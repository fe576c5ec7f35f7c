"""Start N local ranks with PyTorch's elastic launcher (what `torchrun` runs), and collect rank 0's result."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid

from paratrain.distributed.attempts import ATTEMPT_ENV, attempt  # (ATTEMPT_ENV: set here for the ranks)
from paratrain.distributed.failure import EXIT_COLLECTIVE_TIMEOUT, EXIT_INTERRUPTED, EXIT_USER_ERROR, INTERRUPT_REPEAT_S
from paratrain.distributed.orphans import LAUNCHER_ENV, SERVER_ENV, die_with_parent
from paratrain.errors import UserError


# Ranks are forked from a forkserver that imported torch and the trainer once (multiprocessing's preload), instead of
# each starting a fresh interpreter (spawn) that imports them again: ~3 s of CPU per rank on a laptop core, more on a
# node where eight ranks import at once. The forkserver is a fresh, single-threaded process that only imports (no CUDA
# is initialised by importing), so forking it is safe where forking the launcher (threads: the rendezvous store)
# would not be.
START_METHOD = "forkserver"


# rank_server: the forkserver outlives a SIGTERM to the job; torch._dynamo: torch imports it on a model's first
# initialisation (~1 s). A caller adds what its ranks import (`launch(preload=...)`: the trainer's modules).
PRELOAD = ("paratrain.distributed.rank_server", "torch._dynamo")
# What torch elastic sets per rank (local_elastic_agent._start_workers), kept over the launcher's environment.
ELASTIC_VARS = frozenset({"LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                          "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"})


def _rank_main(environ: dict, entrypoint, *args):
    """A rank's entry point: the launcher's environment at this launch (a forkserver's child starts with the one the
    forkserver started with; multiprocessing restores the folder and sys.path itself), with elastic's per-rank
    variables on top; then `entrypoint(*args)`."""
    # a rank never outlives the forkserver, nor it the launcher (distributed/orphans.py)
    die_with_parent(int(os.environ.get(SERVER_ENV, "0")) or None)
    for stop in (signal.SIGTERM, signal.SIGHUP):  # the forkserver ignores them (rank_server.py); a rank must not
        signal.signal(stop, signal.SIG_DFL)
    elastic = {k: v for k, v in os.environ.items() if k in ELASTIC_VARS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update({**environ, **elastic})
    return entrypoint(*args)


def start_rank_server(preload: tuple[str, ...] = ()) -> None:
    """Start the forkserver the ranks will come from, if it is not running, importing PRELOAD and `preload`: its
    imports then overlap this process's own checks before the launch (idempotent: the first start's modules stay;
    the server ends with this process)."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload([*PRELOAD, *preload])
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the server dies with this process (rank_server.py)
    forkserver.ensure_running()


def rank_processes(launcher_pid: int | None = None) -> list:
    """The rank processes of the launcher `launcher_pid` (default: this process), oldest first: the children of its
    forkserver (the launcher's own child; a rank's own children are not ranks)."""
    import psutil
    from multiprocessing import forkserver

    # This process's own forkserver is known by pid (multiprocessing keeps it); another launcher's is its child
    # running multiprocessing's forkserver
    own = forkserver._forkserver._forkserver_pid if launcher_pid in (None, os.getpid()) else None
    found = []
    for child in psutil.Process(launcher_pid).children():
        try:
            if child.pid == own or (own is None and "forkserver" in " ".join(child.cmdline())):
                found += child.children()
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inside_launcher() -> bool:
    """True in a rank started by torchrun / elastic (or srun torchrun): the world is already set up for us."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


class Preempted(UserError):
    """The launcher got SIGTERM and the ranks did not save and stop in time (exit code 143 = 128 + SIGTERM)."""

    exit_code = 143


class Interrupted(UserError):
    """The launcher got SIGINT and the ranks ended without saving (exit code 130 = 128 + SIGINT)."""

    exit_code = EXIT_INTERRUPTED


def launch(entrypoint, args: tuple, nproc: int, max_restarts: int = 0, grace_s: float = 30.0,
           preload: tuple[str, ...] = ()):
    """Run `entrypoint(*args)` on `nproc` local ranks; returns rank 0's return value. `preload`: modules the ranks
    import, imported once by the forkserver they are forked from (with the entrypoint's own module).

    When a rank dies (a crash, SIGKILL, a timeout), all ranks are stopped and launched again, up to
    `max_restarts` times; the relaunched ranks see PARATRAIN_ATTEMPT > 0 and resume from the newest
    checkpoint. Bad input (exit code 2) is never retried: it would fail the same way.

    SIGTERM to this process (a scheduler stopping the job) is passed on to the ranks, which save and exit; the
    launcher waits at most `grace_s` seconds for them, then kills them (torch elastic would wait 30 s).
    """
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with StopRelay(grace_s) as relay:
        for attempt in range(max_restarts + 1):
            os.environ[ATTEMPT_ENV] = str(attempt)
            try:
                return _launch_once(entrypoint, args, nproc, grace_s, (*preload, entrypoint.__module__))
            except ChildFailedError as e:
                codes = sorted({f.exitcode for f in e.failures.values()})
                if relay.expired:
                    raise Preempted(f"the ranks did not save and stop within resilience.preempt_grace_s="
                                    f"{grace_s:g} s after SIGTERM; they were killed") from None
                if relay.aborted:
                    raise Interrupted("interrupted twice: the ranks were stopped without a checkpoint") from None
                if relay.interrupted_at is not None:
                    raise Interrupted(f"interrupted before the ranks had saved (exit codes {codes})") from None
                if relay.noticed_at is not None:
                    raise Preempted(f"stopped by SIGTERM before the ranks had finished (exit codes {codes})") from None
                if codes == [EXIT_USER_ERROR]:
                    raise LaunchedUserError() from None
                summary = _describe(e.failures, nproc)
                if attempt == max_restarts:
                    # the rank that noticed printed the one line (and stopped the peers that hung: killed)
                    if EXIT_COLLECTIVE_TIMEOUT in codes and all(c == EXIT_COLLECTIVE_TIMEOUT or c < 0 for c in codes):
                        raise LaunchedUserError(EXIT_COLLECTIVE_TIMEOUT) from None
                    hint = "" if max_restarts else "; --max-restarts N relaunches from the last checkpoint"
                    raise LaunchedCrash(f"{summary}{hint}") from None
                print(f"warning: {summary}; restarting all ranks from the last checkpoint "
                      f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
            finally:
                os.environ.pop(ATTEMPT_ENV, None)


def _describe(failures: dict, nproc: int) -> str:
    """'rank 1 was killed by SIGKILL' / 'rank 0 crashed (exit code 1; its traceback is above)'."""
    parts = []
    for local_rank, f in sorted(failures.items()):
        if f.exitcode < 0:
            try:
                name = signal.Signals(-f.exitcode).name
            except ValueError:
                name = f"signal {-f.exitcode}"
            parts.append(f"rank {local_rank} was killed by {name}")
        else:
            parts.append(f"rank {local_rank} failed with exit code {f.exitcode} (its message is above)")
    return f"{'; '.join(parts)} ({nproc} ranks)"


def _launch_once(entrypoint, args: tuple, nproc: int, grace_s: float, preload: tuple[str, ...]):
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host must not each take every core
    # SIGTERM and SIGINT are ours (StopRelay); elastic keeps the other stop signals, and waits for the ranks at most
    # the grace period before killing them (its default is 30 s, whatever the scheduler allows).
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.1, signals_to_handle="SIGHUP,SIGQUIT",
                          shutdown_timeout=max(1, math.ceil(grace_s)), start_method=START_METHOD)
    start_rank_server(preload)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                                                  "torch.multiprocessing")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _rank_main)(dict(os.environ), entrypoint, *args)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return results.get(0)


class StopRelay:
    """While ranks run, the two stop signals to this launcher are handed to every rank, ranks still starting up
    included, instead of torch elastic's shutdown (which waits 30 s for ranks that are waiting for it):
    - SIGTERM (a scheduler): each rank saves at its next step boundary and exits 0, so the launcher returns
      normally; past the grace period the ranks are killed.
    - SIGINT (Ctrl-C): the same save, with no deadline (the person is there; the run then exits 130). A Ctrl-C at a
      terminal reaches the ranks directly as well, and they take the relayed copy for the same press
      (training/preemption.py). A second SIGINT kills the ranks at once, without a checkpoint."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.noticed_at: float | None = None  # the first SIGTERM
        self.interrupted_at: float | None = None  # the first SIGINT
        self.expired = False  # the ranks were killed: SIGTERM's grace period ran out
        self.aborted = False  # the ranks were killed: a second SIGINT
        self._previous: dict = {}
        self._done = threading.Event()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
                              signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint)}
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _on_sigterm(self, signum, frame) -> None:
        if self.noticed_at is None:
            self.noticed_at = time.monotonic()
            self._start_relay(signal.SIGTERM, self.noticed_at + self.grace_s)

    def _on_sigint(self, signum, frame) -> None:
        now = time.monotonic()
        if self.interrupted_at is None:
            self.interrupted_at = now
            self._start_relay(signal.SIGINT, math.inf)
        elif now - self.interrupted_at >= INTERRUPT_REPEAT_S:  # a second press, not the first one's echo
            self.aborted = True
            _kill(rank_processes())

    def _start_relay(self, signum, deadline: float) -> None:
        threading.Thread(target=self._relay, args=(signum, deadline), name="paratrain-stop-relay",
                         daemon=True).start()

    def _relay(self, signum, deadline: float) -> None:
        told: set[int] = set()
        while not self._done.is_set() and time.monotonic() < deadline:
            for proc in rank_processes():
                if proc.pid not in told:
                    told.add(proc.pid)
                    try:
                        proc.send_signal(signum)
                    except Exception:  # noqa: BLE001 - it exited meanwhile
                        pass
            self._done.wait(0.1)
        if not self._done.is_set():
            self.expired = True
            _kill(rank_processes())


def _kill(processes) -> None:
    for proc in processes:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - it exited meanwhile
            pass


class LaunchedUserError(UserError):
    """The ranks already printed the one error line; the parent only sets the exit code."""

    def __init__(self, exit_code: int = EXIT_USER_ERROR):
        super().__init__("")
        self.exit_code = exit_code


class LaunchedCrash(UserError):
    """Ranks crashed (their tracebacks are above) and no restart is left: exit code 1, not 2."""

    exit_code = 1
