"""Commands run as fresh processes, without paying a fresh interpreter's imports each time.

A documented command (`paratrain train ...`) or a bench script run as a subprocess spends ~5 s of CPU importing torch,
DCP and the trainer before it does anything; the suite runs ~100 of them. `Prewarmed` is one process per pytest
worker that imported those once and forks a child for each command: the child is a process of its own (its own pid,
process group, working folder, environment, stdin/stdout/stderr, exit code, atexit and interpreter shutdown), running
`python -m paratrain ...` or `python script.py` through runpy exactly as the interpreter would, only with the imports
already done. What the fork cannot show (a module the product forgets to import, a warning printed at import time) is
covered by the tests that start real interpreters (tests/test_observability.py, tests/test_faults.py, `make run`).

The server is single-threaded and has run no torch operation (so forking it is safe, as the ranks' forkserver is).
A command's forkserver is a fork too: multiprocessing would start the ranks' forkserver as a fresh interpreter
importing torch and the trainer again (~8 s of CPU per launch); in a command here it forks the command, whose imports
are done (`warm_spawn`), and the forkserver forks the ranks from that as usual. The resource tracker starts as usual.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from paratrain.api import RANK_MODULES
from paratrain.distributed.launch import PRELOAD

# What the server imports before its first fork: the CLI, checkpointing, and what the launcher preloads for its ranks.
WARM = ("paratrain.cli", "torch.distributed.checkpoint", *PRELOAD, *RANK_MODULES)

SERVER = r"""
import importlib, json, os, runpy, sys, tempfile
for name in sys.argv[1].split(","):
    importlib.import_module(name)
requests, replies = sys.stdin, sys.stdout


def warm_spawn(path, args, passfds):
    # multiprocessing starts the ranks' forkserver as a fresh interpreter running `python -c CODE` that imports torch
    # and the trainer again; here CODE runs in a fork of this warm process instead (~8 s of imports saved per
    # launch). The forkserver's preload is imported already, so rank_server's set-up (the parent-death signal on the
    # launcher, the ignored stop signals, its pid for the ranks) is run again, as its import would. Other helpers
    # (the resource tracker: it imports nothing heavy, and ends when its pipe closes) start as usual.
    code = args[args.index("-c") + 1] if "-c" in args else ""
    if "multiprocessing.forkserver" not in code:
        return spawnv_passfds(path, args, passfds)
    pid = os.fork()
    if pid:
        return pid
    try:
        import importlib
        import threading
        import multiprocessing.forkserver as forkserver
        from paratrain.distributed import rank_server

        forkserver._forkserver._lock = threading.Lock()  # (the launcher holds its copy's lock right now)
        importlib.reload(rank_server)
        exec(code, {"__name__": "__mp_helper__"})
    except SystemExit:
        pass
    finally:
        os._exit(0)


def child(request):
    global spawnv_passfds
    import multiprocessing.util

    spawnv_passfds = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = warm_spawn
    os.setpgid(0, 0)  # a group of its own, as start_new_session gives a subprocess: killpg ends it and its ranks
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the server's imports settled it from the server's TMPDIR; a fresh one reads this TMPDIR
    sys.path[0] = request["path0"]
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = list(request["argv"])
    if request["module"]:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(sys.argv[0], run_name="__main__")


for line in requests:
    request = json.loads(line)
    replies.flush()
    pid = os.fork()
    if pid == 0:
        requests = None
        child(request)  # raises SystemExit (the command's exit) or returns (exit 0), ending this process normally
        break
    print(json.dumps({"pid": pid}), file=replies, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
"""


class Prewarmed:
    """One warm server; `run` works like subprocess.run(..., capture_output=True, text=True) for one command at a
    time."""

    def __init__(self):
        self.server = subprocess.Popen([sys.executable, "-c", SERVER, ",".join(WARM)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lock = threading.Lock()

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """argv: [sys.executable, "-m", module, ...] or [sys.executable, script, ...]."""
        assert argv[0] == sys.executable, argv
        module = argv[2] if argv[1] == "-m" else None
        args = [module, *argv[3:]] if module else argv[1:]
        with self.lock, tempfile.TemporaryDirectory(prefix="prewarmed-") as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            out.touch()
            err.touch()
            path0 = str(Path(cwd).resolve()) if module else str(Path(args[0]).resolve().parent)
            request = {"argv": args, "module": module, "cwd": str(cwd), "env": dict(env), "path0": path0,
                       "stdout": str(out), "stderr": str(err)}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            pid = json.loads(self.server.stdout.readline())["pid"]
            stopped = []
            timer = threading.Timer(timeout, lambda: stopped.append(self._stop(pid)))
            timer.start()
            try:
                reply = self.server.stdout.readline()
            finally:
                timer.cancel()
            if not reply:
                raise RuntimeError(f"the prewarmed server ended while running {argv}")
            code = json.loads(reply)["returncode"]
            if stopped and code == -signal.SIGKILL:  # (not a command that ended as its time ran out)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    @staticmethod
    def _stop(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)  # the group this command's child leads: it and the ranks it started
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)
