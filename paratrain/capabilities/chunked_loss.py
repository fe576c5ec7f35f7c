"""Chunked loss (`memory.loss_chunks`): the output projection and the cross-entropy over pieces of each micro-batch's
tokens (`models.llama.chunked_cross_entropy`), so the logits of the whole micro-batch never exist at once; backward
recomputes each piece's.

It is exact where the output weight's gradient is summed in fp32 (training.precision=fp32): in bf16/fp16 the
pieces' weight gradients are added in the low precision, one rounding per piece more than one matmul makes, so
there it is on only when asked for. A pipeline's last stage hands its logits to the schedule's loss function, which
has no hidden states to cut. Automatic (0) chunks only where a rank's logits of one micro-batch are big
(`AUTO_LOSS_MIN_BYTES`): each piece is a checkpointed call whose fixed cost (the head's forward again, the
checkpoint's bookkeeping, its kernel launches) a small vocabulary's logits never pay back.

A memory tier (docs/memory-tiers.md) that is a capability: a layout's name says it (`loss=8`), the planner tries the
candidates that do not fit with it (alone and under the offloads), and `paratrain estimate` takes it as
`--loss-chunks` (and suggests it). Unlike the offloads it is always resolved: a Recipe holds it where its count is
not 1 (0: automatic until the model and the micro-batch are known) and gives the count by name (`recipe.loss_chunks`,
`Recipe.replace(loss_chunks=N)`). Its runtime is the model's forward (`targets=, loss_chunks=`, models/llama.py),
which the trainer calls with `loss_pieces` per micro-batch; the estimator holds it `resolved` and its memory walk
keeps one piece's logits at a time (estimate/activations.py: `ActDims.chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError, UserError
from paratrain.modes import Precision

KEY = "memory.loss_chunks"
AUTO_LOSS_CHUNKS = 8  # torchtune's default number of output chunks: 1/8 of the logits live at a time
# Automatic chunking from this many bytes of one micro-batch's fp32 logits per rank (tokens x vocabulary x 4 B; cp and
# a vocabulary-parallel loss divide them). The whole loss holds about three such tensors at its peak (the logits, their
# log-softmax kept for backward, its gradient); 8 pieces keep an eighth: from 64 MiB that saves ~170 MiB, 1% of a
# 16 GiB card. Below it the saving is under 1% of any accelerator while the pieces' fixed cost is paid every
# micro-step (the default recipe's 128-symbol vocabulary, 384 KiB of logits: +8% of its CPU step, bench/RESULTS.md
# 2026-12-02). A 32k vocabulary chunks from 525 tokens per micro-batch and rank, Llama 3's 128k from 131.
AUTO_LOSS_MIN_BYTES = 64 * 2**20


@dataclass
class ChunkedLossKeys:
    # The output projection and cross-entropy over this many pieces of each micro-batch's tokens, so the logits of
    # the whole micro-batch never exist at once (backward recomputes each piece's). 0: automatic, 8 where it is
    # exact (fp32 gradients; not under a pipeline) and one rank's fp32 logits of a micro-batch are 64 MiB or more;
    # 1: the whole logits at once.
    loss_chunks: int = 0


def logit_bytes(layout, vocab_size: int, tokens: int) -> int:
    """Bytes of one micro-batch's fp32 logits on one rank: `tokens` (sequences x sequence length of a micro-step on one
    data-parallel rank) cut by context parallelism, the vocabulary by tensor parallelism's loss parallel."""
    vocab = vocab_size // layout.tp if layout.uses_loss_parallel else vocab_size
    return tokens // layout.cp * vocab * 4


@dataclass(frozen=True)
class ChunkedLoss(Capability):
    chunks: int = AUTO_LOSS_CHUNKS  # pieces (0: automatic until resolved; a recipe without it: 1, the whole logits)

    name = "loss_chunks"  # (the key and the JSON documents' name)
    adds_to = ("memory", ChunkedLossKeys)
    recipe_setting = "loss_chunks"
    layout_item = "loss"
    layout_hint = ""  # (its values: the error of a bad one says them)
    with_every_tier = True
    suggestion = (0.4, f"--loss-chunks {AUTO_LOSS_CHUNKS}", "the output projection's forward once more")
    # its rows run in the memory tiers' sweep (paratrain/verify.py) against the reference, which computes its loss in
    # 8 pieces (fp32's default)
    verify_matrix = "memory"
    verify_rows = {"loss8": (1, "nodp,loss=8"),  # the loss over 8 pieces (the tiny model's logits are whole by default)
                   "tp2+sp+loss3": (2, "nodp,tp=2,loss=3")}  # loss parallel over 3 uneven pieces

    @classmethod
    def from_config(cls, cfg) -> "ChunkedLoss | None":
        return cls.from_setting(cfg.memory.loss_chunks)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.memory.loss_chunks < 0:
            raise ConfigError(f"{KEY} must be >= 0 (0: automatic, 1: whole logits)")

    # -- the setting: recipe.loss_chunks, Recipe.replace(loss_chunks=N) --
    @classmethod
    def from_setting(cls, value: int) -> "ChunkedLoss | None":
        return cls(value) if value != 1 else None

    @classmethod
    def tier_state(cls, on) -> int:
        return on.chunks if on is not None else 1

    def config_values(self) -> dict:
        return {KEY: self.chunks}

    @classmethod
    def off_values(cls) -> dict:
        return {KEY: 1}

    # -- a layout's name: loss=N, written where N > 1 --
    def layout_value(self) -> str:
        return str(self.chunks) if self.chunks > 1 else ""

    @classmethod
    def from_layout_value(cls, value: str, where: str) -> "ChunkedLoss | None":
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"{where}: loss must be an integer >= 1 (pieces of the loss), got '{value}'")
        return cls.from_setting(int(value))

    @property
    def tier_label(self) -> str:
        return f"chunked loss ({self.chunks} pieces)" if self.chunks > 1 else ""

    # -- checks --
    @classmethod
    def runs_on(cls, layout) -> bool:
        return not layout.pipelined  # (the last stage hands its logits to the schedule's loss function)

    def check_layout(self, layout) -> None:
        if self.chunks < 0:  # (a config's own check says it first: this is the estimator's flag)
            raise UserError(f"--loss-chunks must be >= 0 (0: automatic), got {self.chunks}")
        if layout.pipelined and self.chunks > 1:
            raise ConfigError(f"{KEY}={self.chunks} does not work with parallel.pp > 1 (the last stage hands "
                              "its logits to the schedule's loss function); use 0 or 1")

    # -- the training step (per micro-batch) and the estimator: how many pieces --
    def loss_pieces(self, layout, precision: str, vocab_size: int, tokens: int) -> int:
        """0 is automatic: AUTO_LOSS_CHUNKS where exact and the logits are big (`AUTO_LOSS_MIN_BYTES`), else 1."""
        self.check_layout(layout)
        if layout.pipelined:
            return 1
        if self.chunks == 0:
            big = logit_bytes(layout, vocab_size, tokens) >= AUTO_LOSS_MIN_BYTES
            return AUTO_LOSS_CHUNKS if big and not Precision(precision).low_precision else 1
        return self.chunks

    def resolved(self, layout, precision: str, vocab_size: int, tokens: int) -> "ChunkedLoss | None":
        return self.from_setting(self.loss_pieces(layout, precision, vocab_size, tokens))

    def head_recompute_s(self, head_s: float, micro_steps: int) -> float:
        """Time: the head's forward once more, piece by piece, in backward (a third of `head_s` is the forward).
        Memory: activations.head_saved keeps only the normed hidden states, activations.loss_backward_extra holds one
        piece's logits at a time (both read ActDims.chunks)."""
        return micro_steps * head_s / 3 if self.chunks > 1 else 0.0
