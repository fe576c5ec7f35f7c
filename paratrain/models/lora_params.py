"""LoRA adapters without torch: which projections get one, and the adapted model's parameter table.

A target is a block's matmul weight of a column- or row-parallel projection whose module is named in the targets
(wq, wk, wv, wo, w1, w2, w3; routed experts never). Its adapter is two parameters beside the weight, on the same
module: `lora_a` (rank, in) and `lora_b` (out, rank), used as W x + (alpha / rank) B A x. They split with their
weight under tensor parallelism: beside a column-parallel weight B splits its rows and A is whole; beside a
row-parallel one A splits its columns and B is whole (so `lora_a`/`lora_b` take the roles "replicated"/"colwise"
or "rowwise"/"replicated"). The estimator and the planner read `adapted_params`; the trainer builds the adapters
with `paratrain.models.lora.apply_lora` from the same targets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.models.args import ModelArgs, is_int, is_number
from paratrain.models.family import Param

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
MAX_RANK = 1 << 16


@dataclass(frozen=True)
class LoRA:
    """The `[lora]` section as the trainer, the estimator and the planner use it (hashable: tables are cached)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section) -> LoRA | None:
        """The adapters `[lora]` asks for, or None (rank 0: every weight trains)."""
        if not section.rank:
            return None
        return cls(section.rank, float(section.alpha), float(section.dropout), target_names(section.targets))

    def record(self) -> dict:
        """What a checkpoint's trainer.pt keeps of it."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


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


def is_adapter(name: str) -> bool:
    """A LoRA adapter's parameter name (what a LoRA checkpoint holds)."""
    return name.endswith(ADAPTER_SUFFIXES)


def is_target(p: Param, lora: LoRA) -> bool:
    return (p.layer is not None and p.matmul and p.role in ("colwise", "rowwise") and p.name.endswith(".weight")
            and p.module.rsplit(".", 1)[-1] in lora.targets)


def adapters_of(p: Param, lora: LoRA) -> tuple[Param, Param]:
    """The adapter of target weight `p`: (lora_a, lora_b), with the tensor-parallel roles that split them with it."""
    out_features, in_features = p.shape
    prefix = p.name[: -len("weight")]
    colwise = p.role == "colwise"
    a = Param(prefix + "lora_a", (lora.rank, in_features), "replicated" if colwise else "rowwise", p.layer, matmul=True)
    b = Param(prefix + "lora_b", (out_features, lora.rank), "colwise" if colwise else "replicated", p.layer,
              matmul=True)
    return a, b


def adapted_params(table, lora: LoRA | None) -> list[Param]:
    """The parameter table of the model with adapters: every base parameter frozen, each adapter after its module's
    parameters (`named_parameters()` order). lora None: the table as it is."""
    table = list(table)
    if lora is None:
        return table
    out: list[Param] = []
    for k, p in enumerate(table):
        out.append(replace(p, trainable=False))
        module = p.name.rsplit(".", 1)[0]
        last_of_module = k + 1 == len(table) or table[k + 1].name.rsplit(".", 1)[0] != module
        if last_of_module:
            weight = next((q for q in table[max(0, k - 1):k + 1] if q.name == module + ".weight"), None)
            if weight is not None and is_target(weight, lora):
                out += adapters_of(weight, lora)
    return out


def adapter_init_std(name: str) -> float:
    """LoRA's initialisation: A drawn like the other matmul weights, B zero, so the adapted model starts as the base."""
    return 0.0 if name.endswith(".lora_b") else 0.02


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
