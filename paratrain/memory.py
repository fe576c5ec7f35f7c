"""The memory tiers' rules, torch-free: what the `[memory]` section turns on for a layout and precision, for the
trainer, the estimator and the planner alike (README "Memory tiers").

Chunked loss (`memory.loss_chunks`): the output projection and the cross-entropy over pieces of each micro-batch's
tokens (`models.llama.chunked_cross_entropy`). It is exact where the output weight's gradient is summed in fp32
(training.precision=fp32): in bf16/fp16 the pieces' weight gradients are added in the low precision, one rounding
per piece more than one matmul makes, so there it is on only when asked for. A pipeline's last stage hands its
logits to the schedule's loss function, which has no hidden states to cut.
"""

from __future__ import annotations

from paratrain.errors import ConfigError

AUTO_LOSS_CHUNKS = 8  # torchtune's default number of output chunks: 1/8 of the logits live at a time


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



def check(memory, layout, precision: str) -> None:
    """Every `[memory]` setting against the layout (ConfigError naming the setting)."""
    loss_chunks(memory.loss_chunks, layout, precision)
