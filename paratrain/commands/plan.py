"""`paratrain plan`: rank parallel layouts by predicted step time, write the best as a config and a launch command.

The command line: its arguments read into a typed `PlanRequest` (`request_from`; the planning itself is
paratrain/estimate/planner.py's), the best layout written out (`write_outputs`), and the printed plan (`plan_lines`)
or JSON document (`plan_json`; docs/estimate-and-plan.md).

    paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576
    paratrain plan --calibrate --name mybox --nproc 4        # measure this machine; later: --gpu mybox
    paratrain plan ... --explain fsdp,tp=2,ac=full,mb=1     # why a layout is rejected, or how it ranks
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

from paratrain import capabilities
from paratrain.capabilities import CAPABILITIES, OPTIMIZER_NAMES
from paratrain.commands.recipe_flags import add_recipe_flags, add_section_flags, with_section_flags
from paratrain.config import Config, dump_toml, validate
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.estimate.gpus import fmt_bytes, limit_text
from paratrain.estimate.hetero import even_split_layout, parse_gpus, read_cluster, stage_hardware
from paratrain.estimate.planner import (PLAN_FLAG_KEYS, Planning, PlanRequest, checked_choices, micro_batch_sizes,
                                        plan_context)
from paratrain.estimate.report import tiers_text
from paratrain.estimate.search import AC_MODES, PLANNED_SCHEDULES, staging_dropped_line
from paratrain.layout_grammar import add_layout_flags, layout_flags
from paratrain.models.presets import count_params
from paratrain.modes import DP_MODES, PRECISIONS
from paratrain.preflight import check_nproc
from paratrain.spec import model_from

# The plan's objects (hundreds of thousands, none in a reference cycle) live until the program ends: its exit need
# not collect them (paratrain/cli.py; ~0.1-0.2 s of a large plan)
OBJECTS_LIVE_TO_EXIT = True


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="paratrain plan", description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="a preset name or a config TOML (its [model] section)")
    p.add_argument("--vocab-size", type=int, default=128, help="for presets that take the vocabulary from the data")
    p.add_argument("--gpus", help="number of GPUs (ranks) in all, or GPU groups in rank order for a heterogeneous "
                   "cluster: 8xH100,8xA100 (each a GPU name or a saved profile)")
    p.add_argument("--cluster", help="a heterogeneous cluster as a TOML file of [[group]] tables (gpu, count, "
                   "optionally gpus_per_node, intra), in rank order")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="H100", help="GPU name from the table, or a saved calibration profile name")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 40GiB: instead of the --gpu's (a GPU partly used by "
                   "others, a variant the table lacks)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="plan for training.compile=true (compiled blocks; default: the --model config's setting)")
    for cap in CAPABILITIES:
        if cap.plan_flag is not None:
            p.add_argument(cap.plan_flag.flag, action="store_true", help=cap.plan_flag.help)
    p.add_argument("--json", action="store_true", help="the plan as one JSON document (docs/estimate-and-plan.md)")
    p.add_argument("--intra", help="intra-node link: nvlink | pcie4 | pcie5 (default: the GPU's usual one)")
    p.add_argument("--inter", help="inter-node link: ib400 (default) | ib200 | eth100 | eth25")
    p.add_argument("--inter-node-bandwidth", help="a node's link to the others, e.g. 1Gbit, 10Gbit, 25GB/s (over "
                   "--inter, shared by the node's GPUs); also ranks local SGD across nodes (a replica per node) among the "
                   "layouts where it is much faster; it changes the training: docs/layouts.md")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 512 sequences or 4Mi tokens, whichever is smaller)")
    p.add_argument("--precision", default=None, help=f"{' | '.join(PRECISIONS)} (default: bf16 on GPUs, fp32 on a "
                   "CPU profile)")
    add_recipe_flags(p, only=("training.tf32",))  # (the --model config's, else unset)
    p.add_argument("--headroom", type=float, default=None, help="fraction of device memory kept free (0.10, as "
                   "paratrain estimate: the allocator's fragmentation and NCCL buffers)")
    p.add_argument("--host-memory", help="host memory per node, e.g. 512GiB: checks what CPU offload and activation "
                   "offloading put there (default: not checked)")
    p.add_argument("--no-memory-tiers", action="store_true", help="never propose the chunked loss, activation "
                   "offloading or CPU offload (by default tried when no layout fits without them)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--dp-modes", help=f"comma-separated subset of {','.join(DP_MODES)}")
    p.add_argument("--checkpointing", help=f"comma-separated subset of {','.join(AC_MODES)}")
    p.add_argument("--micro-batches", help="comma-separated micro-batch sizes to try (default 1,2,4,8,16)")
    p.add_argument("--schedules", help=f"comma-separated pipeline schedules (default {','.join(PLANNED_SCHEDULES)})")
    p.add_argument("--optimizer", default=None, help=" | ".join(OPTIMIZER_NAMES) + ": its state per rank and its step "
                   "(default: the --model config's, else adamw)")
    add_layout_flags(p, PLAN_FLAG_KEYS, "each fixes that setting of every planned layout (--grad-compression: plans "
                     "the layouts it applies to, with its bytes and compute; docs/optimizers.md)")

    add_section_flags(p, "plan")  # (keys of the capabilities' own sections: Capability.section_flags)
    p.add_argument("--max-tp", type=int)
    p.add_argument("--max-pp", type=int)
    p.add_argument("--max-cp", type=int, help="largest context-parallel degree to try (default: any that leaves each "
                   "rank 1024 tokens or more of a sequence)")
    p.add_argument("--out", default="plan", help="folder for the best layout's config.toml and launch script")
    p.add_argument("--no-write", action="store_true", help="print the plan only")
    p.add_argument("--overwrite", action="store_true", help="replace the plan an earlier run wrote into --out")
    p.add_argument("--check", action="store_true", help="build the first choice's layout here (paratrain train "
                   "--dry-run: fake process group, meta device) and compare its model states with the estimate")
    p.add_argument("--explain", metavar="LAYOUT", help="why LAYOUT (as printed, e.g. fsdp,tp=2,ac=full,mb=1) is "
                   "rejected, or how it ranks")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and save a profile (with --model: "
                   "also at that model's shapes, --seq and --micro-batches)")
    p.add_argument("--calibrate-modes", help="execution modes to time a block in: eager,compile (default: both on "
                   "CUDA, eager on a CPU)")
    p.add_argument("--calibrate-tp", type=int, default=1, help="tensor-parallel degree of the shapes to calibrate")
    p.add_argument("--calibrate-seconds", type=float, default=0.25, help="time spent on each measurement (longer: "
                   "steadier numbers)")
    p.add_argument("--name", default="local", help="profile name for --calibrate")
    p.add_argument("--nproc", type=int, default=None, help="local ranks for --calibrate (default: GPUs, or 4)")
    p.add_argument("--profile-dir", help="where profiles live (default ~/.cache/paratrain/profiles)")
    return p


def request_from(args) -> tuple[PlanRequest, Config | None]:
    """The plan the parsed arguments ask for (typed values), and the --model config (None for a preset)."""
    if args.gpus is not None and args.cluster:
        raise UserError("give --gpus or --cluster, not both")
    gpus = read_cluster(args.cluster) if args.cluster else _gpus(args.gpus)
    name, margs, base = model_from(args.model, args.vocab_size)
    trained = base.training if base is not None else None  # the config's settings are the defaults
    switched = {cap.plan_flag.setting: cap.plan_flag.value for cap in CAPABILITIES  # (a shorthand flag)
                if cap.plan_flag is not None and getattr(args, cap.plan_flag.key)}
    request = PlanRequest(
        margs, gpus, model_name=name, gpus_per_node=args.gpus_per_node, gpu=args.gpu, gpu_memory=args.gpu_memory,
        intra=args.intra, inter=args.inter, inter_node_bandwidth=args.inter_node_bandwidth, profile_dir=args.profile_dir, seq=args.seq,
        global_batch_tokens=args.global_batch_tokens, precision=args.precision,
        compile=args.compile if args.compile is not None else bool(trained is not None and trained.compile),
        tf32=args.tf32 if args.tf32 is not None else trained.tf32 if trained is not None else None,
        optimizer=args.optimizer or (base.optimizer.name if base is not None else "adamw"),
        capabilities=_section_capabilities(args, base), parallel=layout_flags(args, PLAN_FLAG_KEYS),
        dp_modes=_items(args.dp_modes), schedules=_items(args.schedules), checkpointing=_items(args.checkpointing),
        micro_batches=_items(args.micro_batches, _integer), max_tp=args.max_tp, max_pp=args.max_pp,
        max_cp=args.max_cp, headroom=args.headroom, host_memory=args.host_memory,
        memory_tiers=not args.no_memory_tiers)
    return dataclasses.replace(request, **switched), base


def _gpus(text: str | None):
    """--gpus: a number of GPUs, GPU groups in rank order (8xH100,8xA100), or None when not given."""
    if text is None:
        return None
    return parse_gpus(text) or int(text)


def _items(text: str | None, cast=str) -> tuple | None:
    """A comma-separated option's items (checked where they are used), or None when not given."""
    return None if text is None else tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def _integer(x: str) -> int:
    """One item of --micro-batches."""
    try:
        return int(x)
    except ValueError:
        raise UserError(f"--micro-batches: '{x}' is not an integer") from None


def _section_capabilities(args, base) -> tuple:
    """The capabilities of sections of their own that the plan runs: their section flags given over the --model
    config's sections, else its or the defaults' (Capability.section_flags)."""
    cfg = with_section_flags(copy.deepcopy(base) if base is not None else Config(), args, "plan")
    return tuple(c for cls in CAPABILITIES if any("plan" in f.helps for f in cls.section_flags)
                 for c in (cls.from_config(cfg),) if c is not None)


def config_for(c, ctx, base=None, model_spec: str | None = None):
    """A paratrain Config that runs candidate `c` (validated by load_config's rules)."""

    cfg = base if base is not None else Config()
    if base is None and model_spec is not None:
        cfg.model.preset = model_spec
    # Every degree written out (no dp_shard=-1): the file names its layout and world size, so `paratrain estimate
    # --model plan/config.toml` estimates the planned layout and the trainer refuses another world size. A
    # heterogeneous cluster's layout carries its uneven split. The memory tiers as the plan estimated them.
    c.recipe.to_config(cfg)
    t, p = cfg.training, cfg.parallel
    t.global_batch, t.accum_steps = ctx.global_seqs, 1  # (the accumulation follows from the global batch)
    if ctx.native_max_seq_len:  # planned beyond the preset's context: the config says so
        cfg.model.max_seq_len = ctx.args.max_seq_len
    if ctx.hw.device == "cpu":
        t.device = "cpu"
    if ctx.cluster:  # which GPU type each pipeline rank runs on

        p.pp_stage_gpus = ",".join(h.name for h in stage_hardware(ctx.cluster, c.layout.pp))
    validate(cfg)
    return cfg


def job_name(layout) -> str:
    """A short Slurm job name for a layout, only [A-Za-z0-9._-]: `paratrain-pp4-zero2x2-cp2-tp4` (pipeline stages,
    the data-parallel mode x its degree (hsdp: replicas x shards), then cp, tp and ep where > 1)."""
    import re

    bits = [f"pp{layout.pp}"] if layout.pp > 1 else []
    if layout.dp > 1:
        bits.append(f"{layout.dp_mode}{layout.dp_replicate}x{layout.dp_shard}" if layout.hybrid
                    else f"{layout.dp_mode}x{layout.dp}")
    bits += [f"{name}{degree}" for name, degree in (("cp", layout.cp), ("tp", layout.tp), ("ep", layout.ep))
             if degree > 1]
    return re.sub(r"[^A-Za-z0-9._-]", "", "-".join(["paratrain", *bits] if bits else ["paratrain", "1rank"]))


def launch_command(c, ctx, world: int, config_path: str) -> tuple[str, str | None]:
    """(command line, sbatch script or None)."""
    gpn = ctx.gpus_per_node
    nodes = max(1, world // gpn)
    if ctx.hw.device == "cpu":
        return f"paratrain train --nproc {world} --config {config_path}", None
    if ctx.cluster:  # one torchrun per node, node ranks in the groups' order (the stages' GPU types follow it)
        lines, node = [], 0
        total = sum(g.count // g.gpus_per_node for g in ctx.cluster)
        for g in ctx.cluster:
            for _ in range(g.count // g.gpus_per_node):
                lines.append(f"# node {node} ({g.name}): torchrun --nnodes {total} --node-rank {node} "
                             f"--nproc-per-node {g.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HEAD:29500 "
                             f"-m paratrain train --config {config_path}")
                node += 1
        return "\n".join(lines), None
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {world} -m paratrain train --config {config_path}", None
    script = f"""#!/bin/bash
#SBATCH --job-name={job_name(c.layout)}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpn}
#SBATCH --exclusive
# layout: {c.name}
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes {nodes} --nproc-per-node {gpn} \\
  --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \\
  -m paratrain train --config {config_path}
"""
    return "sbatch plan.sbatch", script


PLAN_FILES = ("config.toml", "plan.sbatch")


def check_out(out: Path, overwrite: bool) -> None:
    """--out is a folder this plan may write its files into: never over an earlier plan without --overwrite."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    earlier = [name for name in PLAN_FILES if (out / name).exists()]
    if earlier and not overwrite:
        raise UserError(f"--out {out} already holds a plan ({', '.join(earlier)}): pass --overwrite to replace it, "
                        "or choose another --out")


def write_outputs(best, ctx, world: int, out_dir, base=None, model_spec=None) -> tuple[Path, str, Path | None]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(best.cand, ctx, base, model_spec)
    path = out / "config.toml"
    head = (f"# paratrain plan: {best.cand.name} ({best.cand.describe()}) on {world} x {ctx.hw.name}\n"
            f"# predicted {best.pred.tokens_per_s:,.0f} tokens/s, MFU {best.pred.mfu:.1%}; set [data] to your corpus\n")
    path.write_text(head + dump_toml(cfg))
    cmd, script = launch_command(best.cand, ctx, world, str(path))
    sb = None
    if (out / "plan.sbatch").exists():  # from an earlier plan (--overwrite): it would launch another layout
        (out / "plan.sbatch").unlink()
    if script:
        sb = out / "plan.sbatch"
        sb.write_text(script)
        cmd = f"sbatch {sb}"
    return path, cmd, sb


def format_table(results, ctx, notes: dict | None = None) -> str:
    """The ranked rows; `notes`: {row index: what a capability's row says} (a note column when any)."""
    hosted = any(r.estimate is not None and r.estimate.host_bytes for r in results)
    w = max([44] + [len(r.cand.name) for r in results])
    head = (f"{'#':>2} {'layout':<{w}} {'tokens/s':>12} {'MFU':>6} {'mem/rank':>10} "
            + (f"{'host/rank':>10} " if hosted else "")
            + f"{'step':>9} {'compute':>9} {'exp.comm':>9} {'bubble':>8} {'recomp':>8}" + ("  note" if notes else ""))
    lines = [head]
    for i, r in enumerate(results, 1):
        p = r.pred
        ms = lambda s: f"{s * 1e3:.1f}ms" if s < 10 else f"{s:.2f}s"  # noqa: E731
        host = f"{fmt_bytes(r.estimate.host_bytes) if r.estimate is not None else '-':>10} " if hosted else ""
        lines.append(f"{i:>2} {r.cand.name:<{w}} {p.tokens_per_s:>12,.0f} {p.mfu:>6.1%} "
                     f"{fmt_bytes(r.total_bytes) if r.total_bytes is not None else '-':>10} {host}{ms(p.step_s):>9} "
                     f"{ms(p.compute_s):>9} {ms(p.comm_exposed_s):>9} {ms(p.bubble_s):>8} {ms(p.recompute_s):>8}"
                     + (f"  {notes[i - 1]}" if notes and i - 1 in notes else ""))
    return "\n".join(lines)


def with_rows(p, alternatives, top: int):
    """The plan with the capabilities' rows (`Capability.plan_alternative`) ranked among its `top` fastest by
    predicted step time (a tie: the plain row first): (that plan, rows to show, {row index: note}, {row index: JSON
    keys})."""
    rows = [row for a in alternatives for row in a.rows]
    if not rows:
        return p, top, None, {}
    merged = sorted([(r, None) for r in p.ranked[:top]] + [(row.result, row) for row in rows],
                    key=lambda pair: pair[0].pred.step_s)
    added = {i: row for i, (_, row) in enumerate(merged) if row is not None}
    return (dataclasses.replace(p, ranked=[r for r, _ in merged]), len(merged),
            {i: row.note for i, row in added.items()}, {i: row.json for i, row in added.items()})


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.calibrate:
        return calibrate_main(args, argv)
    request, base = request_from(args)
    planning = plan_context(request)
    if not args.no_write and not args.explain:
        check_out(Path(args.out), args.overwrite)
    if args.explain:
        print(planning.explain(args.explain))
        return 0
    started = time.perf_counter()
    p = planning.plan(args.top)
    # the capabilities' alternatives to the plain plan, their rows ranked among its (local SGD with
    # --inter-node-bandwidth over several nodes)
    alternatives = [a for c in CAPABILITIES if (a := c.plan_alternative(request, planning, p)) is not None]
    p, top, notes, row_keys = with_rows(p, alternatives, args.top)
    elapsed = time.perf_counter() - started
    ctx, world, best = planning.ctx, planning.world, p.ranked[0]
    model_spec = None if base else args.model
    written = None
    if not args.no_write:
        path, cmd, sb = write_outputs(best, ctx, world, args.out, base, model_spec)
        written = {"config": str(path), "launch": cmd, "sbatch": str(sb) if sb else None}
    check = None
    if args.check:  # the first choice built for real, one rank per pipeline stage
        from paratrain.training.dryrun import dry_run  # lazy: builds the layout with torch

        check = dry_run(config_for(best.cand, ctx, base, model_spec), world)
    if args.json:
        out = plan_json(p, ctx, world, elapsed, written, top, check, row_keys)
        print(json.dumps({**out, **{a.key: a.as_json() for a in alternatives}}, indent=2))
        return 0 if check is None or check.agrees else 1
    print("\n".join(plan_lines(p, planning, elapsed, top, notes) + [line for a in alternatives for line in a.lines()]))
    if written:
        print(f"wrote {written['config']}" + (f" and {written['sbatch']}" if written["sbatch"] else ""))
        print(f"launch: {written['launch']}")
    if check is not None:
        from paratrain.training.dryrun import format_dry_run  # lazy: (loaded with the dry run above)

        print(format_dry_run(check))
    sys.stdout.flush()
    return 0 if check is None or check.agrees else 1


def plan_lines(p, planning: Planning, elapsed: float, top: int, notes: dict | None = None) -> list[str]:
    """The printed plan: what was planned, the table of the fastest layouts (`notes`: format_table's) and the first
    choice's details."""
    ctx, world, opts = planning
    hw, best = ctx.hw, p.ranked[0]
    rate = f" (matmuls at the {ctx.math()} peak, {hw.peak(ctx.math()) / 1e12:,.4g} TFLOP/s)" if hw.peaks else ""
    where = (" + ".join(f"{g.count} x {g.name}" for g in ctx.cluster) if ctx.cluster else f"{world} x {hw.name}")
    lines = [f"plan: {ctx.model_name} on {where} ({hw.source}; {ctx.gpus_per_node} per node, "
             f"intra {hw.intra.name}" + (f", inter {hw.inter.name}" if hw.inter and world > ctx.gpus_per_node else "")
             + f"), seq {ctx.seq_len}, {ctx.global_seqs} sequences = {ctx.global_seqs * ctx.seq_len:,} tokens per "
             f"step, {ctx.precision}{rate}, {ctx.mode}" + "".join(f", {c.plan_label}" for c in ctx.capabilities if c.plan_label)]
    lines += [note for note in (c.plan_note(ctx.args) for c in ctx.capabilities) if note]
    if ctx.native_max_seq_len:
        lines.append(f"note: --seq {ctx.seq_len} is longer than {ctx.model_name}'s max_seq_len "
                     f"{ctx.native_max_seq_len}: planned as long-context training (model.max_seq_len={ctx.seq_len} in "
                     "the written config)")
    lines.append(f"{p.considered} layouts considered: {len(p.rejected)} rejected, {len(p.ranked)} fit among the "
                 f"fastest predicted (memory: paratrain estimate, {limit_text(hw.memory_bytes, opts.headroom)}); "
                 f"planned in {elapsed:.2f} s")
    lines.append(format_table(p.ranked[:top], ctx, notes))
    # (a capability's row ranked first: its note says how it trains, e.g. its synchronisation and its interval)
    lines.append(f"best: {best.cand.describe()}" + (f" with {notes[0]}" if notes and 0 in notes else "")
                 + f" -- {best.pred.breakdown()}")
    lines += [line for line in (staging_dropped_line(best, ctx),) if line]
    if best.cand.switched:
        lines.append(f"memory tiers (no layout fits without them): {tiers_text(best.estimate.inputs)}; host memory "
                     f"{fmt_bytes(best.estimate.host_bytes)} per rank, {fmt_bytes(best.estimate.host_node_bytes)} per "
                     "node" + ("" if ctx.host_memory_bytes else " (not checked: give --host-memory)"))
    if best.stage_hw:
        split = best.cand.layout.pp_split
        lines.append("stages: " + ", ".join(f"{r}: {split[r]} blocks on {h.name}" for r, h in enumerate(best.stage_hw))
                     + f"; the even split {','.join(map(str, _even(best, ctx)))} is predicted "
                     f"{best.even.step_s / best.pred.step_s - 1:+.0%} slower ({best.even.tokens_per_s:,.0f} tokens/s)")
    return lines


def calibrate_main(args, argv: list[str]) -> int:
    """`paratrain plan --calibrate`: measure this machine into a saved profile and print what was measured."""
    # lazy: calibration runs torch and launches ranks; planning itself is torch-free
    import torch

    from paratrain.calibration import calibrate

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 4)
    check_nproc("auto", nproc, oversubscribe=None)
    model_given = any(a == "--model" or a.startswith("--model=") for a in argv)
    margs = model_from(args.model, args.vocab_size)[1] if model_given else None
    mbs = micro_batch_sizes(_items(args.micro_batches, _integer)) or (1, 2)
    modes = checked_choices(_items(args.calibrate_modes), ("eager", "compile"), "--calibrate-modes")
    if not 0 < args.calibrate_seconds <= 60:
        raise UserError(f"--calibrate-seconds must be in (0, 60], got {args.calibrate_seconds}")
    hw, path = calibrate(args.name, nproc, args.profile_dir, seconds=args.calibrate_seconds, model=margs,
                         seq=args.seq, micro_batches=mbs, tp=args.calibrate_tp, modes=modes)
    if args.json:
        print(json.dumps({"profile": str(path), **hw.to_json()}, indent=2))
        return 0
    print(f"profile '{hw.name}' ({hw.source}) saved to {path}")
    if hw.shapes:
        print("  at the model's shapes: " + "; ".join(f"{k} {v * 1e3:.3f} ms" for k, v in hw.shapes.items()))
        print("  execution modes (factor on the non-matmul time): "
              + ", ".join(f"{m} {f:.2f}" for m, f in hw.modes.items()))
    print("  matmul: " + ", ".join(f"{(f / 2) ** (1 / 3):.0f}^3 {r / 1e9:.2f} GFLOP/s" for f, r in hw.gemm))
    print(f"  memory bandwidth {hw.mem_bandwidth / 1e9:.2f} GB/s, per-operator overhead "
          f"{hw.op_overhead_s * 1e6:.1f} us; compute scale {hw.compute_scale:.2f} (reference model step, measured / "
          "predicted)")
    print(f"  collectives over {nproc} ranks: latency {hw.intra.latency * 1e6:.1f} us per step, bandwidth "
          f"{hw.intra.bandwidth / 1e9:.2f} GB/s (alpha-beta fit of all-reduce and all-gather); reduce-scatter "
          f"x{hw.intra.reduce_scatter_factor:.2f} the ring formula")
    print(f"  plan with: paratrain plan --gpu {hw.name} --gpus {nproc} --gpus-per-node {nproc}"
          + (f" --profile-dir {args.profile_dir}" if args.profile_dir else "") + " ...")
    return 0


def _even(r, ctx) -> tuple[int, ...]:
    """The even split a heterogeneous plan is compared with (the one `plan_hetero` predicted)."""

    return even_split_layout(r.cand.layout, ctx.args).pp_split


def _prediction_json(pred) -> dict:
    return {"step_s": pred.step_s, "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu, "compute_s": pred.compute_s,
            "exposed_comm_s": pred.comm_exposed_s, "bubble_s": pred.bubble_s, "recompute_s": pred.recompute_s,
            "optimizer_s": pred.optimizer_s, "compress_s": pred.compress_s,
            "exposed_comm_by_kind_s": dict(pred.comm),
            "fsdp_all_gathers_per_step": pred.fsdp_all_gathers, "dp_bytes_per_step": pred.dp_bytes,
            **({"phases": [{"phase": name, "step_s": step, "dp_bytes_per_step": sent}
                           for name, step, sent in pred.phases]} if pred.phases else {})}


def plan_json(p, ctx, world: int, elapsed: float, written: dict | None, top: int = 5, check=None,
              row_keys: dict | None = None) -> dict:
    """The plan as one JSON document (`paratrain plan --json`; the schema is in docs/estimate-and-plan.md), with the
    first choice's dry run (`--check`) when given; `row_keys`: {row index: the keys a capability's row adds}."""

    def layout_json(r) -> dict:
        lay = r.cand.layout
        out = {"name": r.cand.name, "description": r.cand.describe(), "dp_mode": lay.dp_mode,
               "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep,
               "cp": lay.cp,
               "pp_schedule": lay.pp_schedule if lay.pp > 1 else None,
               "pp_microbatches": lay.pp_microbatches if lay.pp > 1 else None,
               "pp_virtual_stages": lay.pp_virtual if lay.pp > 1 else None,
               "pp_split": list(lay.pp_split) if (lay.pp > 1 and lay.pp_split) else None,
               "activation_checkpoint": r.cand.ac, "micro_batch": r.cand.micro_batch,
               "memory_tiers": capabilities.switched_on(r.cand.switched),
               "predicted": _prediction_json(r.pred), "memory_bytes_per_rank": r.total_bytes,
               "host_bytes_per_rank": r.estimate.host_bytes if r.estimate is not None else None}
        if r.stage_hw:
            out["stages"] = [{"pp_rank": i, "gpu": h.name, "blocks": lay.pp_split[i],
                              "memory_bytes": next((s["total_bytes"] for s in r.estimate.stages if s["stage"] == i),
                                                   None)} for i, h in enumerate(r.stage_hw)]
            out["even_split"] = {"pp_split": list(_even(r, ctx)), "predicted": _prediction_json(r.even)}
        return out

    hw = ctx.hw
    doc = {
        "model": ctx.model_name, "parameters": count_params(ctx.args), "gpus": world,
        "gpu": None if ctx.cluster else hw.name,
        "cluster": [{"gpu": g.name, "count": g.count, "gpus_per_node": g.gpus_per_node} for g in ctx.cluster]
        if ctx.cluster else None,
        "profile_source": hw.source, "gpus_per_node": ctx.gpus_per_node, "seq_len": ctx.seq_len,
        "global_batch_sequences": ctx.global_seqs, "tokens_per_step": ctx.global_seqs * ctx.seq_len,
        "precision": ctx.precision, "tf32": ctx.tf32, "matmul_math": ctx.math(), "execution_mode": ctx.mode,
        **{cap.plan_flag.key: any(isinstance(c, cap) for c in ctx.capabilities)
           for cap in CAPABILITIES if cap.plan_flag is not None},
        "grad_compression": ctx.compression.method, "optimizer": ctx.optimizer,
        "considered": p.considered, "rejected": len(p.rejected), "planning_seconds": elapsed,
        "ranked": [{**layout_json(r), **(row_keys or {}).get(i, {})} for i, r in enumerate(p.ranked[:top])],
        "written": written,
    }
    if check is not None:
        doc["check"] = {"agrees": check.agrees, "seconds": check.seconds,
                        "ranks": [{"rank": r.rank, "built": r.built, "estimated": r.estimated,
                                   "difference": r.difference} for r in check.ranks]}
    return doc
