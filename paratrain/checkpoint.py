"""Training-state checkpoints with torch.distributed.checkpoint (DCP).

Layout of a run's checkpoints:  RUN_DIR/checkpoints/step-N/
    *.distcp + .metadata   model and optimizer, sharded as they live on the ranks (DCP), so a
                           checkpoint saved on one layout loads on another
    trainer.pt             step, RNG states, config, model dimensions (weights_only loads it)
    meta.json + tokenizer  the tokenizer, so generation needs nothing but this folder
    COMPLETE               written last; a folder without it was interrupted and is never loaded

A save is written to a hidden temporary folder and renamed into place only after every rank is done.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from paratrain.errors import UserError

MARKER = "COMPLETE"
# DCP warns when used without a process group; one process is a supported layout here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_zero1(optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def model_optim_state(model: nn.Module, optimizer) -> dict:
    """FQN-keyed state that DCP can save and reload on any layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    if _is_zero1(optimizer):
        # ZeRO-1 keeps per-rank partitions that DCP does not understand; its moments are gathered
        # into a plain optimizer state dict on save (see save_checkpoint).
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer, trainer_state: dict, keep: int,
                    is_main: bool, tokenizer=None) -> Path:
    final = ckpt_root / f"step-{step}"
    tmp = ckpt_root / f".step-{step}.tmp"
    if is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    dcp.save(model_optim_state(model, optimizer), checkpoint_id=str(tmp))
    if _is_zero1(optimizer):
        optimizer.consolidate_state_dict(to=0)
    _barrier()
    if is_main:
        if _is_zero1(optimizer):
            torch.save(optimizer.state_dict(), tmp / "zero1_optim.pt")
        torch.save(trainer_state, tmp / "trainer.pt")
        if tokenizer is not None:  # so `paratrain generate` needs nothing but this folder
            tokenizer.save(tmp)
        (tmp / MARKER).write_text(f"{step}\n")
        if final.exists():  # re-saving the same step (e.g. after a rollback): replace atomically-ish
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(ckpt_root, keep)
    _barrier()
    return final


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a loadable checkpoint, or None if it looks complete."""
    if not path.is_dir():
        return "not a folder"
    if not (path / MARKER).exists():
        return f"no {MARKER} marker (save was interrupted)"
    if not (path / ".metadata").exists():
        return "missing DCP .metadata"
    if not (path / "trainer.pt").exists():
        return "missing trainer.pt"
    return None


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if checkpoint_problem(p) is None]


def prune(ckpt_root: Path, keep: int) -> None:
    for old in complete_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str, ckpt_root: Path) -> Path | None:
    """`none` -> None, `auto` -> newest complete checkpoint (None if there is none), else a path that must be valid."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(ckpt_root)
        return found[-1] if found else None
    path = Path(resume)
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"{path} is not a paratrain checkpoint: {problem}")
    return path


def load_trainer_state(path: Path) -> dict:
    try:
        return torch.load(path / "trainer.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise UserError(f"{path}: cannot read trainer.pt ({type(e).__name__})") from None


def load_checkpoint(path: Path, model: nn.Module, optimizer) -> dict:
    """Load model (+ optimizer) in place, whatever layout saved them; returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    trainer_state = load_trainer_state(path)
    state = model_optim_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if "optim" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        if optimizer is not None and _is_zero1(optimizer):
            if not (path / "zero1_optim.pt").exists():
                raise UserError(f"{path} was saved without dp_mode=zero1; resume it with the dp_mode it was saved with")
            optimizer.load_state_dict(torch.load(path / "zero1_optim.pt", weights_only=True))
    return trainer_state
