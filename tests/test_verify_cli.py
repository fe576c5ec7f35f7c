"""`paratrain verify` as a command: Ctrl-C and SIGTERM stop the sweep (issue 52), `--list`, a row's own steps."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from paratrain.distributed.launch import rank_processes
from paratrain.verify import LAYOUTS, RESUMED, row_steps, row_tolerances

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-verify"])
def test_a_signal_stops_the_sweep(char_data, tmp_path, signum, to_group):
    """A stop signal in the middle of a launched row (ddp2's ranks running): no further row, the row it cut short
    is no FAIL, the finished row is printed, "interrupted", exit 128 + the signal; every process verify started is
    gone and so is its temporary folder. SIGINT goes to the process group (a terminal's Ctrl-C: the ranks get it
    too), SIGTERM to verify alone (it must stop its ranks itself)."""
    # a short TMPDIR: the ranks' forkserver binds a unix socket under it (108 bytes at most; pytest's tmp_path under
    # CI's xdist workers is longer)
    tmp = Path(tempfile.mkdtemp(prefix="vsig-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # (this checkout's paratrain)
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "verify", "--layouts", "accum,ddp2,fsdp2", "--steps",
                             "3", "--set", f"data.dir={char_data}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not (any(line.startswith("accum ") for line in lines) and len(rank_processes(proc.pid)) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    out = "".join(lines)
    assert rc == 128 + signum, out
    assert re.search(r"^accum +1 .* PASS$", out, re.M) and "interrupted" in out, out
    assert "FAIL" not in out and "Traceback" not in out and not re.search(r"^(ddp2|fsdp2) ", out, re.M), out
    deadline = time.monotonic() + 10  # (the forkserver ends with verify: the parent-death signal)
    while left := [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"processes verify started outlived it: {left}"
        time.sleep(0.1)
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("paratrain-verify-", "pymp-"))]
    shutil.rmtree(tmp, ignore_errors=True)
    assert not left, out


def test_list_names_every_row(capsys):
    """`paratrain verify --list`: every row (LAYOUTS, the capabilities' rows, the resumed ones), one line each, with
    its ranks, layout and steps; fp8's rows with their own steps and tolerances."""
    from paratrain.cli import main

    assert main(["verify", "--list"]) == 0
    out = capsys.readouterr().out
    listed = {line[2:].split()[0] for line in out.splitlines()[2:]}
    assert listed == {*LAYOUTS, *RESUMED}
    assert re.search(r"^\* ddp2 +2 ranks, ddp; 20 steps$", out, re.M), out
    assert re.search(r"^  fp8-fsdp2 +2 ranks, fsdp,mb=2, .*; 8 steps, within 3e-04 \(loss", out, re.M), out
    assert re.search(r"^\* resume-ep2:fsdp2 +row aux_free-ep2, then resumed", out, re.M), out


def test_a_row_carries_its_steps_and_tolerance():
    """fp8's rows run the 8 steps their tolerance is for, unless --steps says otherwise; the others run 20."""
    assert row_steps("fp8-pp2", None) == 8 and row_steps("fp8-pp2", 20) == 20 and row_steps("ddp2", None) == 20
    assert row_tolerances("fp8-tp2", 1e-5, 1e-6) == (3e-4, 1e-2, 3e-4)
    assert row_tolerances("tp2", 1e-5, 1e-6) == (1e-5, 1e-5, 1e-6)
