"""The memory tiers' rules, torch-free: what the `[memory]` section turns on for a layout and precision, for the
trainer, the estimator and the planner alike (docs/memory-tiers.md).

Chunked loss (`memory.loss_chunks`): the output projection and the cross-entropy over pieces of each micro-batch's
tokens (`models.llama.chunked_cross_entropy`). It is exact where the output weight's gradient is summed in fp32
(training.precision=fp32): in bf16/fp16 the pieces' weight gradients are added in the low precision, one rounding
per piece more than one matmul makes, so there it is on only when asked for. A pipeline's last stage hands its
logits to the schedule's loss function, which has no hidden states to cut. Automatic (0) chunks only where a rank's
logits of one micro-batch are big (`AUTO_LOSS_MIN_BYTES`): each piece is a checkpointed call whose fixed cost (the
head's forward again, the checkpoint's bookkeeping, its kernel launches) a small vocabulary's logits never pay back.

Activation offload and CPU offload, the other tiers, are capabilities (`ActivationOffload`, `CpuOffload` in
paratrain/capabilities): a layout's name switches them on, and their keys, checks and terms live there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.modes import Precision

AUTO_LOSS_CHUNKS = 8  # torchtune's default number of output chunks: 1/8 of the logits live at a time
# Automatic chunking from this many bytes of one micro-batch's fp32 logits per rank (tokens x vocabulary x 4 B; cp and
# a vocabulary-parallel loss divide them). The whole loss holds about three such tensors at its peak (the logits, their
# log-softmax kept for backward, its gradient); 8 pieces keep an eighth: from 64 MiB that saves ~170 MiB, 1% of a
# 16 GiB card. Below it the saving is under 1% of any accelerator while the pieces' fixed cost is paid every
# micro-step (the default recipe's 128-symbol vocabulary, 384 KiB of logits: +8% of its CPU step, bench/RESULTS.md
# 2026-12-02). A 32k vocabulary chunks from 525 tokens per micro-batch and rank, Llama 3's 128k from 131.
AUTO_LOSS_MIN_BYTES = 64 * 2**20
MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors stay on the device (a copy costs more than it saves; torchtune's)
HOST_HEADROOM = 0.2  # of a node's host memory kept for the OS, the data loaders and the ranks' own processes


@dataclass(frozen=True)
class MemoryTiers:
    """The memory tiers of one configuration: the `[memory]` section's values (the same names), and what a layout
    name writes after its checkpointing and micro-batch (paratrain/layout_grammar.py). loss_chunks 0 is automatic
    until the model and the micro-batch are known (`loss_chunks`); 1 is the whole logits."""

    loss_chunks: int = 1

    @classmethod
    def from_config(cls, memory) -> "MemoryTiers":
        """From a `[memory]` section (config.MemoryConfig)."""
        return cls(**{f.name: getattr(memory, f.name) for f in dataclasses.fields(cls)})

    def to_config(self, base):
        """`base`, a `[memory]` section, with these tiers written over it."""
        return dataclasses.replace(base, **dataclasses.asdict(self))

    @property
    def active(self) -> bool:
        return self.loss_chunks > 1

    def items(self) -> list[str]:
        """Layout-name items: loss=N (only when in use)."""
        return [f"loss={self.loss_chunks}"] if self.loss_chunks > 1 else []


def logit_bytes(layout, vocab_size: int, tokens: int) -> int:
    """Bytes of one micro-batch's fp32 logits on one rank: `tokens` (sequences x sequence length of a micro-step on one
    data-parallel rank) cut by context parallelism, the vocabulary by tensor parallelism's loss parallel."""
    vocab = vocab_size // layout.tp if layout.uses_loss_parallel else vocab_size
    return tokens // layout.cp * vocab * 4


def check_loss_chunks(setting: int, layout) -> None:
    if layout.pipelined and setting > 1:
        raise ConfigError(f"memory.loss_chunks={setting} does not work with parallel.pp > 1 (the last stage hands "
                          "its logits to the schedule's loss function); use 0 or 1")


def loss_chunks(setting: int, layout, precision: str, *, vocab_size: int, tokens: int) -> int:
    """`memory.loss_chunks` for this layout, precision and micro-batch (`tokens`: its sequences x sequence length on
    one data-parallel rank, before context parallelism cuts them; `vocab_size`: the model's): 0 is automatic
    (AUTO_LOSS_CHUNKS where exact and the logits are big, `AUTO_LOSS_MIN_BYTES`; else 1). The trainer
    (training/step.py, per micro-batch) and the estimator (estimate/inputs.py) both resolve it here."""
    check_loss_chunks(setting, layout)
    if layout.pipelined:
        return 1
    if setting == 0:
        big = logit_bytes(layout, vocab_size, tokens) >= AUTO_LOSS_MIN_BYTES
        return AUTO_LOSS_CHUNKS if big and not Precision(precision).low_precision else 1
    return setting


def check(memory, layout, precision: str) -> None:
    """Every `[memory]` setting against the layout (ConfigError naming the setting)."""
    check_loss_chunks(memory.loss_chunks, layout)
