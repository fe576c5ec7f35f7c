"""The layout grammar (paratrain/layout_grammar.py) and the choices (paratrain/modes.py): a layout's name and its
`[parallel]` section both give back the same layout, the flags cover every layout setting, and each mode's tables
cover its choices. In-process and torch-free but for the tables' torch names."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from paratrain.capabilities.segment_checkpointing import SegmentCheckpointing
from paratrain.config import Config, ParallelConfig, load_config
from paratrain.errors import UserError
from paratrain.layout import CONFIG_KEYS, Layout
from paratrain.layout_grammar import FLAG_KEYS, LAYOUT_KEYS, NOT_FLAGS, layout_name, parse_layout_name
from paratrain.modes import (CHECKPOINT_MODES, PRECISIONS, WEIGHT_DTYPES, Precision, Schedule, checkpointing_label,
                             parse_checkpointing_label)
from paratrain.estimate.planner import PlanRequest, plan_context
from paratrain.estimate.search import candidates, parse_layout

PLANS = {  # (what is planned, items its layouts' names hold): hsdp replicas, cp, tp, pipelines with v=3, experts
    "dense": (PlanRequest("llama3-8b", gpus=32, gpu="H100", seq=8192, global_batch_tokens=8192 * 64,
                          micro_batches=(1, 2), max_pp=2),
              {"rep", "cp", "tp", "pp", "sched", "v", "ac", "mb"}),
    "moe": (PlanRequest("tiny-moe", gpus=8, gpu="H100", seq=256, global_batch_tokens=256 * 32), {"ep", "ac", "mb"}),
}


@pytest.mark.parametrize("req, items", PLANS.values(), ids=PLANS.keys())
def test_every_planned_name_parses_back_to_its_candidate_and_config(req, items):
    ctx, world, opts = plan_context(req)
    cands = candidates(ctx, world, opts)
    named = {item.split("=")[0] for c in cands for item in c.name.split(",")[1:]}
    assert named >= items, named
    for c in cands:
        assert parse_layout(c.name, ctx, world) == c, c.name
        assert Layout.from_config(c.layout.to_config(ParallelConfig()), world) == c.layout, c.name


def test_switches_and_modes_in_names():
    lay = Layout.resolve(4, dp_mode="zero3", tp=2, sequence_parallel=False, loss_parallel=False)
    name = layout_name(lay, "every_k", 3, 2)
    assert name == "fsdp,tp=2,sp=off,lp=off,ac=every_k3,mb=2"
    named = parse_layout_name(name)
    assert named.layout(4) == lay and named.settings == {"checkpointing": "every_k", "every_k": 3, "segment_blocks": 0,
                                                         "micro_batch": 2}
    assert layout_name(Layout.resolve(2, tp=2)) == "nodp,tp=2"
    piped = Layout.resolve(4, tp=2, pp=2, loss_parallel=False)  # a pipeline has no loss parallelism to switch off
    assert layout_name(piped) == "nodp,tp=2,pp=2,sched=1f1b" and not piped.loss_parallel
    assert parse_layout_name("zero3").options["dp_mode"] == "fsdp"
    # segments: k written when set, alone for the default round(sqrt(n_layers))
    assert (layout_name(lay, "segments", 2, 2, switched=(SegmentCheckpointing(4),))
            == "fsdp,tp=2,sp=off,lp=off,ac=segments4,mb=2")
    assert (parse_layout_name("fsdp,ac=segments4").settings["segment_blocks"],
            parse_layout_name("fsdp,ac=segments").settings["segment_blocks"],
            parse_layout_name("fsdp,ac=segments").settings["checkpointing"]) == (4, 0, "segments")
    assert parse_layout_name("fsdp,tp=2").settings == {}  # (what a name does not give keeps a run's own)


def test_memory_tiers_in_names():
    """A plan's memory tiers are items of its name (loss=, and the capabilities' switches: actoff=all|every_kK,
    cpuoff=on), read back by --explain."""
    from paratrain.capabilities.activation_offload import ActivationOffload
    from paratrain.capabilities.cpu_offload import CpuOffload
    from paratrain.capabilities.chunked_loss import ChunkedLoss

    lay = Layout.resolve(4, dp_mode="fsdp", tp=2)
    for switched in ((ChunkedLoss(8), ActivationOffload("all"), CpuOffload()), (ActivationOffload("every_k", 3),),
                     ()):
        name = layout_name(lay, "full", 2, 1, switched=switched)
        named = parse_layout_name(name)
        assert named.switched == switched
        assert named.layout(4) == lay
        assert named.switch_values().get("memory.cpu_offload", False) is (CpuOffload() in switched)
    tiered = layout_name(lay, "full", 2, 1, switched=(ChunkedLoss(8), ActivationOffload("all"), CpuOffload()))
    assert tiered == "fsdp,tp=2,ac=full,mb=1,loss=8,actoff=all,cpuoff=on"
    # loss=1 names the whole logits (no chunked loss), automatic (0) is not written
    assert layout_name(lay, "full", 2, 1, switched=(ChunkedLoss(0),)) == "fsdp,tp=2,ac=full,mb=1"
    assert parse_layout_name("fsdp,loss=1").switched == ()
    assert parse_layout_name("fsdp,loss=1").switch_values() == {"memory.loss_chunks": 1}
    # actoff=none names the setting off (its keys' defaults over a run's own)
    assert parse_layout_name("fsdp,actoff=none").switch_values() == {"memory.activation_offload": "none",
                                                                     "memory.activation_offload_every_k": 2}


@pytest.mark.parametrize("text, words", [
    ("", "needs a layout"),
    ("fdsp,tp=2", "the first item must be a dp mode"),
    ("fsdp,tp=2,tp=4", "unknown or repeated item 'tp=4'"),
    ("fsdp,xx=3", "unknown or repeated item 'xx=3'"),
    ("fsdp,tp=two", "tp must be an integer >= 1, got 'two'"),
    ("fsdp,mb=0", "mb must be an integer >= 1"),
    ("fsdp,sp=on", "sp is on unless sp=off"),
    ("fsdp,pp=2,sched=zbw", "sched must be one of gpipe"),
    ("fsdp,ac=every_kx", "ac must be one of"),
    ("fsdp,ac=segments0", "segments with its blocks per segment: segments4"),
    ("fsdp,loss=0", "loss must be an integer >= 1"),
    ("fsdp,actoff=some", "actoff must be one of none, all, every_k"),
    ("fsdp,cpuoff=off", "cpuoff is off unless cpuoff=on"),
])
def test_bad_names_are_one_line(text, words):
    with pytest.raises(UserError) as e:
        parse_layout_name(text, "--explain")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_layout_and_config_map_both_ways_through_one_table():
    assert set(CONFIG_KEYS) == {f.name for f in dataclasses.fields(Layout)}
    assert set(CONFIG_KEYS.values()) <= {f.name for f in dataclasses.fields(ParallelConfig)}
    assert set(LAYOUT_KEYS) == set(CONFIG_KEYS.values())  # a flag for every layout setting (FLAGS)
    assert set(FLAG_KEYS) | set(NOT_FLAGS) == {f.name for f in dataclasses.fields(ParallelConfig)}  # one each
    hetero = Layout.resolve(8, pp=4, pp_split="3,3,1,1", pp_microbatches=8, pp_schedule="gpipe")
    section = hetero.to_config(ParallelConfig(grad_compression="bf16", pp_stage_gpus="a,a,b,b"))
    assert section.pp_split == "3,3,1,1" and section.grad_compression == "bf16" and section.pp_stage_gpus == "a,a,b,b"
    assert Layout.from_config(section, 8) == hetero


def test_verify_table_is_written_in_the_grammar():
    """Every `paratrain verify` layout resolves on its ranks, and its overrides give a config of that layout."""
    from paratrain.verify import LAYOUTS, layout_overrides

    for name, (nproc, text, *_) in LAYOUTS.items():
        _, overrides = layout_overrides(name)
        cfg = load_config(None, overrides)
        assert Layout.from_config(cfg.parallel, nproc) == parse_layout_name(text).layout(nproc), name


def test_every_choice_has_its_entries():
    """The tables keyed by a mode cover its choices: torch's schedule classes and dtypes, checkpointing labels."""
    import torch
    from torch.distributed.pipelining import schedules

    assert all(hasattr(schedules, s.torch_schedule_name) for s in Schedule)
    assert all(isinstance(getattr(torch, p.dtype_name), torch.dtype) for p in Precision)
    assert all(parse_checkpointing_label(checkpointing_label(m, 3)) == (m, 3 if m == "every_k" else 2)
               for m in CHECKPOINT_MODES)
    assert all(SegmentCheckpointing.parse_checkpointing_label(SegmentCheckpointing(k).checkpointing_label())
               == {"checkpointing": "segments", "every_k": 2, "segment_blocks": k} for k in (0, 4))
    hints = typing.get_type_hints(type(Config().checkpoint))
    # exports are written in a weight dtype: a training precision but fp8 (whose weights are fp32 master weights)
    assert typing.get_args(hints["export_hf_dtype"]) == WEIGHT_DTYPES == tuple(p for p in PRECISIONS if p != "fp8")
