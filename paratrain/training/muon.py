"""Muon (momentum orthogonalised by a Newton-Schulz iteration: Jordan et al. 2024, torch.optim.Muon) for the hidden
matrices, AdamW for every other parameter, on any layout.

Which parameters take Muon (`hidden_matrices`): the blocks' attention and MLP projections (and each routed expert's
matrix, one matrix per expert); the embeddings, the output projection, the norms, biases and the MoE router take
AdamW, with the run's AdamW settings.

The update of a hidden matrix is the same as torch.optim.Muon's: the momentum buffer B <- mu B + (1 - mu) G (an EMA,
as torch keeps it), U = G + mu (B - G) with Nesterov (else B), O = NS_k(U) (k quintic Newton-Schulz steps on U / |U|),
W <- (1 - lr wd) W - lr * scale(shape) O. `scale` is `optimizer.muon_adjust_lr`: match_rms_adamw (Moonshot's
0.2 sqrt(max(A, B)): the update's RMS is AdamW's, so one learning rate and schedule serve both parts), original
(Keller Jordan's sqrt(max(1, A / B))) or none.

Distribution. Newton-Schulz needs the whole matrix; FSDP holds a row shard of it, TP a row or column slice, EP whole
experts, DDP a whole replica on every rank. The momentum is elementwise, so each rank updates its own shard's; only
U is moved: the updates of one shape and one layout are stacked, and the stack is redistributed (DTensor) from
"every rank a slice of every matrix" to "every rank whole matrices, a share of them" (Shard(0) of the stack over
every axis of the parameter's mesh), iterated there, and redistributed back. Each matrix is orthogonalised by one
rank, the work balanced over the mesh's ranks (ceil(k / n) matrices each); the bytes moved per step are two
all-to-alls of U (torch uses an all-gather and a slice where the backend has no all-to-all, gloo), and the extra
memory the whole matrices a rank holds (its share of the stack, twice: input and result). DDP's replicas take the
same plan over the data-parallel mesh (each orthogonalises 1/n of the matrices, one all-gather of the results).
ZeRO-1 needs nothing: each rank steps whole parameters of its partition.

Precision: the iteration runs in `optimizer.muon_ns_dtype` (auto: fp32 for fp32 runs, so that every layout
computes exactly one process's update and verify can hold them to 1e-5; bf16 for bf16/fp16 runs, as torch and the
Muon authors run it: the iteration is a contraction of a normalised matrix, stable at bf16's 8 bits of mantissa,
and bf16's range holds U / |U|'s Gram matrices where fp16's 5-bit exponent gains nothing).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from paratrain.capabilities.muon import ENTRY
from paratrain.modes import Precision
from paratrain.optimizers import HIDDEN_STATE

NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(cfg, device: torch.device, comm=None, precision: str = "fp32", replica_mesh=None, adamw=None, **_):
    """The builder of the table's entry (paratrain/capabilities/muon.py): Muon on the hidden matrices
    (optimizer.muon_*), AdamW (`adamw`: the adamw entry's keyword arguments) on the rest. The Newton-Schulz precision:
    optimizer.muon_ns_dtype, auto fp32 for an fp32 run, else bf16."""
    low = Precision(precision).low_precision
    ns = cfg.muon_ns_dtype if cfg.muon_ns_dtype != "auto" else "bfloat16" if low else "float32"
    return Muon, dict(muon_lr_ratio=(cfg.lr if cfg.muon_lr is None else cfg.muon_lr) / cfg.lr,
                      momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                      ns_coefficients=(cfg.muon_ns_a, cfg.muon_ns_b, cfg.muon_ns_c), ns_dtype=NS_DTYPES[ns],
                      adjust_lr=cfg.muon_adjust_lr, replica_mesh=replica_mesh, **adamw)


BUILDERS = {ENTRY.name: build}  # (training/optim.py's BUILDERS takes these)


def _renamed_group_key(optimizer, state_dict: dict) -> dict:
    """Checkpoints written before 2026-12-07 mark the hidden matrices' group "muon" (now HIDDEN_STATE): a loaded
    group replaces the optimizer's whole."""
    groups = [{HIDDEN_STATE if k == "muon" else k: v for k, v in g.items()} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def update_scale(rule: str, rows: int, cols: int) -> float:
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised (m, n) matrix, torch.optim.Muon's iteration (the same operations) in `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _stacked(placement):
    """A matrix's placement as the placement of a stack of such matrices (a new dimension 0)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + 1)
    return placement


class Muon(torch.optim.AdamW):
    """Muon on the param groups marked HIDDEN_STATE (the hidden matrices), torch's AdamW on the others (its fused / foreach implementation, as
    `optimizer.impl` resolves). `replica_mesh`: the data-parallel mesh over which plain (not DTensor) parameters are
    whole replicas with averaged gradients (DDP): their orthogonalisation is shared out over it. None on one process
    and under ZeRO-1 (whose ranks each step their own whole parameters)."""

    def __init__(self, params, *, muon_lr_ratio: float = 1.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_dtype: torch.dtype = torch.float32,
                 adjust_lr: str = "match_rms_adamw", ns_eps: float = 1e-7, replica_mesh=None,
                 hidden_state: bool = False, **adamw):
        super().__init__(params, **adamw)
        # a group added without the key (ZeRO-1's first group takes the defaults)
        self.defaults[HIDDEN_STATE] = hidden_state
        for group in self.param_groups:
            group.setdefault(HIDDEN_STATE, hidden_state)
        self.register_load_state_dict_pre_hook(_renamed_group_key)
        self.muon_lr_ratio, self.momentum, self.nesterov = muon_lr_ratio, momentum, nesterov
        self.ns_steps, self.ns_coefficients, self.ns_dtype = ns_steps, tuple(ns_coefficients), ns_dtype
        self.adjust_lr, self.ns_eps, self.replica_mesh = adjust_lr, ns_eps, replica_mesh

    def __setstate__(self, state: dict) -> None:
        # AdamW's reads every non-empty state's step count; the hidden matrices' state is a momentum buffer alone
        momenta = {p: s for p, s in state.get("state", {}).items() if s and "step" not in s}
        super().__setstate__({**state, "state": {p: s for p, s in state["state"].items() if p not in momenta}})
        self.state.update(momenta)

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        for group in groups:
            if group.get(HIDDEN_STATE):
                self._muon_step(group)
        self.param_groups = [g for g in groups if not g.get(HIDDEN_STATE)]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups

    def _muon_step(self, group: dict) -> None:
        """Updates that stack (one shape, dtype and layout) are orthogonalised in rounds of as many matrices as there
        are ranks to share them out to (one whole matrix per rank), each round applied at once: the step holds one
        round's updates and results at a time."""
        lr = group["lr"] * self.muon_lr_ratio
        batches = defaultdict(list)
        for p in group["params"]:
            if p.grad is not None:
                layout = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
                batches[(tuple(p.shape), p.dtype, layout)].append(p)
        for (_, _, layout), params in batches.items():
            ranks = self._sharing_ranks(layout)
            for start in range(0, len(params), ranks):  # a round: one whole matrix per rank at most
                members = params[start:start + ranks]
                orthogonalised = self.orthogonalise([self._momentum_update(p) for p in members], layout)
                for p, ortho in zip(members, orthogonalised):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(ortho, alpha=-lr * update_scale(self.adjust_lr, *p.shape[-2:]))

    def _sharing_ranks(self, layout) -> int:
        """The ranks the batch's matrices are shared out over (1: each rank iterates its own)."""
        if layout is not None:
            return layout[0].size()
        return self.replica_mesh.size() if self.replica_mesh is not None else 1

    def _momentum_update(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer's EMA step, and the update to orthogonalise (Nesterov's look-ahead, or the buffer)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - self.momentum)
        return p.grad.lerp(buf, self.momentum) if self.nesterov else buf

    def orthogonalise(self, updates: list[torch.Tensor], layout=None) -> list[torch.Tensor]:
        """Updates of one shape and `layout` ((mesh, placements) of DTensors; None: plain tensors) orthogonalised
        whole (per expert for a 3-D stack), returned as the parameters' type and layout."""
        if layout is not None:
            return self._orthogonalise_sharded(updates, *layout)
        if self.replica_mesh is not None and self.replica_mesh.size() > 1:
            return self._orthogonalise_replicated(updates)
        return [self._iterate(u) for u in updates]

    def _iterate(self, matrices: torch.Tensor) -> torch.Tensor:
        """(m, n) or (E, m, n) whole matrices -> their orthogonalised matrices, in the input's dtype."""
        if matrices.dim() == 2:
            return newton_schulz(matrices, self.ns_coefficients, self.ns_steps, self.ns_eps,
                                 self.ns_dtype).to(matrices.dtype)
        return torch.stack([self._iterate(m) for m in matrices.unbind(0)]) if matrices.numel() else matrices

    def _share_out(self, stack: DTensor, mesh) -> DTensor:
        """`stack` (k matrices or expert stacks) redistributed to whole matrices shared out over every mesh axis,
        iterated, and brought back to the stack's layout."""
        whole = stack.redistribute(mesh, [Shard(0)] * mesh.ndim)
        local = whole.to_local()  # (k_local, m, n), or (k_local, E, m, n) for expert stacks
        done = torch.stack([self._iterate(m) for m in local.unbind(0)]) if local.shape[0] else local.clone()
        back = DTensor.from_local(done, mesh, whole.placements, run_check=False, shape=whole.shape,
                                  stride=whole.stride())
        return back.redistribute(mesh, stack.placements)

    def _orthogonalise_sharded(self, matrices: list[DTensor], mesh, placements) -> list[DTensor]:
        local = torch.stack([m.to_local() for m in matrices])
        shape = (len(matrices), *matrices[0].shape)
        stack = DTensor.from_local(local, mesh, [_stacked(p) for p in placements], run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())
        done = self._share_out(stack, mesh).to_local()
        return [DTensor.from_local(d, mesh, placements, run_check=False, shape=m.shape, stride=m.stride())
                for d, m in zip(done.unbind(0), matrices)]

    def _orthogonalise_replicated(self, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        mesh = self.replica_mesh
        local = torch.stack(matrices)
        stack = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        return list(self._share_out(stack, mesh).to_local().unbind(0))
