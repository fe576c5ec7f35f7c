"""What a new user meets first, checked from outside: `make run`'s set-up says each step before it starts (read with
`make -n`, which installs nothing), and the README's `--nproc 4` example trains make run's global batch."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_says_each_setup_step(tmp_path):
    # a virtual environment that does not exist: make plans the whole set-up; -n prints it and runs nothing
    done = subprocess.run(["make", "--no-print-directory", "-n", "run", f"VENV={tmp_path / '.venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if " -m venv " in line or " -m pip install " in line]
    assert len(installs) == 4  # the venv, pip, torch, paratrain
    for n, i in enumerate(installs, 1):
        assert lines[i - 1].startswith(f'echo "setup {n}/4: '), (lines[i - 1], lines[i])  # said before it starts
    assert "torch 2.13.0" in lines[installs[2] - 1]
    for i in installs[1:]:  # pip quiet (-q), yet its warnings and errors reach the terminal
        words = shlex.split(lines[i])
        assert "-q" in words and not {"-qq", "-qqq", "--quiet"} & set(words) and ">" not in lines[i], lines[i]
    assert any(line.startswith('echo "setup done') for line in lines)
    assert lines[-1].split()[1:3] == ["train", "--checkpoint.resume=auto"]  # then the training


def readme_command(run_name: str) -> str:
    """The README's ```bash command that names run `run_name`."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(line for body in blocks for line in body.splitlines() if f"--run.name={run_name}" in line)


def test_readme_fsdp4_is_make_runs_training():
    """'the same training' over 4 ranks: the global batch (sequences per optimizer step) and its accumulation are
    make run's."""
    from paratrain.commands.train import split_overrides
    from paratrain.config import load_config
    from paratrain.layout import Layout
    from paratrain.spec import batch_of

    line = readme_command("fsdp4")
    assert "the same training" in line
    own, overrides = split_overrides(shlex.split(line, comments=True)[2:], {"--nproc"})
    cfg, default = load_config(None, overrides), load_config(None, [])
    layout = Layout.from_config(cfg.parallel, int(own["--nproc"]))
    batch, alone = batch_of(cfg.training, layout)[0], batch_of(default.training, Layout.from_config(default.parallel, 1))[0]
    assert layout.dp == 4 and batch.global_batch == alone.global_batch == 12
    assert layout.accumulation(batch) == 1 and cfg.training.seq_len == default.training.seq_len
