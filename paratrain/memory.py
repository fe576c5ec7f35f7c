"""The memory tiers' rules, torch-free: what the `[memory]` section turns on for a layout and precision, for the
trainer, the estimator and the planner alike (README "Memory tiers").

Chunked loss (`memory.loss_chunks`): the output projection and the cross-entropy over pieces of each micro-batch's
tokens (`models.llama.chunked_cross_entropy`). It is exact where the output weight's gradient is summed in fp32
(training.precision=fp32): in bf16/fp16 the pieces' weight gradients are added in the low precision, one rounding
per piece more than one matmul makes, so there it is on only when asked for. A pipeline's last stage hands its
logits to the schedule's loss function, which has no hidden states to cut.

Activation offload (`memory.activation_offload`): the saved tensors of every block ("all") or of blocks 0, k, 2k, ...
("every_k") go to host memory in forward and come back in backward (distributed/offload.py). Not with the zero-bubble
schedules, whose weight-gradient step reads the saved tensors a second time after the input-gradient step.

CPU offload (`memory.cpu_offload`): FSDP2's CPUOffloadPolicy keeps each rank's shards of the parameters and
gradients, and so the optimizer state, in host memory, and the optimizer step runs on the CPU; it needs FSDP to hold
the parameters (fsdp, zero2, hsdp; with tp, pp, ep, cp).
"""

from __future__ import annotations

from typing import Literal, get_args

from paratrain.errors import ConfigError
from paratrain.layout import ZERO_BUBBLE

ActivationOffloadMode = Literal["none", "all", "every_k"]
OFFLOAD_MODES: tuple[str, ...] = get_args(ActivationOffloadMode)

AUTO_LOSS_CHUNKS = 8  # torchtune's default number of output chunks: 1/8 of the logits live at a time
MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors stay on the device (a copy costs more than it saves; torchtune's)
HOST_HEADROOM = 0.2  # of a node's host memory kept for the OS, the data loaders and the ranks' own processes


def loss_chunks(setting: int, layout, precision: str) -> int:
    """`memory.loss_chunks` for this layout and precision: 0 is automatic (AUTO_LOSS_CHUNKS where exact, else 1)."""
    if layout.pipelined:
        if setting > 1:
            raise ConfigError(f"memory.loss_chunks={setting} does not work with parallel.pp > 1 (the last stage hands "
                              "its logits to the schedule's loss function); use 0 or 1")
        return 1
    if setting == 0:
        return AUTO_LOSS_CHUNKS if precision == "fp32" else 1
    return setting


def offloaded_blocks(mode: str, every_k: int, n_layers: int) -> list[int]:
    """The blocks whose saved activations `memory.activation_offload` moves to host memory."""
    if mode == "none":
        return []
    step = every_k if mode == "every_k" else 1
    return list(range(0, n_layers, step))


def offload_stride(mode: str, every_k: int) -> int:
    """Blocks between two offloaded ones (the one below an offloaded block's is prefetched in backward)."""
    return every_k if mode == "every_k" else 1


def check_offload(mode: str, layout) -> None:
    if mode != "none" and layout.pipelined and layout.pp_schedule in ZERO_BUBBLE:
        raise ConfigError(f"memory.activation_offload={mode} does not work with parallel.pp_schedule="
                          f"{layout.pp_schedule}: its weight-gradient step reads the saved activations again after "
                          "the input-gradient step; use 1f1b, gpipe or interleaved_1f1b")


def check_cpu_offload(enabled: bool, layout) -> None:
    if enabled and not layout.uses_fsdp:
        raise ConfigError("memory.cpu_offload needs FSDP to hold the parameters: dp_mode fsdp, zero2 or hsdp with "
                          f"more than one data-parallel or context-parallel rank (this layout: {layout.describe()})")


def check(memory, layout, precision: str) -> None:
    """Every `[memory]` setting against the layout (ConfigError naming the setting)."""
    loss_chunks(memory.loss_chunks, layout, precision)
    check_offload(memory.activation_offload, layout)
    check_cpu_offload(memory.cpu_offload, layout)
