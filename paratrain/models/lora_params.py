"""LoRA adapters without torch: which projections get one, and the adapted model's parameter table (the run's
settings, `LoRA`, and its checks are the capability's: paratrain/capabilities/lora.py; the models layer takes the
value and imports nothing of it).

A target is a block's matmul weight of a column- or row-parallel projection whose module is named in the targets
(wq, wk, wv, wo, w1, w2, w3; routed experts never). Its adapter is two parameters beside the weight, on the same
module: `lora_a` (rank, in) and `lora_b` (out, rank), used as W x + (alpha / rank) B A x. They split with their
weight under tensor parallelism: beside a column-parallel weight B splits its rows and A is whole; beside a
row-parallel one A splits its columns and B is whole (so `lora_a`/`lora_b` take the roles "replicated"/"colwise"
or "rowwise"/"replicated"). The estimator and the planner read `adapted_params`; the trainer builds the adapters
with `paratrain.models.lora.apply_lora` from the same targets (`LoRA.target_weights`).
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.models.family import Param

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


def is_adapter(name: str) -> bool:
    """A LoRA adapter's parameter name (what a LoRA checkpoint holds)."""
    return name.endswith(ADAPTER_SUFFIXES)


def is_target(p: Param, lora) -> bool:
    return (p.layer is not None and p.matmul and p.role in ("colwise", "rowwise") and p.name.endswith(".weight")
            and p.module.rsplit(".", 1)[-1] in lora.targets)


def adapters_of(p: Param, lora) -> tuple[Param, Param]:
    """The adapter of target weight `p`: (lora_a, lora_b), with the tensor-parallel roles that split them with it."""
    out_features, in_features = p.shape
    prefix = p.name[: -len("weight")]
    colwise = p.role == "colwise"
    a = Param(prefix + "lora_a", (lora.rank, in_features), "replicated" if colwise else "rowwise", p.layer, matmul=True)
    b = Param(prefix + "lora_b", (out_features, lora.rank), "colwise" if colwise else "replicated", p.layer,
              matmul=True)
    return a, b


def adapted_params(table, lora) -> list[Param]:
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
