"""A layout as text: its one name and the command-line flags that set it.

The name is what `paratrain plan` prints, `plan --explain` reads and `paratrain verify`'s table is written in:
comma-separated items, the data-parallel mode first (`nodp`: no data parallelism), then only what differs from a
single process:

    hsdp,rep=2,cp=2,tp=2,sp=off,lp=off,pp=2,sched=interleaved_1f1b,v=3,ep=2,ac=every_k2,mb=1

rep: hsdp's replicas; cp, tp, pp, ep: degrees (dp_shard is the rest of the world); sp=off, lp=off: tp without
sequence or loss parallelism; sched: the pipeline schedule, v its stages per rank (the interleaved schedules'
default 2 is not written); ac: activation checkpointing (every_k with its k, segments with its blocks per segment
when set: segments4); mb: sequences per micro-batch. The
memory tiers in use follow, the capabilities' switches (`Capability.layout_item`, in the registry's order, each
documented in its module): loss=N (the loss over N pieces), activation offload's mode, cpuoff=on for CPU offload.

The flags are one per `[parallel]` setting (`FLAGS`, derived from config.ParallelConfig; `--tp`, `--pp-schedule`,
`--no-sequence-parallel`, `--grad-compression`, ...): `add_layout_flags` adds those a command takes, `layout_flags` reads what was given as
`[parallel]` values. `paratrain estimate` writes them over the config it estimates, `paratrain plan` plans only
layouts that have them.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal, get_origin

from paratrain import capabilities
from paratrain.config import ParallelConfig
from paratrain.config_reference import LazyHelp, describe
from paratrain.errors import UserError
from paratrain.layout import CONFIG_KEYS, Layout
from paratrain.modes import (CHECKPOINT_MODES, DP_MODE_OPTIONS, SCHEDULES, DPMode, checkpointing_label,
                             parse_checkpointing_label)

NO_DATA_PARALLEL = "nodp"
DEGREES = ("rep", "cp", "tp", "pp", "v", "ep", "mb")
SWITCHES = {"sp": "sequence_parallel", "lp": "loss_parallel"}  # item -> Layout field, written only when off
SWITCHED = {cls.layout_item: cls for cls in capabilities.switches()}  # item -> the capability `item=...` turns on


def layout_name(layout, checkpointing: str | None = None, every_k: int = 2, micro_batch: int | None = None,
                switched: tuple = ()) -> str:
    """The layout's name (see the module doc), with its checkpointing and micro-batch when given, and the items of
    the capabilities in `switched` that a name switches on (the memory tiers; a capability that is the checkpointing
    mode writes its `ac=` value: segments4)."""
    lay = layout
    parts = [lay.dp_mode if lay.dp_cp > 1 else NO_DATA_PARALLEL]
    if lay.hybrid:
        parts.append(f"rep={lay.dp_replicate}")
    if lay.cp > 1:
        parts.append(f"cp={lay.cp}")
    if lay.tp > 1:
        parts.append(f"tp={lay.tp}")
        parts += [f"{item}=off" for item, name in SWITCHES.items() if not getattr(lay, name)
                  and (name != "loss_parallel" or not lay.pipelined)]  # (a pipeline has no loss parallelism)
    if lay.pp > 1:
        parts += [f"pp={lay.pp}", f"sched={lay.pp_schedule}"]
        if lay.pp_virtual > 2:
            parts.append(f"v={lay.pp_virtual}")  # (2 is the interleaved schedules' default)
    if lay.ep > 1:
        parts.append(f"ep={lay.ep}")
    if checkpointing is not None:
        owner = capabilities.checkpointing(switched)
        parts.append(f"ac={owner.checkpointing_label() if owner else checkpointing_label(checkpointing, every_k)}")
    if micro_batch is not None:
        parts.append(f"mb={micro_batch}")
    return ",".join(parts + [f"{c.layout_item}={c.layout_value()}" for c in switched
                             if c.layout_item and c.layout_value()])


@dataclass
class NamedLayout:
    """What a layout name says: `Layout.resolve`'s options (the world size aside), the recipe settings its items give
    and the capabilities its switches turn on; what it does not name keeps a run's own settings."""

    options: dict = field(default_factory=dict)
    # {a Recipe field: its value} for the items named: ac= (checkpointing, every_k, segment_blocks: segmentsK's K, 0
    # for segments alone), mb= (micro_batch)
    settings: dict = field(default_factory=dict)
    named: frozenset = frozenset()  # the items the name gives
    switched: tuple = ()  # the capabilities its switches turn on (loss=8, cpuoff=on: CPU offload), with their settings

    def switch_values(self) -> dict:
        """The settings of the switches named (loss=, cpuoff=, ...), as {"section.key": value} (a switch
        named off: its keys' defaults, or its `off_values`)."""
        named = tuple(cls for item, cls in SWITCHED.items() if item in self.named)
        return capabilities.switch_values(self.switched, named)

    def layout(self, world_size: int, **more):
        """The layout on `world_size` ranks (ConfigError when it is none paratrain can run)."""
        return Layout.resolve(world_size, **self.options, **more)


def parse_layout_name(text: str, what: str = "layout") -> NamedLayout:
    """A layout name -> NamedLayout; a one-line UserError naming `what` (e.g. --explain) on bad syntax."""
    where = f"{what} '{text}'"
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens:
        raise UserError(f"{what} needs a layout, e.g. fsdp,tp=2,ac=selective,mb=2 (as in the plan's table)")
    mode = tokens[0]
    if mode not in (*DP_MODE_OPTIONS, NO_DATA_PARALLEL):
        raise UserError(f"{where}: the first item must be a dp mode ({', '.join(DP_MODE_OPTIONS)}) or "
                        f"{NO_DATA_PARALLEL}")
    mode = DPMode(mode) if mode != NO_DATA_PARALLEL else DPMode.FSDP
    items: dict[str, str] = {}
    for tok in tokens[1:]:
        k, eq, v = tok.partition("=")
        if not eq or k not in (*DEGREES, *SWITCHES, *SWITCHED, "sched", "ac") or k in items:
            raise UserError(f"{where}: unknown or repeated item '{tok}' (use {'=, '.join(DEGREES)}=, sched=, ac=, "
                            f"sp=off, lp=off{''.join(f', {i}={c.layout_hint}' for i, c in SWITCHED.items())})")
        items[k] = v
    degrees = {}
    for k in DEGREES:
        if k in items:
            if not items[k].isdigit() or int(items[k]) < 1:
                raise UserError(f"{where}: {k} must be an integer >= 1, got '{items[k]}'")
            degrees[k] = int(items[k])
    for k in SWITCHES:
        if items.get(k, "off") != "off":
            raise UserError(f"{where}: {k} is on unless {k}=off")
    sched = items.get("sched", "1f1b")
    if sched not in SCHEDULES:
        raise UserError(f"{where}: sched must be one of {', '.join(SCHEDULES)}")
    ac = capabilities.parse_checkpointing_label(items.get("ac", "none"))  # (a capability's mode: segments4)
    ac = ac or _builtin_checkpointing(items.get("ac", "none"))
    if ac is None:
        raise UserError(f"{where}: ac must be one of {', '.join(CHECKPOINT_MODES)} (every_k with its k: every_k2; "
                        "segments with its blocks per segment: segments4)")
    settings = dict(ac) if "ac" in items else {}
    settings.update({"micro_batch": degrees["mb"]} if "mb" in items else {})
    return NamedLayout(_layout_options(mode, degrees, sched, items), settings, frozenset(items),
                       _switched(items, where))


def _builtin_checkpointing(text: str) -> dict | None:
    parsed = parse_checkpointing_label(text)
    return {"checkpointing": parsed[0], "every_k": parsed[1], "segment_blocks": 0} if parsed else None


def _switched(items: dict[str, str], where: str) -> tuple:
    """The capabilities the name's switches turn on (`item=on`, or its value:
    `Capability.from_layout_value`), in the registry's order."""
    on = [cls.from_layout_value(items[item], where) for item, cls in SWITCHED.items() if item in items]
    return tuple(c for c in on if c is not None)


def _layout_options(mode: DPMode, degrees: dict, sched: str, items: dict) -> dict:
    return dict(dp_mode=mode, dp_replicate=degrees.get("rep", 1) if mode.replicates_shards else 1,
                tp=degrees.get("tp", 1), pp=degrees.get("pp", 1), ep=degrees.get("ep", 1), cp=degrees.get("cp", 1),
                pp_schedule=sched, pp_virtual=degrees.get("v", 1),
                **{name: False for k, name in SWITCHES.items() if k in items})


# -- command-line flags ------------------------------------------------------------------------------------------
# One flag per `[parallel]` setting, derived from config.ParallelConfig: named `--` and the key with dashes, typed
# by its annotation, described by its comment (config_reference.describe); a switch that is on by default is turned
# off by `--no-<key>`. A new [parallel] key gets its flag with no line here, unless it is one of these:
FLAG_ALIASES = {"pp_virtual_stages": ("--pp-virtual",), "pp_microbatches": ("--microbatches",)}  # shown first
NOT_FLAGS = {  # [parallel] keys no command line sets, and why
    "pp_stage_gpus": "written by paratrain plan for a heterogeneous cluster",
    "powersgd_warmup_steps": "a run's warm-up: neither the layout nor its memory",
    "sign_ef_warmup_steps": "a run's warm-up: neither the layout nor its memory",
    "fsdp_forward_prefetch": "a run's overlap: neither the layout nor its memory",
}


FLAG_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in NOT_FLAGS)
LAYOUT_KEYS = tuple(k for k in FLAG_KEYS if k in CONFIG_KEYS.values())  # the flags of a Layout's fields
COMPRESSION_KEYS = ("grad_compression", "powersgd_rank", "sign_ef_block")


def _annotation(key: str):
    return typing.get_type_hints(ParallelConfig)[key]


def flag_names(key: str) -> tuple[str, ...]:
    """The command-line names of a `[parallel]` key's flag; the first is shown."""
    if _annotation(key) is bool:
        return ("--no-" + key.replace("_", "-"),)
    return (*FLAG_ALIASES.get(key, ()), "--" + key.replace("_", "-"))


def flag_help(key: str) -> str:
    about = describe("parallel", ParallelConfig, key)
    return f"turn off ({about})" if _annotation(key) is bool else about


def add_layout_flags(parser: argparse.ArgumentParser, keys=FLAG_KEYS, what: str = "") -> None:
    """Add the flags of these `[parallel]` keys, in a group saying `what` they do (dest: the key; None when not
    given)."""
    parser = parser.add_argument_group("layout", what or None)
    for key in keys:
        annotation = _annotation(key)
        about = LazyHelp(lambda key=key: flag_help(key))  # (made on --help only)
        if annotation is bool:
            parser.add_argument(*flag_names(key), dest=key, action="store_false", default=None, help=about)
            continue
        literal = get_origin(annotation) is Literal  # (its choices in the help, checked where the setting is)
        parser.add_argument(*flag_names(key), dest=key, default=None, type=str if literal else annotation,
                            metavar=key.split("_")[-1].upper(), help=about)


def layout_flags(args: argparse.Namespace, keys=FLAG_KEYS) -> dict:
    """{[parallel] key: value} of the flags given (added by `add_layout_flags`); UserError for a degree < 1."""
    given = {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}
    for key, value in given.items():
        if _annotation(key) is int and key in LAYOUT_KEYS and value < 1 and not (key == "dp_shard" and value == -1):
            rest = ", or -1 for the rest of the world" if key == "dp_shard" else ""
            raise UserError(f"{flag_names(key)[0]} must be >= 1{rest}, got {value}")
    return given


def with_layout_flags(parallel, args: argparse.Namespace, keys=FLAG_KEYS):
    """The `[parallel]` section with the flags given written over it."""
    return dataclasses.replace(parallel, **layout_flags(args, keys))
