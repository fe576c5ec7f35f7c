"""Export: a paratrain checkpoint (DCP, any layout) -> a Hugging Face model folder.

    paratrain export RUN_DIR|step-N --format hf --out DIR [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]

One process and no process group, whatever layout saved the checkpoint (fsdp, tp, pp, ep): DCP reads one whole
parameter at a time from the checkpoint's shard files; it is renamed (experts unstacked and transposed for
Mixtral), trimmed to the tokenizer's vocabulary, cast, and kept until its output file is written. Peak memory
follows --max-shard-size, not the model: one output file's tensors, the bytes safetensors serialises them into,
and one parameter in the checkpoint's dtype (a 393 MiB model: +102 MiB with 50MB files, +285 MiB as one bf16 file).
Written into a hidden folder beside --out and renamed into place at the end, so a failure writes nothing.
With `checkpoint.export_hf = true` the trainer does the same at the end of training, the ranks writing
different output shards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.errors import UserError
from paratrain.files import atomic_dir, replace_dir
from paratrain.training import safe_dcp
from paratrain.training.adapters import AdaptedCheckpoint, init_folder_of, run_config

from paratrain.data import load_tokenizer
from paratrain.distributed.tensors import torch_dtype
from paratrain.hf.arch import hf_config_from_args
from paratrain.hf.files import INDEX, SINGLE
from paratrain.hf.names import Piece, param_shapes, pieces
from paratrain.hf.tokenizer import special_tokens, write_tokenizer
from paratrain.models.args import ModelArgs
from paratrain.modes import WEIGHT_DTYPES
from paratrain.preflight import check_export_out
from paratrain.training.checkpoint import load_trainer_state

SOURCE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                "vocab.json", "merges.txt")  # the slow tokenizer's files (Qwen ships them beside tokenizer.json)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' (10^9, as transformers counts), '2GiB', '500MB', or bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"--max-shard-size: cannot read '{text}' (e.g. 5GB, 500MB, 2GiB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise UserError("--max-shard-size must be positive")
    return size


@dataclass
class ExportPlan:
    ckpt: Path
    args: ModelArgs
    dtype: str
    vocab: int  # vocabulary rows written (the tokenizer's, or the imported model's)
    shards: list[list[Piece]]
    config: dict
    tokenizer: object
    source: Path | None  # the Hugging Face folder the run started from, if it is there with the same tokenizer
    saved_dtypes: dict  # parameter name -> dtype in the checkpoint
    adapted: AdaptedCheckpoint | None = None  # a LoRA checkpoint: its adapters merged into its base

    @property
    def files(self) -> list[str]:
        n = len(self.shards)
        return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _source_tokenizer_matches(source: Path, tokenizer) -> bool:
    """The imported folder's tokenizer is the one the run trained with (then its files are copied as they are)."""
    import tokenizers as hf

    if not hasattr(tokenizer, "tok") or not (source / "tokenizer.json").is_file():
        return False
    try:
        return hf.Tokenizer.from_file(str(source / "tokenizer.json")).to_str() == tokenizer.tok.to_str()
    except Exception:  # noqa: BLE001 - an unreadable file is simply not the same tokenizer
        return False


def _source_folder(ckpt: Path) -> Path | None:
    """The Hugging Face folder an imported model came from (its tokenizer files are copied), or None."""
    try:
        return init_folder_of(load_trainer_state(ckpt))
    except UserError:
        return None


def plan_export(ckpt: Path, dtype: str = "bf16", max_shard_bytes: int = 5 * 10**9) -> ExportPlan:
    """Everything checked and decided before a byte is written."""


    if dtype not in WEIGHT_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}, got '{dtype}'")
    state = load_trainer_state(ckpt)
    if "model_args" not in state:
        raise UserError(f"{ckpt}: trainer.pt has no model dimensions")
    args = ModelArgs(**state["model_args"])
    adapted = AdaptedCheckpoint.of(ckpt, state)  # LoRA: the base from its source, merged with the adapters
    model_cfg = run_config(state).get("model", {})
    init_from = model_cfg.get("init_from") or ""
    source = Path(init_from[3:]) if init_from.startswith("hf:") else None
    tokenizer = load_tokenizer(ckpt)
    if tokenizer.vocab_size > args.vocab_size:
        raise UserError(f"{ckpt}: the tokenizer has {tokenizer.vocab_size} ids but the model only {args.vocab_size}")
    # paratrain pads a vocabulary it chose (to a multiple of 64, for tensor parallelism): those rows are never
    # trained targets, so they are cut and generation cannot emit an id the tokenizer lacks. An imported
    # model keeps the vocabulary it came with.
    vocab = args.vocab_size if source is not None else tokenizer.vocab_size
    specials = special_tokens(tokenizer)
    bos = specials.get("bos", (None,))[0]
    eos = specials.get("eos", (None,))[0]
    source_cfg = {}
    if source is not None and (source / "config.json").is_file() and _source_tokenizer_matches(source, tokenizer):
        try:
            source_cfg = json.loads((source / "config.json").read_text())
        except ValueError:
            source_cfg = {}
        bos, eos = source_cfg.get("bos_token_id", bos), source_cfg.get("eos_token_id", eos)
    else:
        source = None
    config = hf_config_from_args(args, vocab, dtype, bos, eos, name=f"model {model_cfg.get('preset', '')} in {ckpt}")

    try:
        metadata = safe_dcp.read_metadata(ckpt).state_dict_metadata
    except safe_dcp.MetadataProblem as e:
        raise UserError(f"{ckpt}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is a user-facing problem
        raise UserError(f"{ckpt}: unreadable DCP metadata ({type(e).__name__})") from None
    all_pieces = pieces(args, vocab)
    saved_dtypes = {}
    saved = param_shapes(args) if adapted is None else adapted.adapter_shapes
    for param, want in saved.items():
        entry = metadata.get(f"model.{param}")
        if entry is None or tuple(getattr(entry, "size", ())) != tuple(want):
            raise UserError(f"{ckpt}: the checkpoint has no model.{param} of shape {list(want)}")
        saved_dtypes[param] = entry.properties.dtype

    itemsize = torch_dtype(dtype).itemsize
    shards: list[list[Piece]] = [[]]
    size = 0
    for piece in all_pieces:
        n = itemsize * _numel(piece.shape)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += n
    return ExportPlan(ckpt, args, dtype, vocab, shards, config, tokenizer, source, saved_dtypes, adapted)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _checkpoint_reader(ckpt: Path):
    """A DCP reader that parses the checkpoint's metadata once (with the allow-list) for the many loads of an
    export."""
    return safe_dcp.reader(ckpt)


def _load_param(plan: ExportPlan, reader, name: str) -> torch.Tensor:
    """One whole parameter from the DCP checkpoint, read in this process alone (no collectives, even inside a
    training job): DCP assembles it from the shards of whatever layout saved it."""
    state = {"model": {name: torch.empty(param_shapes(plan.args)[name], dtype=plan.saved_dtypes[name])}}
    safe_dcp.load(state, plan.ckpt, storage_reader=reader, no_dist=True)
    return state["model"][name]


def _hf_tensor(piece: Piece, source: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    t = source if piece.expert is None else source[piece.expert].T
    if piece.vocab:
        t = t[:vocab]
    return t.to(dtype).contiguous()


@contextlib.contextmanager
def _parameters(plan: ExportPlan, reader, names: list[str]):
    """fn(name) -> a parameter's whole value: from the checkpoint, or for LoRA its base merged with its adapters."""
    if plan.adapted is None:
        yield lambda name: _load_param(plan, reader, name)
        return
    adapted = plan.adapted
    adapters = adapted.load_adapters([n for name in names for n in adapted.targets.get(name, ())])
    with adapted.base_values() as base:
        yield lambda name: adapted.merged(name, base(name), adapters)


def write_shard(plan: ExportPlan, index: int, folder: Path, reader=None) -> None:
    """One output file. Parameters are loaded one at a time and dropped once converted, so memory is this
    file's tensors plus one parameter (a tensor split over two files is loaded by both)."""
    from safetensors.torch import save_file

    reader = reader or _checkpoint_reader(plan.ckpt)
    shard, tensors, dtype = plan.shards[index], {}, torch_dtype(plan.dtype)
    names = list(dict.fromkeys(p.param for p in shard))
    with _parameters(plan, reader, names) as value:
        for name in names:
            source = value(name)
            tensors.update({p.hf: _hf_tensor(p, source, plan.vocab, dtype) for p in shard if p.param == name})
            del source
    path = folder / plan.files[index]
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    os.chmod(path, 0o644)


def write_metadata(plan: ExportPlan, folder: Path) -> None:
    """config.json, generation_config.json, tokenizer files and (when sharded) the safetensors index."""
    _write_json(folder / "config.json", plan.config)
    if plan.source is not None:  # the imported model's own tokenizer files, byte for byte
        shutil.copyfile(plan.source / "tokenizer.json", folder / "tokenizer.json")
        for name in SOURCE_FILES:
            if (plan.source / name).is_file():
                shutil.copyfile(plan.source / name, folder / name)
    else:
        write_tokenizer(plan.tokenizer, folder, plan.args.max_seq_len)
    if not (folder / "generation_config.json").exists():
        generation = {k: plan.config[k] for k in ("bos_token_id", "eos_token_id") if plan.config.get(k) is not None}
        _write_json(folder / "generation_config.json", generation)
    if len(plan.shards) > 1:
        itemsize = torch_dtype(plan.dtype).itemsize
        total = sum(itemsize * _numel(p.shape) for shard in plan.shards for p in shard)
        weight_map = {p.hf: plan.files[i] for i, shard in enumerate(plan.shards) for p in shard}
        _write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for f in folder.iterdir():
        os.chmod(f, 0o644)
    os.chmod(folder, 0o755)


def export_hf(ckpt: Path, out: Path, dtype: str = "bf16", max_shard_bytes: int = 5 * 10**9,
              overwrite: bool = False) -> ExportPlan:
    """Export in this process; `out` appears complete or not at all."""
    out = Path(out)
    check_export_out(out, [("the checkpoint it reads", ckpt), ("the model folder it copies the tokenizer from",
                                                               _source_folder(ckpt))], overwrite)
    plan = plan_export(ckpt, dtype, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-")), out) as tmp:
        reader = _checkpoint_reader(ckpt)
        for i in range(len(plan.shards)):
            write_shard(plan, i, tmp, reader)
        write_metadata(plan, tmp)
    return plan


def export_at_end(ckpt: Path, out: Path, dtype: str, rank: int, world: int) -> Path:
    """`checkpoint.export_hf`: every rank of the finished training job writes every world-th output shard of
    the final checkpoint; rank 0 writes the rest and renames the folder into place."""
    def barrier():
        if dist.is_initialized():
            dist.barrier()

    plan = plan_export(ckpt, dtype)
    tmp = out.parent / f".{out.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    reader = _checkpoint_reader(ckpt)
    for i in range(rank, len(plan.shards), world):
        write_shard(plan, i, tmp, reader)
    barrier()
    if rank == 0:
        write_metadata(plan, tmp)
        replace_dir(tmp, out)
    barrier()
    return out


def export_final(run_dir: Path, step: int, dtype: str, rank: int, world: int) -> Path:
    """`checkpoint.export_hf`: the checkpoint of step `step` as RUN_DIR/hf (every rank calls this)."""
    return export_at_end(run_dir / "checkpoints" / f"step-{step}", run_dir / "hf", dtype, rank, world)
