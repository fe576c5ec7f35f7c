"""The capability seam (paratrain/capabilities): a capability is one module, and z-loss, the seam's proof, computes
PaLM's penalty, logs it, and trains the same on every layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain import capabilities
from paratrain.capabilities.z_loss import ZLoss
from paratrain.config import load_config
from paratrain.errors import ConfigError
from paratrain.training.step import TokenLoss
from paratrain.verify import CAPABILITY_MATRICES, run_verify

ROOT = Path(__file__).resolve().parents[1]


def test_z_loss_is_palms_penalty():
    """cross-entropy + coefficient x logsumexp(logits)^2 over the target tokens (not the masked ones), for the mean
    and the sum; the step's metric is the penalty's mean per target token."""
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11) * 3, torch.randint(0, 11, (2, 5))
    targets[0, :2] = -100
    loss = TokenLoss([ZLoss(1e-2)], torch.device("cpu"))
    loss.reset()
    loss.recording = True
    kept = targets != -100
    penalty = 1e-2 * torch.logsumexp(logits, -1)[kept].square()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss(logits, targets), ce + penalty.mean())
    torch.testing.assert_close(loss(logits, targets, "sum"), ce * kept.sum() + penalty.sum())
    assert loss.step_stats()()["z_loss"] == pytest.approx(penalty.mean().item(), rel=1e-6)
    plain = TokenLoss([], torch.device("cpu"))
    torch.testing.assert_close(plain(logits, targets), ce)


def test_z_loss_config():
    assert capabilities.active(load_config(None, [])) == ()
    assert capabilities.active(load_config(None, ["--training.z_loss=1e-4"])) == (ZLoss(1e-4),)
    with pytest.raises(ConfigError, match="training.z_loss must be >= 0"):
        load_config(None, ["--training.z_loss=-1"])


def test_z_loss_rows_match_one_process(char_data):
    """The capability's verify rows (fsdp2, tp2 with loss parallel) against one process with the same z-loss."""
    rows, _ = run_verify(CAPABILITY_MATRICES["z_loss"], steps=4, tolerance=1e-5,
                         extra_args=[f"data.dir={char_data}"], echo=lambda line: None)
    assert [r.layout for r in rows if r.passed] == ["z_loss-fsdp2", "z_loss-tp2"], rows


def test_z_loss_is_logged(tmp_path, char_data):
    """`paratrain train --training.z_loss=...`: metrics.jsonl has the penalty on every logged step."""
    run = subprocess.run([sys.executable, "-m", "paratrain", "train", "--training.steps=2", "--training.log_every=1",
                          "--model.preset=tiny",
                          "--training.seq_len=32", "--training.micro_batch=2", "--training.z_loss=1e-3",
                          f"--data.dir={char_data}", f"--run.out_dir={tmp_path}", "--sample.max_new_tokens=0",
                          "--training.eval_every=0", "--checkpoint.save_final=false", "--metrics.progress=none"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["z_loss"] for r in records if "loss" in r]
    assert len(logged) == 2 and all(0 < z < 1 for z in logged), records


def test_a_capability_is_named_in_its_module_and_its_registration_only():
    """z-loss, added through the seam: its name appears in its module and the registry, nowhere else in the package
    (the trainer, the estimator, the planner and verify iterate over the registered capabilities)."""
    found = subprocess.run(["grep", "-rliE", "z_loss", "paratrain", "--include=*.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    assert sorted(found) == ["paratrain/capabilities/__init__.py", "paratrain/capabilities/z_loss.py"]
