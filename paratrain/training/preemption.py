"""SIGTERM in a training process: a preemption notice with a deadline; SIGINT (Ctrl-C): the same stop, by a person.

The Python handler only sets a flag; the ranks agree on it at the next step boundary, save, and exit
(`ResilienceGuard.preempted`). The deadline must hold even when the main thread is blocked inside a collective
(Python runs signal handlers only between bytecodes of the main thread), so the signal is also written to a wakeup
pipe that a small thread reads the moment it arrives: it starts the grace-period watchdog and runs the `on_signal`
hooks (a launched rank uses one to stop at once when another rank has already failed).

A launched rank arms the watch first thing (`watching` in `paratrain.api.run_rank`), so a notice that arrives while
it is still starting up is not lost; the training loop then finds the same watch. The same thread answers SIGUSR2
(the `on_dump` hooks: a launched rank writes its collective history, paratrain/observe/hang.py), also while the main
thread is blocked in a collective. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from paratrain.distributed.failure import EXIT_INTERRUPTED, INTERRUPT_REPEAT_S
from paratrain.faults import ATTEMPT_ENV

EXIT_PREEMPT_EXPIRED = 143  # 128 + SIGTERM: what a scheduler expects from a job that did not stop in time


class PreemptionWatch:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested = False
        self.interrupted_at: float | None = None  # the first SIGINT: the stop was asked by a person (exit 130)
        self.noticed_at: float | None = None
        self.saved_step: int | None = None  # set once the preemption checkpoint is committed
        self.on_signal: list = []  # called from the watcher thread on every SIGTERM
        self.on_dump: list = []  # called from the watcher thread on every SIGUSR2
        self._previous_usr2 = None
        self._previous_int = None
        self._lock = threading.RLock()  # re-entered if a handler runs inside notice() (no wakeup pipe)
        self._watchdog: threading.Timer | None = None
        self._previous = None
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    # -- the notice -------------------------------------------------------------------------------
    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    def interrupt(self) -> None:
        """A SIGINT arrived here, or another rank got one: stop at the next step boundary, with no deadline."""
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
        self.requested = True

    def notice(self) -> None:
        """A SIGTERM arrived here, or another rank got one: the grace period starts (once)."""
        self.requested = True
        with self._lock:
            if self._watchdog is not None:
                return
            self.noticed_at = time.monotonic()
            self._watchdog = threading.Timer(self.grace_s, self._expired)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expired(self) -> None:
        # Under paratrain's own launcher the launcher reports the expiry (one line for the job); alone, or under
        # torchrun, rank 0 does.
        if ATTEMPT_ENV not in os.environ and int(os.environ.get("RANK", "0")) == 0:
            done = (f"; the checkpoint of step {self.saved_step} was saved" if self.saved_step is not None
                    else " before the checkpoint was saved")
            print(f"error: did not stop within the preemption grace period "
                  f"(resilience.preempt_grace_s={self.grace_s:g} s){done}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PREEMPT_EXPIRED)

    def _on_sigterm(self, signum, frame) -> None:
        # Only a flag here: the watcher thread, woken by the same signal through the pipe, starts the grace period.
        # A handler that took the lock could run inside notice() on this thread (a second SIGTERM, as a scheduler's
        # signal to the job's process group and the launcher's relayed copy arrive together, lands while notice()
        # waits for its watchdog thread to start) and wait for itself forever.
        self.requested = True
        if self._pipe is None or self._previous_fd is None:  # no wakeup pipe: no watcher thread to do it
            self.notice()

    def _watch_pipe(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # stop() closed the write end
                return
            if signal.SIGTERM in data:
                self.notice()
                for hook in list(self.on_signal):
                    hook()
            if signal.SIGUSR2 in data:
                for hook in list(self.on_dump):
                    hook()
            if signal.SIGINT in data:
                self._on_interrupt()

    def _on_interrupt(self) -> None:
        first = self.interrupted_at is None
        if not first and time.monotonic() - self.interrupted_at < INTERRUPT_REPEAT_S:
            return  # the same Ctrl-C, relayed by the launcher
        if not first:
            if int(os.environ.get("RANK", "0")) == 0:
                print("interrupted again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)
        self.interrupt()
        if int(os.environ.get("RANK", "0")) == 0:
            print("interrupted: saving a checkpoint at the end of this step (Ctrl-C again stops at once, without "
                  "one)", file=sys.stderr, flush=True)

    # -- installing -------------------------------------------------------------------------------
    def start(self) -> "PreemptionWatch":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be installed by the main thread; the caller's own stay
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        # a Python handler makes the signal reach the wakeup pipe; the watcher thread does the work
        self._previous_usr2 = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
        self._previous_int = signal.signal(signal.SIGINT, lambda signum, frame: None)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        try:
            self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            self._previous_fd = None
        self._thread = threading.Thread(target=self._watch_pipe, args=(read_fd,), name="paratrain-sigterm",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            signal.signal(signal.SIGUSR2, self._previous_usr2)
            signal.signal(signal.SIGINT, self._previous_int)
            self._previous = None
        if self._pipe is not None:
            if self._previous_fd is not None:
                signal.set_wakeup_fd(self._previous_fd)
            read_fd, write_fd = self._pipe
            self._pipe = None
            os.close(write_fd)  # the watcher reads EOF and ends
            if self._thread is not None:
                self._thread.join(timeout=1)
            os.close(read_fd)
        if self._watchdog is not None:
            self._watchdog.cancel()


_ACTIVE: PreemptionWatch | None = None


@contextlib.contextmanager
def watching(grace_s: float):
    """The process's PreemptionWatch for the block: the one already armed by an enclosing block (a launched rank
    arms it before anything else), or a new one."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    watch = PreemptionWatch(grace_s).start()
    _ACTIVE = watch
    try:
        yield watch
    finally:
        _ACTIVE = None
        watch.stop()


def active_watch() -> PreemptionWatch | None:
    """The watch of the training running in this process now (inside `watching`), or None: how a thread that owns the
    signals stops a training that runs in another (`paratrain verify`'s main thread, its sweep in a worker thread)."""
    return _ACTIVE
