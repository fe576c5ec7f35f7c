"""Muon (docs/optimizers.md; the optimizer: paratrain/training/muon.py): momentum orthogonalised by a Newton-Schulz
iteration on the blocks' hidden matrices, AdamW on the rest. Here: its `[optimizer]` keys, their checks, its verify
rows (every layout against one process's Muon, at fp32's 1e-5: the iteration runs in fp32 for fp32 runs), and what
its step holds and costs beside AdamW's (`optimizer_temporaries`, `optimizer_step_s`: the estimator's and the
planner's terms).

Its optimizer-table entry (`ENTRY`: what it keeps and what one step reads and writes) is registered with the
capability (`Capability.optimizers`); its builder is paratrain/training/muon.py's `build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from paratrain.capabilities.base import MOE_PRESET, Capability
from paratrain.errors import ConfigError
from paratrain.capabilities.grad_compression import Compression
from paratrain.modes import Precision
from paratrain.optimizers import FP32, OptimizerEntry

MUON = "optimizer.name=muon"
REDISTRIBUTION = "Muon redistribution"  # the plan's exposed term: the hidden updates to whole matrices and back


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


def _one_bit_gradients(method: str, key: str) -> str | None:
    if not Compression(method).one_bit:
        return None
    return (f"orthogonalises the averaged gradients' momentum, and {key}={method} sends one bit per element (their "
            "signs, with error feedback): the singular values Newton-Schulz normalises are the compressor's, not the "
            "gradients'; use none, bf16 or powersgd")


# One momentum per hidden matrix, orthogonalised whole by one rank; AdamW's state and step for the rest. A hidden
# update reads and writes the parameter, the gradient, the momentum and the Nesterov update (4 tensors), then the
# Newton-Schulz iteration's matmuls (`ns_flops`, the planner's `optimizer_step_s`).
ENTRY = OptimizerEntry(
    "muon", "Muon (momentum orthogonalised by Newton-Schulz, as torch.optim.Muon) on the blocks' hidden matrices, "
    "AdamW on the rest; each matrix orthogonalised whole by one rank",
    param_state=("exp_avg", "exp_avg_sq"), scalar_state=("step",), step_tensors=4, step_kernels=24,
    foreach_temporary=True, hidden_state=("momentum_buffer",), hidden_step_tensors=4,
    refuses_compression=_one_bit_gradients)


def ns_flops(shape: tuple[int, ...], steps: int = MuonKeys.muon_ns_steps) -> float:
    """FLOPs of the Newton-Schulz iteration on one hidden matrix (per expert for a stack): each step X X^T (s x s
    from s x l), the quintic's A^2 (s^3) and (bA + cA^2) X (s x s times s x l), s <= l the matrix's sides. The
    planner costs the default iteration (optimizer.muon_ns_steps' default)."""
    *experts, rows, cols = shape
    small, large = min(rows, cols), max(rows, cols)
    return math.prod(experts) * steps * 2 * small * small * (2 * large + small)


@dataclass(frozen=True)
class Muon(Capability):
    """On when optimizer.name = "muon" (`implied_by`); its settings are read by the optimizer's builder from
    `[optimizer]`."""

    name = "muon"
    adds_to = ("optimizer", MuonKeys)
    optimizers = (ENTRY,)
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
        return recipe.optimizer == ENTRY.name

    @classmethod
    def check(cls, cfg) -> None:
        o = cfg.optimizer
        if o.name != ENTRY.name:
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

    def optimizer_temporaries(self, params, layout, reduced_grad_bytes, gloo: bool) -> int:
        """What its step holds beside the states (paratrain/training/muon.py), at its largest batch (the hidden
        matrices of one shape): their updates (the Nesterov look-ahead; this rank's shards), and either their results
        (orthogonalised here: one process, ZeRO-1) or the stack of the updates, the whole matrices this rank
        orthogonalises (its share of the stack: input and result) and the stack brought back; plus the iteration's
        own matrices (X, its Gram and the quintic's update, for one matrix). On gloo (a CPU) DTensor's all-to-all is
        an all-gather and a slice: the share in flight is the whole stack."""
        shapes: dict = {}
        for p in params:
            if p.hidden_matrix and p.trainable:
                shapes.setdefault(p.shape, []).append(p)
        if not shapes:
            return 0
        group = max(shapes.values(), key=lambda ps: reduced_grad_bytes(ps))
        mine = reduced_grad_bytes(group)
        rows, cols = group[0].shape[-2:]
        small, large = min(rows, cols), max(rows, cols)
        iteration = (2 * small * large + 2 * small * small) * FP32
        holders = max(1, layout.world_size // layout.pp)
        if holders == 1 or layout.zero1:
            return 2 * mine + iteration
        whole = len(group) * math.prod(group[0].shape) * FP32
        share = whole if gloo else math.ceil(len(group) / holders) * math.prod(group[0].shape) * FP32
        return 3 * mine + 2 * share + iteration

    def optimizer_step_s(self, step) -> tuple[float, dict[str, float]]:
        """(iteration seconds, {REDISTRIBUTION: seconds}) of one step on a rank. Every hidden matrix is orthogonalised
        by one rank of the ranks holding it, shared out evenly (paratrain/training/muon.py): a rank iterates 1/world
        of the model's matrices, in fp32 for an fp32 run (at its TF32 rate where on) and bf16 otherwise. Sharded
        layouts (FSDP, TP, EP) move the rank's updates twice by all-to-all (to whole matrices and back); DDP's
        replicas gather the orthogonalised matrices once; ZeRO-1's ranks step whole parameters of their own (nothing
        moved)."""
        c, lay = step.candidate, step.candidate.layout
        hidden = step.cached("muon_hidden", lambda: [q for q in step.params if q.hidden_matrix])
        flops = step.cached("muon_flops", lambda: sum(ns_flops(q.shape) for q in hidden))
        per_matrix = flops / max(1, len(hidden))
        ranks = c.world if not lay.zero1 else c.dp
        low = Precision(step.precision).low_precision
        iterate = step.matmul_s(flops / ranks, per_matrix, "bf16" if low else "fp32")
        numel = step.cached("muon_numel", lambda: sum(q.numel for q in hidden))
        holders = c.world // c.pp  # the ranks of a stage, among which its matrices are shared out
        if lay.zero1 or holders <= 1:
            return iterate, {REDISTRIBUTION: 0.0}
        stage_bytes = numel / c.pp * FP32
        if lay.uses_ddp:
            return iterate, {REDISTRIBUTION: step.all_gather_s(stage_bytes, holders)}
        return iterate, {REDISTRIBUTION: 2 * step.all_to_all_s(stage_bytes / holders, holders)}
