"""LoRA (`[lora]`, Hu et al. 2021): low-rank adapters on a frozen model. Rank r > 0 freezes every weight (no
gradients, no optimizer state) and trains W + (alpha / r) B A on each target projection of every block, with
dropout on the adapters' input.

Here: the `[lora]` section and its checks, the run's value (`LoRA`: the trainer, the estimator and the planner take
it; a Recipe holds it as `Recipe.lora`, and so among its capabilities), its hooks into the step and its verify rows.
On the step, `before_parallelize` puts the adapters on the plain model (or pipeline stage) and freezes the rest,
stored in the compute dtype under bf16/fp16 (it never changes: no fp32 master copy), and `around_tensor_parallel`
takes the adapters off their projections while tensor parallelism lays the blocks out, then puts them back split
with the weights they adapt and freezes the base again (the styles that replicate make new Parameters).

Elsewhere, where the adapters themselves are read or written: the torch modules (`models/lora.py`: `LoRALinear`,
`apply_lora`) and the parameter table with adapters (`models/lora_params.py`, which the estimator and the planner
read: the models layer cannot import this one); a LoRA checkpoint of adapters only (`training/checkpoint.py`), its
base outside the run (`training/adapters.py`), and its exports (merged into the base: `training/export.py`; a PEFT
adapter folder: `training/peft_export.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from paratrain.capabilities.base import Capability, SectionFlag
from paratrain.errors import ConfigError
from paratrain.models.args import ModelArgs, is_int, is_number
from paratrain.models.family import Param
from paratrain.models.lora_params import adapted_params, is_target
from paratrain.models.presets import count_params, format_params
from paratrain.models.registry import parameters
from paratrain.modes import Precision

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
MAX_RANK = 1 << 16
ROW = "lora.rank=4"  # verify: adapters on every projection of the tiny model, its weights frozen


@dataclass
class LoRAConfig:
    """Low-rank adapters: rank 0 trains every weight; rank r > 0 freezes the model (no gradients, no optimizer state)
    and trains W + (alpha / r) B A on each target projection of every block (A: r x in, B: out x r, B starting at
    zero), with dropout on the adapters' input. Targets: the blocks' projections by name (wq, wk, wv, wo of the
    attention, w1, w2, w3 of the MLP and of shared experts; routed experts are not adapted)."""

    rank: int = 0  # 0: every weight trains
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    targets: str = "wq,wk,wv,wo,w1,w2,w3"  # the projections adapted, comma-separated


def target_names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t.strip() for t in str(text).split(",") if t.strip()))


def lora_problem(section) -> str | None:
    """What is wrong with a `[lora]` section, naming the key, or None."""
    if not 0 <= section.rank <= MAX_RANK:
        return f"lora.rank must be from 0 (off) to {MAX_RANK}, got {section.rank}"
    if not section.alpha > 0:
        return f"lora.alpha must be positive, got {section.alpha}"
    if not 0 <= section.dropout < 1:
        return f"lora.dropout must be in [0, 1), got {section.dropout}"
    names = target_names(section.targets)
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        return (f"lora.targets names {unknown[0]!r}, not a projection of a block" if unknown else
                "lora.targets is empty") + f" (choose from {', '.join(TARGETS)})"
    return None


def record_problem(record) -> str | None:
    """What is wrong with a checkpoint's LoRA record (`LoRA.record`, from a file), naming the field, or None."""
    from types import SimpleNamespace

    if not isinstance(record, dict) or set(record) != {"rank", "alpha", "dropout", "targets"}:
        return "must hold rank, alpha, dropout and targets"
    if not is_int(record["rank"]) or not all(is_number(record[k]) for k in ("alpha", "dropout")):
        return "rank must be an integer, alpha and dropout numbers"
    targets = record["targets"]
    if not isinstance(targets, list) or not all(isinstance(t, str) and "," not in t for t in targets):
        return "targets must be a list of projection names"
    why = lora_problem(SimpleNamespace(**{**record, "targets": ",".join(targets)}))
    return why.removeprefix("lora.") if why else (None if record["rank"] > 0 else "rank must be positive")


@dataclass(frozen=True)
class LoRA(Capability):
    """The `[lora]` section as the trainer, the estimator and the planner use it (hashable: tables are cached)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    name = "lora"
    section = LoRAConfig
    section_after = "parallel"
    recipe_field = "lora"
    section_flags = (
        SectionFlag("--lora-rank", "rank", {
            "estimate": "LoRA adapters of this rank on a frozen model (a config's [lora] otherwise)",
            "plan": "plan LoRA adapters of this rank on a frozen model (default: the --model config's [lora])"}, int),
        SectionFlag("--lora-targets", "targets", {
            "estimate": "the projections LoRA adapts (default wq,wk,wv,wo,w1,w2,w3)"}))
    # adapters trained on a frozen tiny model, against one process training the same adapters; in the sweep of the
    # rows that change the model (paratrain/verify.py)
    verify_matrix = "model"
    verify_rows = {"lora-fsdp2": (2, "fsdp", ROW), "lora-tp2": (2, "nodp,tp=2", ROW),
                   "lora-pp2": (2, "nodp,pp=2,sched=1f1b", ROW)}
    reference_keys = ("lora.",)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_section(cls, section) -> "LoRA | None":
        """The adapters a `[lora]` section asks for, or None (rank 0: every weight trains)."""
        if not section.rank:
            return None
        return cls(section.rank, float(section.alpha), float(section.dropout), target_names(section.targets))

    @classmethod
    def from_config(cls, cfg) -> "LoRA | None":
        return cls.from_section(cfg.lora)

    @classmethod
    def check(cls, cfg) -> None:
        why = lora_problem(cfg.lora)
        if why:
            raise ConfigError(f"lora: {why}")

    @classmethod
    def section_problem(cls, section) -> str | None:
        return lora_problem(section)

    def config_values(self) -> dict:
        return {"lora.rank": self.rank, "lora.alpha": self.alpha, "lora.dropout": self.dropout,
                "lora.targets": ",".join(self.targets)}

    def record(self) -> dict:
        """What a checkpoint's trainer.pt keeps of it."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    def trainable_count(self, args: ModelArgs) -> int:
        """The adapters' parameters on the model of `args` (all that trains)."""
        return sum(p.numel for p in adapted_params(parameters(args), self) if p.trainable)

    def plan_note(self, args) -> str:
        return (f"LoRA rank {self.rank} on {','.join(self.targets)}: {format_params(self.trainable_count(args))} "
                f"trainable, {format_params(count_params(args))} frozen (gradients, their reduction and the "
                "optimizer step: the adapters only)")

    def target_weights(self, args: ModelArgs) -> list[Param]:
        """The target weights of the model, in table order."""
        return [p for p in parameters(args) if is_target(p, self)]

    # -- the training step (torch objects; imports inside) --
    def before_parallelize(self, model, where) -> dict:
        """The adapters on the target projections, every other parameter frozen (stored in the compute dtype under
        bf16/fp16: it never changes)."""
        # lazy: the config checks and the estimator read this module without torch
        import torch

        from paratrain.models.lora import apply_lora

        precision = Precision(where.precision)
        apply_lora(model, self, getattr(torch, precision.dtype_name) if precision.low_precision else None)
        return {}

    @contextlib.contextmanager
    def around_tensor_parallel(self, model, tp_mesh):
        """The adapters come back split with the weights they adapt, the base frozen again (the styles that
        replicate, norms', make new Parameters, trainable ones)."""
        # lazy: the config checks and the estimator read this module without torch
        from paratrain.models.lora import freeze_base

        with adapters_aside(model, tp_mesh):
            yield
        freeze_base(model)


@contextlib.contextmanager
def adapters_aside(model, tp_mesh):
    """Apply a tensor-parallel plan to `model` inside this; its adapters come back split with their weights.

    torch's ColwiseParallel splits every parameter of its Linear on dim 0 and RowwiseParallel only the weight and
    bias, so the adapters are taken off their projection while the plan is applied and put back as DTensors laid out
    with the weight: beside a column-parallel weight (Shard(0)) B is split by rows and A whole, so B A x comes out
    split like W x; beside a row-parallel one (Shard(1)) A is split by columns and B whole, so B A x is a partial sum
    like W x, reduced by the same output hook."""
    # lazy: the config checks and the estimator read this module without torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from paratrain.models.lora import LoRALinear

    held = [(m, m._parameters.pop("lora_a"), m._parameters.pop("lora_b"))
            for m in model.modules() if isinstance(m, LoRALinear)]
    yield
    for module, a, b in held:
        colwise = module.weight.placements[0] == Shard(0)
        for name, value, placement in (("lora_a", a, Replicate() if colwise else Shard(1)),
                                       ("lora_b", b, Shard(0) if colwise else Replicate())):
            split = distribute_tensor(value.detach(), tp_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=value.requires_grad))
