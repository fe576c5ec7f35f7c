"""Load a trained model from a checkpoint folder on one process, for generation."""

from __future__ import annotations

from pathlib import Path

import torch

from paratrain.training.checkpoint import checkpoint_problem, complete_checkpoints, load_trainer_state
from paratrain.data import load_tokenizer
from paratrain.errors import UserError
from paratrain.models import ModelArgs, Transformer


def find_checkpoint(path: str | Path) -> Path:
    """A step-N folder, or a run folder / checkpoints folder (its newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if checkpoint_problem(path) is None:
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise UserError(f"{path} is not a paratrain checkpoint: {checkpoint_problem(path)}")


def load_for_generation(path: str | Path, device: torch.device | None = None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from paratrain.hf.arch import is_hf_folder

    if is_hf_folder(Path(path)) and checkpoint_problem(Path(path)) is not None:  # a Hugging Face model folder
        from paratrain.hf.load import load_hf_model

        model, args, tokenizer = load_hf_model(path, device or "cpu")
        return model, tokenizer, args, args.max_seq_len
    ckpt = find_checkpoint(path)
    state = load_trainer_state(ckpt)
    if "model_args" not in state:
        raise UserError(f"{ckpt}: trainer.pt has no model dimensions")
    args = ModelArgs(**state["model_args"])
    model = Transformer(args).to(device or "cpu")
    sd = {"model": get_model_state_dict(model)}
    try:
        dcp.load(sd, checkpoint_id=str(ckpt))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign checkpoint
        raise UserError(f"{ckpt}: cannot load model weights ({type(e).__name__})") from None
    set_model_state_dict(model, sd["model"])
    # Sample with the context the model was trained on: positions beyond it were never trained.
    context = int(state.get("seq_len", args.max_seq_len))
    return model, load_tokenizer(ckpt), args, context
