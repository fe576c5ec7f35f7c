"""Segment checkpointing (`activation_checkpoint.mode = "segments"`): each run of k consecutive blocks of a model or
pipeline stage (k = `activation_checkpoint.segment_blocks`, 0: round(sqrt(n_layers))) keeps only its input and
recomputes as one unit in its last block's backward: n/k inputs plus one segment's k blocks at a time (sqrt(n)
segments of sqrt(n) blocks store O(sqrt n)). A segment never crosses a stage boundary; the last may be shorter.

A checkpointing mode that is a capability: a Recipe holds it exactly when its checkpointing mode is `checkpoint_mode`
(`capabilities.implied`, with the recipe's `segment_blocks`). The module declares its key, its check, its value in a
layout's name (`ac=segments4`; `segments` alone: the default) and in the estimate's tables, its verify rows, and the
rule both the estimator and the trainer follow, which blocks are checkpointed together (`checkpoint_units`): the
estimator's activation walk stores only each unit's first block's input, and `parallelize` applies
distributed/parallelize.py's multi-block checkpoint (torch's non-reentrant checkpoint opened and closed by hooks on
the unit's first and last block) to each unit.

What stays outside: `CheckpointMode.SEGMENTS`, a value of the one `activation_checkpoint.mode` setting, with the
questions the cost model asks of every mode (how much it recomputes and stores: paratrain/modes.py); the bytes a
recomputed segment holds (estimate/activations.py's `segment_recomputed`, in the estimator's activation terms, which
the capabilities may not import); the torch hooks (distributed/, which the capabilities may not import either).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError
from paratrain.modes import CheckpointMode

KEY = "activation_checkpoint.segment_blocks"


@dataclass
class SegmentKeys:
    # mode segments: blocks per segment (each keeps only its input, recomputed as one unit); 0: round(sqrt(n_layers))
    segment_blocks: int = 0


def segment_size(segment_blocks: int, n_layers: int) -> int:
    """activation_checkpoint.segment_blocks resolved: 0 is round(sqrt(n_layers)), at least 1."""
    return segment_blocks or max(1, round(n_layers ** 0.5))


def segments(blocks: list, size: int) -> list[list]:
    """The segments of one model or pipeline stage: its blocks in runs of `size`, in order (the last may be shorter;
    a segment never crosses a stage boundary)."""
    return [blocks[i:i + size] for i in range(0, len(blocks), size)]


@dataclass(frozen=True)
class SegmentCheckpointing(Capability):
    blocks: int = 0  # activation_checkpoint.segment_blocks (0: round(sqrt(n_layers)))

    name = "segment_checkpointing"
    adds_to = ("activation_checkpoint", SegmentKeys)
    checkpoint_mode = CheckpointMode.SEGMENTS
    # one process with the default round(sqrt(4)) = 2 blocks per segment; fsdp with uneven segments (3 + 1 blocks);
    # tp with sp; a pipeline whose stages (2 blocks each) cut the segments of 3. In the memory tiers' sweep
    # (paratrain/verify.py), exact against one process: recomputation computes the same values
    verify_matrix = "memory"
    verify_rows = {"segments": (1, "nodp,ac=segments"),
                   "fsdp2+segments": (2, "fsdp,ac=segments3"),
                   "tp2+segments": (2, "nodp,tp=2,ac=segments2"),
                   "pp2+segments": (2, "nodp,pp=2,sched=1f1b,ac=segments3")}

    @classmethod
    def from_config(cls, cfg) -> "SegmentCheckpointing | None":
        ac = cfg.activation_checkpoint
        return cls(ac.segment_blocks) if ac.mode == cls.checkpoint_mode else None

    @classmethod
    def from_recipe(cls, recipe) -> "SegmentCheckpointing":
        return cls(recipe.segment_blocks)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.activation_checkpoint.segment_blocks < 0:
            raise ConfigError(f"{KEY} must be >= 0 (0: round(sqrt(n_layers)))")

    def size(self, n_layers: int) -> int:
        return segment_size(self.blocks, n_layers)

    # -- the estimator's activation walk and parallelize --
    def checkpoint_units(self, blocks: list, n_layers: int) -> list[list]:
        """A stage's blocks in runs of `size`."""
        return segments(blocks, self.size(n_layers))

    # -- a layout's name (ac=segments, ac=segments4) and the estimate's tables --
    def checkpointing_label(self) -> str:
        return f"{self.checkpoint_mode}{self.blocks or ''}"

    @classmethod
    def parse_checkpointing_label(cls, text: str) -> dict | None:
        if not text.startswith(cls.checkpoint_mode):
            return None
        k = text[len(cls.checkpoint_mode):]
        if k and not (k.isdigit() and int(k) >= 1):
            return None
        return {"checkpointing": cls.checkpoint_mode, "every_k": 2, "segment_blocks": int(k or 0)}

    def describe_checkpointing(self, n_layers: int) -> str:
        return f"{self.checkpoint_mode} (k={self.size(n_layers)})"
