"""Benchmarks cannot rot: every script in bench/ runs as `python bench/<name>.py --smoke` (its own code at tiny sizes:
a few steps, a tiny model, one or two configurations) in a fresh working folder, exits 0 and prints its table. The
scripts are found by globbing bench/*.py, so a new benchmark without --smoke fails here. Correctness only: the numbers
a smoke run prints are not checked (measured numbers go to bench/RESULTS.md from full runs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# Modules in bench/ that the scripts (and the estimator's tests) import, not benchmarks of their own.
LIBRARIES = {"memory_measure"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in LIBRARIES)
TIMEOUT_S = 600  # a smoke run takes seconds to a minute; this only stops a hang
# A markdown table: a header row, its separator (| --- | ---: |) and at least one row.
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def printed_table(text: str) -> bool:
    lines = [line.strip() for line in text.splitlines()]
    return any(SEPARATOR.match(line) and i > 0 and lines[i - 1].startswith("|") and i + 1 < len(lines)
               and lines[i + 1].startswith("|") for i, line in enumerate(lines))


def test_the_libraries_are_there():
    assert {p.stem for p in BENCH.glob("*.py")} >= LIBRARIES
    assert len(SCRIPTS) >= 16, SCRIPTS


def test_a_table_is_recognised():
    assert printed_table("x\n| a | b |\n| --- | ---: |\n| 1 | 2 |\n")
    assert not printed_table("| a | b |\n| --- | ---: |\n") and not printed_table("steps wall\n4 1.0\n")


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_smoke(name, tmp_path, prewarmed):
    """`python bench/<name>.py --smoke` in an empty working folder (what it writes lands there, or in a temporary
    folder of its own), one thread per process, as a process of its own (forked from one that imported torch:
    tests/prewarmed.py); exit 0 and a table on stdout."""
    scratch = tempfile.mkdtemp(prefix="bench-smoke-")  # TMPDIR (short: the forkserver's socket lives under it)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        proc = prewarmed.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke"], cwd=tmp_path, env=env,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"bench/{name}.py --smoke did not finish in {TIMEOUT_S} s:\n{(e.output or '')[-4000:]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench/{name}.py --smoke exited {proc.returncode} after {seconds:.0f} s:\n{out[-6000:]}"
    assert printed_table(proc.stdout), f"bench/{name}.py --smoke printed no table:\n{out[-4000:]}"
