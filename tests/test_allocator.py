"""`[memory] allocator`: the CUDA caching allocator's settings, checked before launch and put in every rank's
environment before CUDA starts; a person's own PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF wins (paratrain/allocator.py).
On a CPU the settings reaching the ranks is what can be tested; the CUDA metrics are absent there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import fast_overrides
from paratrain import allocator
from paratrain.config import load_config
from paratrain.errors import ConfigError


@pytest.mark.parametrize("setting", ["", "expandable_segments:True", "expandable_segments:False,max_split_size_mb:128",
                                     "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6",
                                     "backend:cudaMallocAsync"])
def test_good_settings(setting):
    assert allocator.problem(setting) is None
    assert load_config(None, [f"memory.allocator={setting}"]).memory.allocator == setting


@pytest.mark.parametrize("setting, says", [("expandable_segments", "is not key:value"),
                                           ("expandable_segments:yes", "True or False"),
                                           ("max_split_size_mb:lots", "takes a number"),
                                           ("backend:malloc", "native or cudaMallocAsync"),
                                           ("expandable_segment:True", "unknown key 'expandable_segment'")])
def test_bad_settings_are_config_errors(setting, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, [f"memory.allocator={setting}"])


def test_yours_wins(monkeypatch):
    for name in (*allocator.ENV_NAMES, allocator.SET_BY_PARATRAIN):
        monkeypatch.delenv(name, raising=False)
    allocator.apply("expandable_segments:True")
    assert os.environ[allocator.env_name()] == "expandable_segments:True"
    assert allocator.in_effect() == ("expandable_segments:True", "memory.allocator")
    allocator.apply("")  # another run's "" in the same process: torch's defaults again
    assert not any(name in os.environ for name in allocator.ENV_NAMES)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    allocator.apply("expandable_segments:True")
    assert os.environ.get(allocator.NEW_NAME) is None  # nothing of paratrain's beside it
    assert allocator.in_effect() == ("max_split_size_mb:64", "your PYTORCH_CUDA_ALLOC_CONF")


def test_bad_setting_is_one_line_before_launch(tmp_path):
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", "--nproc", "2",
                           "--memory.allocator=expandable_segments:yes", f"--run.out_dir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("error: memory.allocator: expandable_segments takes True or False, got 'yes'")
    assert not any(tmp_path.iterdir())  # no run folder


def test_ranks_start_with_the_setting(char_data, tmp_path, prewarmed):
    """A 2-rank CPU training: each rank's memory row says which settings it started with; the CUDA numbers
    (fragmentation, retries) are absent, not zeros."""
    env = {k: v for k, v in os.environ.items() if k not in (*allocator.ENV_NAMES, allocator.SET_BY_PARATRAIN)}
    setting = "expandable_segments:True,max_split_size_mb:64"
    argv = [sys.executable, "-m", "paratrain", "train", "--nproc", "2", "--oversubscribe",
            *(f"--{o}" for o in fast_overrides(char_data, tmp_path, "alloc", "training.steps=1",
                                               f"memory.allocator={setting}"))]
    done = prewarmed.run(argv, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (tmp_path / "alloc" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for r in records for row in r.get("rank_memory", [])]
    assert sorted({row["rank"] for row in rows}) == [0, 1]
    assert all(row["allocator"] == setting for row in rows)
    assert not any("mem_fragmentation_mib" in r or "alloc_retries" in r for r in records)


def test_cuda_numbers_from_the_rank_rows():
    """The worst rank's reserved - allocated gap and every rank's retries; nothing from CPU rows."""
    from paratrain.observe.sysmetrics import allocator_summary

    mib = 2**20
    rows = [{"rank": 0, "cuda_allocated_bytes": 10 * mib, "cuda_reserved_bytes": 12 * mib, "cuda_alloc_retries": 1},
            {"rank": 1, "cuda_allocated_bytes": 10 * mib, "cuda_reserved_bytes": 15 * mib, "cuda_alloc_retries": 2}]
    assert allocator_summary(rows) == {"mem_fragmentation_mib": 5.0, "alloc_retries": 3}
    assert allocator_summary([{"rank": 0, "rss_bytes": 1}]) == {}


def test_doctor_says_what_is_in_effect(monkeypatch):
    from paratrain.observe.doctor import check_allocator

    for name in (*allocator.ENV_NAMES, allocator.SET_BY_PARATRAIN):
        monkeypatch.delenv(name, raising=False)
    allocator.apply("expandable_segments:True")
    [line] = check_allocator()
    assert line.status == "OK" and "expandable_segments:True (memory.allocator)" in line.message
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segment:True")  # yours, misspelt: torch would refuse it
    [line] = check_allocator()
    assert line.status == "FAIL" and "your PYTORCH_ALLOC_CONF" in line.message and "unknown key" in line.message
