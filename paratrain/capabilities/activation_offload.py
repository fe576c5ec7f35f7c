"""Activation offload (`memory.activation_offload`): the tensors every block ("all"), or blocks 0, k, 2k, ...
("every_k", k = `memory.activation_offload_every_k`), save for backward go to host memory in forward and come back in
backward; not with the zero-bubble schedules, whose weight-gradient step reads the saved tensors a second time after
the input-gradient step, nor inside checkpointed segments.

A memory tier (docs/memory-tiers.md) that is a capability: a layout's name switches it on (`actoff=all`,
`actoff=every_k2`), the planner tries the candidates that do not fit with it, and `paratrain estimate` takes it as
`--activation-offload` (and suggests it). Its runtime is a torch module (distributed/offload.py's saved-tensor hooks,
pinned host buffers and side stream), which `parallelize` applies to the blocks `host_activations` names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from paratrain.capabilities.base import Capability, host_link
from paratrain.errors import ConfigError, UserError
from paratrain.modes import CheckpointMode

KEY = "memory.activation_offload"
# none; all: every block's saved tensors go to host memory in forward and come back in backward; every_k: blocks 0, k,
# 2k, ... do.
ActivationOffloadMode = Literal["none", "all", "every_k"]
MODES: tuple[str, ...] = get_args(ActivationOffloadMode)
PLANNED_EVERY_K = 2  # memory.activation_offload_every_k of a planner candidate offloading every_k blocks (the default)


@dataclass
class ActivationOffloadKeys:
    # Saved activations of blocks moved to host memory in forward and back in backward (saved-tensor hooks; on CUDA
    # pinned buffers and a side stream): none | all blocks | every_k (blocks 0, k, 2k, ...).
    activation_offload: ActivationOffloadMode = "none"
    activation_offload_every_k: int = dataclasses.field(  # every_k: blocks 0, k, 2k, ...
        default=2, metadata={"flag": "--offload-every-k"})


@dataclass(frozen=True)
class ActivationOffload(Capability):
    mode: str = "all"  # all | every_k
    every_k: int = PLANNED_EVERY_K

    name = "activation_offload"
    adds_to = ("memory", ActivationOffloadKeys)
    layout_item = "actoff"
    layout_hint = ""  # (its values: the error of a bad one lists them)
    host_side = True
    copy_label = "activation offload"
    suggestion = (1.2, "--activation-offload all", "saved activations over PCIe to host memory and back, beside "
                  "compute")
    # its rows run in the memory tiers' sweep (paratrain/verify.py), exact against one process: the host holds the
    # same values the device would
    verify_matrix = "memory"
    verify_rows = {"fsdp2+offload": (2, "fsdp,actoff=all"),
                   "tp2+offload_every_k+selective": (2, "nodp,tp=2,ac=selective,actoff=every_k2"),
                   "pp2+offload+full": (2, "nodp,pp=2,sched=1f1b,ac=full,actoff=all")}

    @classmethod
    def from_config(cls, cfg) -> "ActivationOffload | None":
        mode = cfg.memory.activation_offload
        return cls(mode, cfg.memory.activation_offload_every_k) if mode != "none" else None

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.memory.activation_offload_every_k < 1:
            raise ConfigError(f"{KEY}_every_k must be >= 1")

    def config_values(self) -> dict:
        return {KEY: self.mode, f"{KEY}_every_k": self.every_k}

    @classmethod
    def tier_state(cls, on) -> object:
        return on.mode if on is not None else "none"

    # -- a layout's name: actoff=all, actoff=every_kK --
    def layout_value(self) -> str:
        return self.mode if self.mode == "all" else f"{self.mode}{self.every_k}"

    @classmethod
    def from_layout_value(cls, value: str, where: str) -> "ActivationOffload | None":
        k = (value[len("every_k"):] or "2") if value.startswith("every_k") else None  # (every_k alone: k = 2)
        if k is not None and k.isdigit() and int(k) >= 1:
            return cls("every_k", int(k))
        if value in MODES:
            return cls(value) if value != "none" else None
        raise UserError(f"{where}: actoff must be one of {', '.join(MODES)} (every_k with its k: every_k2)")

    def plan_problem(self) -> str | None:
        if self.host_activations(1)[1] not in (1, PLANNED_EVERY_K):
            return f"the planner predicts actoff=every_k{PLANNED_EVERY_K} only"
        return None

    # -- checks --
    @classmethod
    def runs_on(cls, layout) -> bool:
        # (a zero-bubble schedule's weight-gradient step reads the saved tensors again after the input-gradient step)
        return not (layout.pipelined and layout.pp_schedule.zero_bubble)

    def check_layout(self, layout) -> None:
        # (a config's own checks say these first: these are the estimator's flags)
        if self.mode not in MODES:
            raise UserError(f"--activation-offload '{self.mode}' is not one of {', '.join(MODES)}")
        if self.every_k < 1:
            raise UserError(f"--offload-every-k must be >= 1, got {self.every_k}")
        if not self.runs_on(layout):
            raise ConfigError(f"{KEY}={self.mode} does not work with parallel.pp_schedule={layout.pp_schedule}: its "
                              "weight-gradient step reads the saved activations again after the input-gradient step; "
                              "use 1f1b, gpipe or interleaved_1f1b")

    def check_checkpointing(self, mode: str) -> None:
        """Its hooks wrap each block's forward; inside a segment (activation_checkpoint.mode = segments) they would
        sit within the segment's checkpoint and take its saved tensors from it."""
        if CheckpointMode(mode).by_segments:
            raise ConfigError(f"{KEY}={self.mode} does not work with activation_checkpoint.mode={mode} (the "
                              "offloading hooks would sit inside each segment's checkpoint); use mode=full with "
                              "offloading, or segments without")

    # -- the training step (parallelize applies distributed/offload.py to these blocks) and the estimator --
    def host_activations(self, n_layers: int) -> tuple[list[int], int]:
        """Blocks 0, stride, 2 x stride, ... (stride 1: every block)."""
        stride = self.every_k if self.mode == "every_k" else 1
        return list(range(0, n_layers, stride)), stride

    @property
    def tier_label(self) -> str:
        stride = self.host_activations(1)[1]
        return "activation offload " + ("(every block)" if stride == 1 else f"(every {self.every_k} blocks)")

    def host_activation_s(self, block_bytes: int, moved: int, blocks: int, micro_steps: int, compute_s: float,
                          hw) -> tuple[float, float]:
        """Time: (exposed, total) seconds per step of the copies on the busiest rank: each of the `moved` blocks'
        `block_bytes` go to host in its forward and come back in backward, one send each over the device <-> host
        link (`Link.p2p_time`), on a side stream beside the compute of one
        block (its own forward, the block above's backward: a share `overlap` of it hides them). `compute_s`: the
        rank's compute per micro-step over its `blocks`."""
        one = host_link(hw).p2p_time(block_bytes)  # one block's copy, one way
        per_block = compute_s / max(blocks, 1) / 3  # forward; backward is twice that
        exposed = max(0.0, one - hw.overlap * per_block) + max(0.0, one - hw.overlap * 2 * per_block)
        return micro_steps * moved * exposed, micro_steps * moved * 2 * one
