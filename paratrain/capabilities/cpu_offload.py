"""CPU offload (`memory.cpu_offload`): FSDP2's CPUOffloadPolicy keeps each rank's shards of the parameters and
gradients, and so the optimizer state, in host memory, and the optimizer step runs on the CPU; it needs FSDP to hold
the parameters (fsdp, zero2, hsdp; with tp, pp, ep, cp).

A memory tier (docs/memory-tiers.md) that is a capability: a layout's name switches it on (`cpuoff=on`), the planner
tries the FSDP candidates that do not fit with it, and `paratrain estimate` takes it as `--cpu-offload`. On the device
each FSDP group's shards are copied in for its all-gather and its gradient shards copied out after its
reduce-scatter; the device keeps only what it gathers and computes with (and the buffers: the rotary tables).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.capabilities.base import Capability, host_link
from paratrain.errors import ConfigError
from paratrain.optimizers import BUILT_IN

KEY = "memory.cpu_offload"


@dataclass
class CpuOffloadKeys:
    # Sharded parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy; the optimizer step
    # runs on the CPU): fsdp, zero2 and hsdp layouts, with tp, pp, ep and cp.
    cpu_offload: bool = False


@dataclass(frozen=True)
class CpuOffload(Capability):
    name = "cpu_offload"
    adds_to = ("memory", CpuOffloadKeys)
    layout_item = "cpuoff"
    states_on_host = True
    host_side = True
    tier_label = "CPU offload (parameters, gradients, optimizer state)"
    suggestion = (1.8, "--cpu-offload", "model states in host memory: shards over PCIe each gather, the optimizer step "
                  "on the CPU")
    # its rows run in the memory tiers' sweep (paratrain/verify.py), exact against one process (fp32's 1e-5): the host
    # holds the same fp32 values the device would
    verify_matrix = "memory"
    verify_rows = {"fsdp2+cpu_offload": (2, "fsdp,cpuoff=on"),
                   "fsdp2xtp2+cpu_offload": (4, "fsdp,tp=2,cpuoff=on"),
                   "pp2xdp2+cpu_offload": (4, "fsdp,pp=2,sched=1f1b,cpuoff=on")}

    @classmethod
    def from_config(cls, cfg) -> "CpuOffload | None":
        return cls() if cfg.memory.cpu_offload else None

    def config_values(self) -> dict:
        return {KEY: True}

    @classmethod
    def runs_on(cls, layout) -> bool:
        return layout.uses_fsdp  # (CPUOffloadPolicy is FSDP's: DDP and a single process have no shards to offload)

    def check_layout(self, layout) -> None:
        if not self.runs_on(layout):
            raise ConfigError(f"{KEY} needs FSDP to hold the parameters: dp_mode fsdp, zero2 or hsdp with more than "
                              f"one data-parallel or context-parallel rank (this layout: {layout.describe()})")

    # -- the training step --
    def fsdp_offload_policy(self, where):
        """FSDP2's CPUOffloadPolicy, the host buffers pinned on CUDA (its copies then run beside compute)."""
        from torch.distributed.fsdp import CPUOffloadPolicy  # lazy: the estimator reads this module without torch

        return CPUOffloadPolicy(pin_memory=where.device.type == "cuda")

    # -- the estimator and the planner --
    def host_states(self, st):
        """Memory: what stays on the device (what it gathers and computes with) and what is in host memory, by
        category."""
        host = {"parameters": st.params, "gradients": st.grads, "optimizer": st.optimizer + st.master}
        return dataclasses.replace(st, params=0, grads=0, optimizer=0, master=0), host

    def host_optimizer_s(self, opt_params: float, step_bytes: float, hw) -> float:
        """Time: the host steps this rank's shards (estimate/hardware.py: host_adam_rate, measured with AdamW; an
        optimizer that moves more bytes per parameter takes as much longer)."""
        host_link(hw)
        return opt_params / hw.host_adam_params_per_s * step_bytes / BUILT_IN["adamw"].step_bytes

    def fsdp_copy_s(self, copies: int, shard_bytes: float, hw) -> float:
        """Time: each FSDP gather copies its group's fp32 shards in, each reduce-scatter its gradients out, one send
        each over the device <-> host link (`Link.p2p_time`)."""
        return copies * host_link(hw).p2p_time(shard_bytes)

