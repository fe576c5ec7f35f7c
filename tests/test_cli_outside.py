"""The command line as a user meets it, from outside: `python -m paratrain ...` as processes of their own (new
interpreters for what needs no torch, forks of a warm one for the rest: tests/prewarmed.py). Each command's help
points only to paths that exist, a mistyped option gets the one meant on every command, `.json` corpora are read as
JSON (lines or one array), and a folder that never held a checkpoint says so."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from paratrain.cli import COMMANDS
from paratrain.modes import DP_MODES, PRECISIONS

ROOT = Path(__file__).resolve().parent.parent
# COLUMNS: argparse wraps its help at the terminal's width; a path must not be cut in two
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}
for _var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):  # never look like a launched rank
    ENV.pop(_var, None)
TINY_RUN = ["--model.preset=tiny", "--training.seq_len=32", "--training.micro_batch=2", "--training.eval_sequences=8",
            "--sample.max_new_tokens=8", "--metrics.progress=lines", "--training.device=cpu", "--training.steps=3"]


def fresh(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """A new interpreter: for what runs before torch is imported (help, bad arguments), cheaper than a fork of the
    warm one, and it shows that they import no torch."""
    done = subprocess.run([sys.executable, "-m", "paratrain", *args], cwd=cwd, capture_output=True, text=True,
                          env={**ENV, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return done


def paratrain(prewarmed, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = prewarmed.run([sys.executable, "-m", "paratrain", *args], cwd=cwd, env=ENV, timeout=timeout)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return done


def one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (done.returncode, done.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, str]:
    cwd = tmp_path_factory.mktemp("helps")
    out = {}
    for command in COMMANDS:
        done = fresh(cwd, command, "--help")
        assert done.returncode == 0, (command, done.stderr)
        out[command] = done.stdout
    return out


def test_version(tmp_path):
    done = fresh(tmp_path, "--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (done.returncode, done.stdout, done.stderr) == (0, f"paratrain {version}\n", "")


def test_every_command_names_the_option_a_typo_meant(helps, tmp_path):
    """Each command's longest option (from its --help) with its third letter dropped: one line naming it."""
    for command in COMMANDS:
        options = set(re.findall(r"(?<![\w.-])(--[a-z][a-z0-9-]*)(?![\w.-])", helps[command]))
        meant = max(sorted(options), key=len)
        typo = meant[:3] + meant[4:]
        line = one_error_line(fresh(tmp_path, command, typo))
        assert typo in line and line.endswith(f"(did you mean '{meant}'?)"), (command, line)
    assert os.listdir(tmp_path) == []


# Words with a slash that name no file: modes (`fsdp/zero2`, `bf16/fp16`), and the folders paratrain writes into.
MODE_WORDS = {*DP_MODES, *PRECISIONS}
OUTPUTS = ("runs", "data", "plan")


def test_help_points_only_to_paths_that_exist(helps):
    """A path of the repository in any command's --help (`docs/x.md`, `paratrain/assets/eval_tasks`) exists."""
    checked = []
    for command, text in helps.items():
        for word in re.findall(r"(?<![\w./~-])([a-z][\w.-]*(?:/[\w.-]+)+)", text):
            path = word.rstrip(".,;:")
            parts = path.split("/")
            if parts[0] in OUTPUTS or all(p in MODE_WORDS for p in parts):
                continue
            checked.append(path)
            assert (ROOT / path).exists(), f"paratrain {command} --help names {path}, which does not exist"
    assert "paratrain/assets/eval_tasks" in checked and any(p.startswith("docs/") for p in checked)


# ---------------------------------------------------------------------------- .json corpora

def documents(n: int) -> list[dict]:
    return [{"text": f"Document {i}: " + "to be or not to be, " * (1 + i % 5), "url": f"https://x/{i}", "id": i}
            for i in range(n)]


def test_json_lines_gz_corpus_prepared_and_trained(prewarmed, tmp_path):
    """C4's shape: JSON lines in a .json.gz. Prepared, every line is one document of its text field (not the JSON
    text), and a tiny model trains on it."""
    docs = documents(40)
    (tmp_path / "c4-train.00000-of-01024.json.gz").write_bytes(
        gzip.compress("".join(json.dumps(d) + "\n" for d in docs).encode(), mtime=0))
    done = fresh(tmp_path, "prepare", "--input", "c4-train.00000-of-01024.json.gz", "--out", "c4", "--tokenizer",
                 "byte", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "(36 + 4 documents" in done.stdout, done.stdout
    meta = json.loads((tmp_path / "c4" / "meta.json").read_text())
    text_bytes = sum(len(d["text"].encode()) for d in docs)
    assert meta["train_tokens"] + meta["val_tokens"] == text_bytes + len(docs)  # the texts + an EOS each: no braces
    done = paratrain(prewarmed, tmp_path, "train", "--data.dir=c4", "--run.name=c4", *TINY_RUN, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"val loss \d+\.\d+", done.stdout + done.stderr)


def test_json_array_file_reads_as_its_objects(tmp_path):
    """One JSON array of objects (pretty-printed over many lines) is the same corpus as its JSON lines."""
    docs = documents(20)
    (tmp_path / "array.json").write_text(json.dumps(docs, indent=2))
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    counts = []
    for name in ("array.json", "lines.jsonl"):
        done = fresh(tmp_path, "prepare", "--input", name, "--out", f"from-{name}", "--tokenizer", "byte", "--quiet")
        assert done.returncode == 0, done.stderr
        assert "(18 + 2 documents" in done.stdout, done.stdout
        meta = json.loads((tmp_path / f"from-{name}" / "meta.json").read_text())
        counts.append((meta["train_tokens"], meta["val_tokens"]))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("content, match", [
    ("plain text, not JSON\n", "neither JSON lines nor a JSON array"),
    ('[{"text": "a"},\n {"text": "b"}\n', r"line 3: not a valid JSON array \(the array is not closed"),
    ('[{"text": "a"}] {"text": "b"}', "nothing may follow the array's closing ]"),
    ('{"text": "a"}\n{"text": \n', "line 2: not valid JSON"),
])
def test_a_bad_json_file_is_one_line_and_writes_nothing(tmp_path, content, match):
    (tmp_path / "bad.json").write_text(content)
    line = one_error_line(fresh(tmp_path, "prepare", "--input", "bad.json", "--out", "out"))
    assert re.search(match, line) and "bad.json" in line, line
    assert os.listdir(tmp_path) == ["bad.json"]


# ---------------------------------------------------------------------------- checkpoints

def test_a_folder_that_never_held_a_checkpoint_says_so(prewarmed, tmp_path):
    run = tmp_path / "runs" / "never"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("")
    for args in (["eval", "runs/never", "--tasks", "shakespeare"], ["generate", "--checkpoint", "runs/never"]):
        line = one_error_line(paratrain(prewarmed, tmp_path, *args))
        assert "no checkpoint was ever saved there" in line and "interrupted" not in line, line
    assert os.listdir(run) == ["config.toml"]
