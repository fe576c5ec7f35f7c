"""A LoRA checkpoint outside its run (generation, export): the adapters it holds, and the frozen base they belong to,
which it does not hold — the Hugging Face folder the run imported, or its preset's weights as initialised from the
run's seed (initialisation is a pure function of (seed, parameter name))."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.capabilities.lora import LoRA
from paratrain.distributed.initialize import init_weights, initial_value
from paratrain.errors import UserError
from paratrain.hf.load import checked_weights, load_hf_weights, read_block
from paratrain.hf.names import param_shapes, pieces_by_param
from paratrain.models import build_model
from paratrain.models.args import ModelArgs
from paratrain.models.lora import apply_lora
from paratrain.models.lora_params import adapters_of
from paratrain.training import safe_dcp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def run_config(state: dict) -> dict:
    """The run's config saved in trainer.pt, as TOML tables ({} when unreadable)."""
    try:
        cfg = tomllib.loads(state.get("config_toml", ""))
    except tomllib.TOMLDecodeError:
        return {}
    return cfg if isinstance(cfg.get("model", {}), dict) and isinstance(cfg.get("training", {}), dict) else {}


def init_folder_of(state: dict) -> Path | None:
    """The Hugging Face folder the run started from (model.init_from), or None."""
    init_from = run_config(state).get("model", {}).get("init_from") or ""
    return Path(init_from[3:]) if isinstance(init_from, str) and init_from.startswith("hf:") else None


@dataclass(frozen=True)
class AdaptedCheckpoint:
    path: Path
    args: ModelArgs
    lora: LoRA
    base: str  # what trainer.pt names it
    hf_folder: Path | None  # the base's Hugging Face folder; None: the preset's seeded weights
    seed: int

    @classmethod
    def of(cls, path: Path, state: dict) -> AdaptedCheckpoint | None:
        """The LoRA checkpoint at `path` (its checked trainer.pt `state`), or None for a checkpoint of every weight."""
        record = state.get("lora")
        if record is None:
            return None
        folder, seed = init_folder_of(state), run_config(state).get("training", {}).get("seed", 1337)
        base = state.get("lora_base", "?")
        if folder is not None and not (folder / "config.json").is_file():
            raise UserError(f"{path} holds LoRA adapters of the base {base}, which is not there any more: the "
                            "adapters need it (put the Hugging Face folder back at that path)")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise UserError(f"{path}: trainer.pt's config has no integer training.seed")
        lora = LoRA(record["rank"], float(record["alpha"]), float(record["dropout"]), tuple(record["targets"]))
        return cls(path, ModelArgs(**state["model_args"]), lora, base, folder, seed)

    @functools.cached_property
    def targets(self) -> dict[str, tuple[str, str]]:
        """Target weight name -> the names of its (lora_a, lora_b)."""
        return {p.name: tuple(a.name for a in adapters_of(p, self.lora)) for p in self.lora.target_weights(self.args)}

    @functools.cached_property
    def adapter_shapes(self) -> dict[str, tuple]:
        """Every adapter's name and shape (what the checkpoint holds of the model)."""
        return {q.name: q.shape for p in self.lora.target_weights(self.args) for q in adapters_of(p, self.lora)}

    def load_adapters(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The adapters `names` as saved (fp32), read in this process alone (no process group)."""
        state = {"model": {n: torch.empty(self.adapter_shapes[n], dtype=torch.float32) for n in names}}
        safe_dcp.load(state, self.path, no_dist=True)
        return state["model"]

    def build(self, device: torch.device | str = "cpu"):
        """The adapted model on one process: the base loaded from its source, the adapters from the checkpoint."""

        with torch.device("meta"):
            model = build_model(self.args)
        apply_lora(model, self.lora)
        model.to_empty(device=device)
        if self.hf_folder is None:
            init_weights(model, self.seed)  # the preset's base (the adapters are replaced below)
        else:
            load_hf_weights(model, self.hf_folder, self.args)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self.load_adapters([n for pair in self.targets.values() for n in pair]).items():
                params[name].copy_(value)
        return model

    @contextlib.contextmanager
    def base_values(self):
        """fn(parameter name) -> the base's whole value of that parameter (its stored dtype)."""
        if self.hf_folder is not None:
            by_param, shapes = pieces_by_param(self.args), param_shapes(self.args)
            with checked_weights(self.hf_folder, self.args).reader() as reader:
                yield lambda name: read_block(reader, by_param[name], [torch.arange(n) for n in shapes[name]])
            return

        with torch.device("meta"):
            stds = build_model(self.args).param_init_std  # only the names' distributions are read
        shapes = param_shapes(self.args)
        yield lambda name: initial_value(name, shapes[name], stds(name), self.seed)

    def merged(self, name: str, base: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """W + scale B A for a target weight (fp32), the base as it is for any other parameter."""
        pair = self.targets.get(name)
        if pair is None:
            return base
        a, b = (adapters[n] for n in pair)
        return base.float() + self.lora.scale * (b @ a)
