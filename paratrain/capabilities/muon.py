"""Muon (docs/optimizers.md; the optimizer: paratrain/training/muon.py): momentum orthogonalised by a Newton-Schulz
iteration on the blocks' hidden matrices, AdamW on the rest. Here: its `[optimizer]` keys, their checks and its verify
rows (every layout against one process's Muon, at fp32's 1e-5: the iteration runs in fp32 for fp32 runs).

The optimizer's registry entry (what it keeps and what one step costs, for the estimator and the planner) is in
paratrain/optimizers.py with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.capabilities.base import MOE_PRESET, Capability
from paratrain.errors import ConfigError

MUON = "optimizer.name=muon"


@dataclass
class MuonKeys:
    # -- muon (docs/optimizers.md): Muon on the blocks' hidden matrices, AdamW (the keys above) on the rest --
    muon_lr: float | None = None  # Muon's peak learning rate (the same warm-up and decay); unset: optimizer.lr
    muon_momentum: float = 0.95  # the momentum buffer's decay (an EMA of the gradients, as torch.optim.Muon)
    muon_nesterov: bool = True  # orthogonalise the Nesterov look-ahead g + mu (B - g) instead of the buffer B
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update
    muon_ns_a: float = 3.4445  # the quintic iteration's coefficients: X <- a X + (b A + c A^2) X, A = X X^T
    muon_ns_b: float = -4.7750
    muon_ns_c: float = 2.0315
    # the update's scale per matrix shape (A x B): match_rms_adamw 0.2 sqrt(max(A, B)) gives it AdamW's RMS (one
    # learning rate for both parts); original sqrt(max(1, A / B)) (Keller Jordan's); none
    muon_adjust_lr: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    muon_ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the iteration's; auto: float32 for an fp32 run, else bfloat16


@dataclass(frozen=True)
class Muon(Capability):
    """On when optimizer.name = "muon" (`implied_by`); its settings are read by the optimizer's builder from
    `[optimizer]`."""

    name = "muon"
    adds_to = ("optimizer", MuonKeys)
    # against one process's Muon (the hidden matrices orthogonalised whole by one rank, AdamW for the rest)
    verify_rows = {
        "muon-ddp2": (2, "ddp", MUON),
        "muon-zero1x2": (2, "zero1", MUON),
        "muon-fsdp2": (2, "fsdp", MUON),
        "muon-hsdp2x2": (4, "hsdp,rep=2", MUON),
        "muon-tp2": (2, "nodp,tp=2", MUON),
        "muon-fsdp2xtp2": (4, "fsdp,tp=2", MUON),
        "muon-pp2": (2, "nodp,pp=2,sched=1f1b", MUON),
        "muon-ep2": (2, "fsdp,ep=2", MOE_PRESET, MUON),
    }

    @classmethod
    def implied_by(cls, recipe) -> bool:
        return recipe.optimizer == cls.name

    @classmethod
    def check(cls, cfg) -> None:
        o = cfg.optimizer
        if o.name != cls.name:
            return
        if o.muon_ns_steps < 1:
            raise ConfigError(f"optimizer.muon_ns_steps must be >= 1 (Newton-Schulz iterations; 0 would apply the raw "
                              f"momentum, not Muon), got {o.muon_ns_steps}")
        if o.muon_lr is not None and o.muon_lr <= 0:
            raise ConfigError(f"optimizer.muon_lr must be positive, got {o.muon_lr}")
        if not 0 <= o.muon_momentum < 1:
            raise ConfigError(f"optimizer.muon_momentum must be in [0, 1), got {o.muon_momentum}")
        if cfg.lora.rank:
            raise ConfigError("optimizer.name=muon orthogonalises the hidden matrices, which LoRA freezes (its adapters "
                              "are low-rank factors, not hidden matrices): use adamw with lora.rank > 0")
