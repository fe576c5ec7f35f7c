"""Load a trained model from a checkpoint folder on one process, for generation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from paratrain.training import safe_dcp
from paratrain.training.adapters import AdaptedCheckpoint
from paratrain.training.checkpoint import (MARKER, checkpoint_problem, load_trainer_state, newest_valid_checkpoint,
                                           step_folders, step_of)
from paratrain.data import load_tokenizer
from paratrain.errors import UserError, translated
from paratrain.hf.arch import is_hf_folder
from paratrain.hf.load import load_hf_model
from paratrain.models import ModelArgs, build_model


def find_checkpoint(path: str | Path, warn=None) -> Path:
    """A step-N folder (which must pass its checks, checksums included), or a run folder / checkpoints folder: its
    newest intact checkpoint, each newer one skipped with a warning naming the reason."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if (path / MARKER).exists() or step_of(path) >= 0:
        problem = checkpoint_problem(path)
        if problem:
            raise UserError(f"{path} is not a usable paratrain checkpoint: {problem}")
        return path
    for root in (path / "checkpoints", path):
        if step_folders(root):
            found = newest_valid_checkpoint(root, warn)
            if found is None:
                raise UserError(f"{path}: none of its checkpoints is intact (see the warnings above)")
            return found
    if (path / "meta.json").is_file() and any(path.glob("*.bin")):  # (data/prepare.py's index and shards)
        raise UserError(f"{path} is a prepared dataset folder, not a checkpoint: give a run folder (runs/NAME) or "
                        "one of its checkpoints (runs/NAME/checkpoints/step-N)")
    raise UserError(f"{path} is not a paratrain checkpoint: {checkpoint_problem(path)}")


def load_for_generation(path: str | Path, device: torch.device | None = None, notice=None):
    """(model, tokenizer, model args, context) from a checkpoint, a run folder or a Hugging Face model folder;
    `notice(text)` is told which checkpoint and step (a run folder: its newest intact one)."""
    notice = notice or (lambda text: None)
    if is_hf_folder(Path(path)) and checkpoint_problem(Path(path)) is not None:  # a Hugging Face model folder
        notice(f"sampling from {path} (a Hugging Face model folder)")
        model, args, tokenizer = load_hf_model(path, device or "cpu")
        return model, tokenizer, args, args.max_seq_len
    ckpt = find_checkpoint(path)
    state = load_trainer_state(ckpt)
    notice(f"sampling from {ckpt} (step {state['step']})")
    if "model_args" not in state:
        raise UserError(f"{ckpt}: trainer.pt has no model dimensions")
    args = ModelArgs(**state["model_args"])

    def unloadable(error: BaseException) -> UserError:  # a foreign or damaged checkpoint
        if isinstance(error, safe_dcp.MetadataProblem):
            return UserError(f"{ckpt}: {error}")
        return UserError(f"{ckpt}: cannot load model weights ({type(error).__name__})")

    adapted = AdaptedCheckpoint.of(ckpt, state)
    with translated(unloadable):
        if adapted is not None:  # LoRA: its base from its source, its adapters from the checkpoint
            model = adapted.build(device or "cpu")
        else:
            model = build_model(args).to(device or "cpu")
            sd = {"model": get_model_state_dict(model)}
            safe_dcp.load(sd, ckpt)
            set_model_state_dict(model, sd["model"])
    # Sample with the context the model was trained on: positions beyond it were never trained.
    context = int(state.get("seq_len", args.max_seq_len))
    return model, load_tokenizer(ckpt), args, context
