"""Shared fixtures: one char-level tinyshakespeare dataset and one tiny trained checkpoint per session."""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from paratrain.data import DEFAULT_CORPUS, prepare_dataset

# The memory measurement harness is a benchmark (bench/memory_measure.py), imported by the estimator's tests as
# `memory_measure` (appended: a bench script's name never hides an installed package).
BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

# One Inductor cache for every process of the suite (torchao's AdamW8bit compiles its step on a CPU: ~60 s cold, a
# second later), also for the commands given a TMPDIR of their own (the default cache sits under TMPDIR).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))

# Small and fast on a CPU: the tiny preset, short windows, no sampling, no progress display,
# a configured peak (no matmul benchmark), a short eval.
FAST = [
    "model.preset=tiny",
    "training.seq_len=32",
    "training.micro_batch=4",
    "training.steps=4",
    "training.eval_sequences=8",
    "training.device=cpu",
    "sample.max_new_tokens=0",
    "metrics.progress=none",
    "metrics.peak_tflops=1",
]


# A Python warning as Python prints it ("file:line: UserWarning: ..." and its source line "warnings.warn(...";
# paratrain's own say "warning:", lowercase)
PYTHON_WARNING = r"\w*Warning: |warnings\.warn"
# What a paratrain command must not print: a Python warning, a tqdm progress bar ("40/40 [00:00<00:00,"), the
# profiler's USDT markers (paratrain/observe/profile.py)
NOISE = PYTHON_WARNING + r"|\d+/\d+ \[\d+:\d+<|^USDT:"


def noise(output: str) -> list[str]:
    """The lines of a command's output that are noise (NOISE)."""
    return [line for line in output.splitlines() if re.search(NOISE, line)]


def pytest_configure(config):
    # paratrain.training.checkpoint silences DCP's "no process group" warning at import; pytest resets warning
    # filters per test, so restate it here (one process is a supported layout, not a mistake).
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled:UserWarning")


# Files whose tests take minutes (the journeys: documented commands as subprocesses), collected first: two pytest
# workers then start on them and end together, instead of one worker running a long journey alone at the end.
LONG_FIRST = ("tests/test_journeys.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # (stable: the rest keeps its order)


@pytest.fixture(scope="session")
def prewarmed():
    """Commands as fresh processes forked from one that imported torch and the trainer (tests/prewarmed.py)."""
    from prewarmed import Prewarmed

    server = Prewarmed()
    yield server
    server.close()


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """The bundled corpus prepared once with the char tokenizer (read-only for the tests)."""
    d = tmp_path_factory.mktemp("data") / "tinyshakespeare-char"
    prepare_dataset(DEFAULT_CORPUS, d, tokenizer="char")
    return d


def fast_overrides(data_dir, out_dir, name: str = "run", *extra: str) -> list[str]:
    """Override strings for a fast run of `name` under out_dir; later entries win. A data folder that holds no
    dataset yet is prepared from the bundled corpus."""
    fresh = not Path(data_dir).is_dir() or not any(Path(data_dir).iterdir())
    source = ["data.source=tinyshakespeare"] if fresh else []
    return [*FAST, *source, f"data.dir={data_dir}", f"run.out_dir={out_dir}", f"run.name={name}", *extra]


def fast_config(data_dir, out_dir, name: str = "run", *extra: str):
    from paratrain.config import load_config

    return load_config(None, fast_overrides(data_dir, out_dir, name, *extra))


@pytest.fixture(scope="session")
def trained_run(char_data, tmp_path_factory):
    """A run folder holding a final checkpoint of a tiny model trained for a few steps."""
    from paratrain.api import train_rank as train

    out = tmp_path_factory.mktemp("runs")
    result = train(fast_config(char_data, out, "trained", "training.steps=3"))
    return result.run_dir


def assert_plan_rejected(data_dir, tmp_path, world: int, overrides: list[str], message: str, micro_batch: int = 1):
    """resolve_run refuses the layout with a one-line ConfigError containing `message`, and writes no run folder."""
    from paratrain.errors import ConfigError
    from paratrain.spec import resolve_run

    cfg = fast_config(data_dir, tmp_path, "bad", f"training.micro_batch={micro_batch}", *overrides)
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, world)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "bad").exists()
