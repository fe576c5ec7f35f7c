"""Import: a Hugging Face folder's weights straight into a model on any layout.

`load_hf_weights` runs after the model is parallelised and materialised: for each parameter (plain tensor or
DTensor) it works out which global rows and columns this rank holds and reads only those from the
safetensors files, so no rank ever holds more than its own shard (plus one block per read).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from paratrain.data.tokenizers import HFTokenizer
from paratrain.distributed.initialize import canonical_name
from paratrain.errors import UserError
from paratrain.hf.arch import args_from_hf_config, read_hf_config
from paratrain.hf.files import HFWeights
from paratrain.hf.names import IGNORED_SUFFIXES, pieces, pieces_by_param
from paratrain.models import build_model
from paratrain.models.args import ModelArgs
from paratrain.models.lora_params import is_adapter


def hf_model_args(folder: str | Path) -> ModelArgs:
    folder = Path(folder)
    return args_from_hf_config(read_hf_config(folder), where=str(folder / "config.json"))


def checked_weights(folder: str | Path, args: ModelArgs) -> HFWeights:
    """The folder's tensors, checked against what `args` implies (names, shapes, float dtypes)."""
    weights = HFWeights(folder)
    expected = {p.hf: p.shape for p in pieces(args)}
    # Some tied checkpoints also store lm_head.weight (a copy of the embedding); it is not read.
    weights.check(expected, ignore=IGNORED_SUFFIXES, optional=("lm_head.weight",) if args.tie_embeddings else ())
    return weights


def _shards_dim(placement, dim: int) -> bool:
    # Shard and _StridedShard (FSDP over tensor parallel) both carry `dim`; only they split a dimension.
    return (placement.is_shard() or hasattr(placement, "split_factor")) and placement.dim == dim


def _on_dim0(placement):
    if hasattr(placement, "split_factor"):
        return type(placement)(0, split_factor=placement.split_factor)
    return type(placement)(0)


def local_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """For each dimension, the sorted global indices this rank holds of `param` (a DTensor's local shard,
    everything for a plain tensor). Computed by laying out an index vector along each dimension with that
    dimension's placements: the same split as the parameter itself, without communication."""
    if not isinstance(param, DTensor):
        return [torch.arange(n) for n in param.shape]
    out = []
    for d, n in enumerate(param.shape):
        placements = [_on_dim0(p) if _shards_dim(p, d) else Replicate() for p in param.placements]
        if all(isinstance(p, Replicate) for p in placements):
            out.append(torch.arange(n))
            continue
        ids = torch.arange(n, device=param.to_local().device)
        out.append(distribute_tensor(ids, param.device_mesh, placements, src_data_rank=None).to_local().cpu())
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path, args: ModelArgs) -> None:
    """Fill every parameter of `model` (any layout: plain, FSDP, tensor/expert parallel DTensors, a pipeline
    stage) from the Hugging Face folder, each rank reading only its shards."""
    weights = checked_weights(folder, args)
    by_param = pieces_by_param(args)
    seen: set[int] = set()
    with weights.reader() as reader:
        for raw_name, param in model.named_parameters():
            name = canonical_name(raw_name)
            if id(param) in seen or is_adapter(name):  # a tied output weight is the embedding; LoRA's are not here
                continue
            seen.add(id(param))
            local = param.to_local() if isinstance(param, DTensor) else param
            index = local_indices(param)
            if local.numel() == 0:
                continue
            block = read_block(reader, by_param[name], index)
            if block.shape != local.shape:
                raise RuntimeError(f"{raw_name}: read {tuple(block.shape)} for a local shard of {tuple(local.shape)}")
            local.copy_(block)
        if hasattr(model, "reset_buffers"):
            model.reset_buffers()
        for raw_name, buffer in model.named_buffers():  # the learned ones (`hf_buffers`), after the derived are reset
            parts = by_param.get(canonical_name(raw_name))
            if parts is not None:
                buffer.copy_(read_block(reader, parts, local_indices(buffer)))


def read_block(reader, parts, index: list[torch.Tensor]) -> torch.Tensor:
    """Rows and columns `index` (one sorted index per dimension) of the paratrain parameter made of the Hugging Face
    tensors `parts` (its `Piece`s)."""
    if parts[0].expert is None:
        return reader.read(parts[0].hf, index)
    # stacked experts: w[e] is Mixtral's expert e transposed
    return torch.stack([reader.read(parts[e].hf, [index[2], index[1]]).T for e in index[0].tolist()])


def load_hf_model(folder: str | Path, device: str | torch.device = "cpu") -> tuple:
    """(Transformer, ModelArgs, tokenizer) from a Hugging Face folder, on one process (generation, tests)."""

    folder = Path(folder)
    args = hf_model_args(folder)
    checked_weights(folder, args)  # before allocating the model
    tokenizer = HFTokenizer.from_file(hf_tokenizer_file(folder))
    check_tokenizer_fits(tokenizer, args, hf_tokenizer_file(folder))
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    load_hf_weights(model, folder, args)
    return model, args, tokenizer


def check_tokenizer_fits(tokenizer, args: ModelArgs, where: Path) -> None:
    """Every id the tokenizer can produce has a row in the model's embedding (config.json's vocab_size)."""
    if tokenizer.vocab_size > args.vocab_size:
        top = tokenizer.vocab_size - 1
        name = tokenizer.tok.id_to_token(top) if hasattr(tokenizer, "tok") else None
        raise UserError(f"{where}: the tokenizer has id {top}{f' ({name})' if name else ''}, beyond config.json's "
                        f"vocab_size {args.vocab_size}: the model has no embedding row for it (a special token added "
                        "after the model was made?)")


def hf_tokenizer_file(folder: str | Path) -> Path:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json (paratrain reads the fast-tokenizer file that "
                        "transformers writes with save_pretrained)")
    return path
