"""The registered capabilities (paratrain/capabilities/base.py says what one is; docs/architecture.md how to add
one). Everything else iterates `CAPABILITIES` or a run's `active(cfg)` and names none of them. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from paratrain.capabilities.activation_offload import ActivationOffload
from paratrain.capabilities.adamw8bit import EightBitAdam
from paratrain.capabilities.base import Capability
from paratrain.capabilities.chunked_loss import ChunkedLoss
from paratrain.capabilities.diloco import DiLoCo
from paratrain.capabilities.cpu_offload import CpuOffload
from paratrain.capabilities.float8 import Float8
from paratrain.capabilities.grad_compression import GradientCompression
from paratrain.capabilities.lora import LoRA
from paratrain.capabilities.moe_balancing import MoEBalancing
from paratrain.capabilities.muon import Muon
from paratrain.capabilities.onebit import OneBitAdam
from paratrain.capabilities.segment_checkpointing import SegmentCheckpointing
from paratrain.capabilities.z_loss import ZLoss
from paratrain.errors import ConfigError, did_you_mean
from paratrain.optimizers import BUILT_IN, OptimizerEntry

# In the order their hooks run (and their keys are listed in a section they share).
CAPABILITIES: tuple[type[Capability], ...] = (LoRA, DiLoCo, Float8, OneBitAdam, EightBitAdam, Muon, ZLoss, ChunkedLoss,
                                               ActivationOffload, CpuOffload, GradientCompression, SegmentCheckpointing,
                                               MoEBalancing)

# Where a capability's optimizer entries sit in the table among the built-in ones: {built-in entry: the capabilities
# whose entries follow it}. The table's order is `optimizer.name`'s choices in --help, docs/configuration.md and the
# planner's listings; 1-bit Adam's entries were built in after sgd before they moved to their capability.
PLACED_AFTER: dict[str, tuple[type[Capability], ...]] = {"sgd": (OneBitAdam,)}


def _optimizer_table() -> dict[str, OptimizerEntry]:
    """The built-in entries (paratrain/optimizers.py) with the capabilities placed among them (PLACED_AFTER), then
    those the other capabilities bring (`Capability.optimizers`), in registry order."""
    placed = {cls for after in PLACED_AFTER.values() for cls in after}
    table = {}
    for name, entry in BUILT_IN.items():
        table[name] = entry
        table.update({e.name: e for cls in PLACED_AFTER.get(name, ()) for e in cls.optimizers})
    table.update({e.name: e for cls in CAPABILITIES if cls not in placed for e in cls.optimizers})
    return table


# The optimizer table `optimizer.name` selects from.
OPTIMIZERS: dict[str, OptimizerEntry] = _optimizer_table()
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer_entry(name: str) -> OptimizerEntry:
    """The registered optimizer `name`, or a one-line ConfigError naming the known ones."""
    entry = OPTIMIZERS.get(name)
    if entry is None:
        raise ConfigError(f"optimizer.name: '{name}' is not one of {', '.join(OPTIMIZER_NAMES)}"
                          + did_you_mean(name, OPTIMIZER_NAMES, cutoff=0.6))
    return entry


def active(cfg) -> tuple[Capability, ...]:
    """The capabilities a run's config (paratrain.config.Config) uses, with their settings."""
    return tuple(c for c in (cls.from_config(cfg) for cls in CAPABILITIES) if c is not None)


def implied(recipe, present: tuple[Capability, ...]) -> tuple[Capability, ...]:
    """`present` as the recipe's settings decide it (`Capability.implied_by`): an implied capability missing is added
    with its defaults, one no longer implied is dropped; one a recipe field holds (`Capability.recipe_field`) is that
    field's value; in registry order."""
    have = {type(c): c for c in present}
    out = []
    for cls in CAPABILITIES:
        if cls.recipe_field is not None:
            held = getattr(recipe, cls.recipe_field, None)  # (the planner's Settings hold none)
            out += [held] if held is not None else []
            continue
        if cls.checkpoint_mode is not None:  # (the planner's Settings have no checkpointing)
            out += [cls.from_recipe(recipe)] if getattr(recipe, "checkpointing", None) == cls.checkpoint_mode else []
            continue
        implied_now = cls.implied_by(recipe)
        if cls in have and implied_now is not False:
            out.append(have[cls])
        elif implied_now:
            out.append(cls())
    return tuple(out)


# {an activation checkpointing mode: the capability that is it} (`Capability.checkpoint_mode`: segments')
CHECKPOINTING_MODES: dict[str, type[Capability]] = {cls.checkpoint_mode: cls for cls in CAPABILITIES
                                                    if cls.checkpoint_mode is not None}


def implied_checkpointing(recipe, present: tuple[Capability, ...]) -> tuple[Capability, ...]:
    """`implied` where only the recipe's checkpointing settings changed (the planner's candidates: `Recipe.replace`'s
    fast path), `present` itself where neither the old nor the new mode is a capability."""
    if recipe.checkpointing not in CHECKPOINTING_MODES and not any(c.checkpoint_mode for c in present):
        return present
    return implied(recipe, present)


class Settings(NamedTuple):
    """What decides the capabilities a run implies where there is no Recipe (the planner's context)."""

    precision: str
    optimizer: str


def implied_by_settings(precision: str, optimizer: str) -> tuple[Capability, ...]:
    """The capabilities a precision and an optimizer imply, with their defaults (fp8's, Muon's, ...)."""
    return implied(Settings(precision, optimizer), ())


def check(cfg) -> None:
    """Every capability's checks (one-line ConfigErrors)."""
    for cls in CAPABILITIES:
        cls.check(cfg)


def gradient_reduction(compression, layout, entry, optimizer=None, steps: int = 0):
    """What a run's data-parallel gradient reduction runs with its `compression` (Recipe.compression)
    (`Capability.gradient_reduction`: the first answer; None: the plain reduction)."""
    answers = (cls.gradient_reduction(compression, layout, entry, optimizer, steps) for cls in CAPABILITIES)
    return next((r for r in answers if r is not None), None)


def checkpoint_state(state):
    """A checkpoint's state as plain tensors (`Capability.checkpoint_state` of each)."""
    for cls in CAPABILITIES:
        state = cls.checkpoint_state(state)
    return state


def own_sections() -> dict[str, tuple[type, str | None]]:
    """{section name: (its dataclass, the section it follows)} of the sections capabilities own."""
    return {cls.name: (cls.section, cls.section_after) for cls in CAPABILITIES if cls.section is not None}


def added_keys(section: str) -> list[type]:
    """The dataclasses of the keys capabilities add to an existing section, in registry order."""
    return [keys for keys, _ in added_keys_after(section)]


def added_keys_after(section: str) -> list[tuple[type, str | None]]:
    """(the dataclass of the keys a capability adds to an existing section, the key they follow or None: at the
    end), in registry order."""
    return [(cls.adds_to[1], cls.adds_after) for cls in CAPABILITIES
            if cls.adds_to is not None and cls.adds_to[0] == section]


def verify_rows(matrix: str | None = None) -> dict[str, tuple]:
    """Every capability's verify rows (row name -> (ranks, layout name, overrides...)), or those joining one sweep
    (`Capability.verify_matrix`; "": the capabilities' own)."""
    return {name: row for cls in CAPABILITIES if matrix in (None, cls.verify_matrix)
            for name, row in cls.verify_rows.items()}


def resumed_rows() -> dict[str, tuple[str, tuple[int, str]]]:
    """Every capability's verify rows that resume on another layout (`Capability.resumed_rows`)."""
    return {name: row for cls in CAPABILITIES for name, row in cls.resumed_rows.items()}


def reference_keys() -> tuple[str, ...]:
    """Override prefixes a verify row's single-process reference keeps (what the capability computes differently)."""
    return tuple(k for cls in CAPABILITIES for k in cls.reference_keys)


def switches() -> tuple[type[Capability], ...]:
    """The capabilities a layout's name switches on (`Capability.layout_item`: the chunked loss's `loss=8`, CPU
    offload's `cpuoff=on`, activation offload's)."""
    return tuple(cls for cls in CAPABILITIES if cls.layout_item)


def switched_on(present: tuple[Capability, ...]) -> dict[str, object]:
    """{name: its state} of every switch (`Capability.tier_state`: the JSON documents' `memory_tiers` keys: the
    chunked loss's pieces, the offloads')."""
    return {cls.name: cls.tier_state(next((c for c in present if isinstance(c, cls)), None)) for cls in switches()}


def switch_values(present: tuple[Capability, ...],
                  of: tuple[type[Capability], ...] | None = None) -> dict[str, object]:
    """{"section.key": value} of every switch's keys (or those of the switches `of`) in a config running `present`:
    the values of those present, the defaults of the others."""
    out = {}
    for cls in switches() if of is None else of:
        section, keys = cls.adds_to
        on = next((c for c in present if isinstance(c, cls)), None)
        out.update({f"{section}.{f.name}": f.default for f in dataclasses.fields(keys)})
        out.update(on.config_values() if on is not None else cls.off_values())
    return out


def checkpointing(present: tuple[Capability, ...]) -> Capability | None:
    """The capability among `present` that is the run's checkpointing mode (`Capability.checkpoint_mode`: segment
    checkpointing), or None: a mode of paratrain.modes.CheckpointMode's own."""
    return next((c for c in present if c.checkpoint_mode is not None), None)


def checkpoint_units(present: tuple[Capability, ...], blocks: list, n_layers: int) -> list[list]:
    """A model's or stage's `blocks` as its checkpoints group them (`Capability.checkpoint_units`; else one each)."""
    owner = checkpointing(present)
    units = owner.checkpoint_units(blocks, n_layers) if owner is not None else None
    return units if units is not None else [[b] for b in blocks]


def parse_checkpointing_label(text: str) -> dict | None:
    """{a Recipe field: its value} of a layout name's `ac=` value naming a capability's checkpointing mode, or None."""
    return next((s for s in (cls.parse_checkpointing_label(text) for cls in CAPABILITIES) if s is not None), None)


# The settings a Recipe gives by name (`Capability.recipe_setting`: the chunked loss's `loss_chunks`) -> their
# capability.
SETTINGS: dict[str, type[Capability]] = {cls.recipe_setting: cls for cls in CAPABILITIES if cls.recipe_setting}


def setting(present: tuple[Capability, ...], name: str):
    """The value of the recipe setting `name` (`SETTINGS`) among the capabilities `present`."""
    cls = SETTINGS[name]
    return cls.tier_state(next((c for c in present if type(c) is cls), None))


def with_setting(present: tuple[Capability, ...], name: str, value) -> tuple[Capability, ...]:
    """`present` with the recipe setting `name` at `value` (its capability replaced, added or dropped), in registry
    order."""
    cls = SETTINGS[name]
    on = cls.from_setting(value)
    out = [c for c in present if type(c) is not cls] + ([on] if on is not None else [])
    return tuple(sorted(out, key=lambda c: CAPABILITIES.index(type(c))))


def loss_pieces(present: tuple[Capability, ...], layout, precision: str, vocab_size: int, tokens: int) -> int:
    """The pieces the output projection and the loss run over for a micro-batch of `tokens` (`Capability.loss_pieces`:
    the chunked loss's; 1: whole), for the trainer and the estimator alike."""
    return max((c.loss_pieces(layout, precision, vocab_size, tokens) for c in present), default=1)
