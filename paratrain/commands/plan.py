"""`paratrain plan`: rank parallel layouts by predicted step time, write the best as a config and a launch command.

The command line: its arguments, the planning context (`build_context`) they make, the best layout written out
(`write_outputs`), and the printed table or JSON document (`plan_json`; docs/estimate-and-plan.md).

    paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576
    paratrain plan --calibrate --name mybox --nproc 4        # measure this machine; later: --gpu mybox
    paratrain plan ... --explain fsdp,tp=2,ac=full,mb=1     # why a layout is rejected, or how it ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from paratrain.commands.recipe_flags import add_recipe_flags
from paratrain.config import Config, LoRAConfig, ParallelConfig, dump_toml, validate
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.estimate.gpus import HEADROOM, check_headroom, fmt_bytes, limit_text, parse_memory
from paratrain.estimate.hardware import resolve_hardware
from paratrain.estimate.hetero import (MAX_GPUS, build_groups, even_split_layout, parse_gpus, plan_hetero,
                                       read_cluster, slowest_first, stage_hardware)
from paratrain.estimate.report import tiers_text
from paratrain.estimate.search import AC_MODES, PLANNED_SCHEDULES, Options, explain, plan
from paratrain.estimate.step_time import Context, trainable_count
from paratrain.layout import CONFIG_KEYS
from paratrain.layout_grammar import COMPRESSION_KEYS, LAYOUT_KEYS, add_layout_flags, layout_flags
from paratrain.models.lora_params import LoRA, lora_problem
from paratrain.models.presets import count_params, format_params
from paratrain.modes import DP_MODE_OPTIONS, DP_MODES, PRECISIONS, SCHEDULES, Compression, dp_mode_of, float8_matmuls
from paratrain.optimizers import OPTIMIZER_NAMES, optimizer_entry
from paratrain.preflight import check_nproc
from paratrain.spec import model_from

# The layout flags `paratrain plan` takes (paratrain/layout_grammar.py): each fixes that field of every planned
# layout; the blocks per stage and tp without sequence or loss parallelism are the planner's to choose.
PINNED_KEYS = tuple(k for k in LAYOUT_KEYS if k not in ("pp_split", "sequence_parallel", "loss_parallel"))
PLAN_FLAG_KEYS = (*PINNED_KEYS, *COMPRESSION_KEYS, "ddp_bucket_mb")


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
    p.add_argument("--float8", action="store_true", help="the same as --precision fp8 (float8 linear layers)")
    p.add_argument("--json", action="store_true", help="the plan as one JSON document (docs/estimate-and-plan.md)")
    p.add_argument("--intra", help="intra-node link: nvlink | pcie4 | pcie5 (default: the GPU's usual one)")
    p.add_argument("--inter", help="inter-node link: ib400 (default) | ib200 | eth100 | eth25")
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

    p.add_argument("--lora-rank", type=int, default=None, help="plan LoRA adapters of this rank on a frozen model "
                   "(default: the --model config's [lora])")
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


def _csv(text, allowed=None, cast=str, flag=""):
    if text is None:
        return None
    items = tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise UserError(f"{flag}: '{bad[0]}' is not one of {', '.join(allowed)}")
    if not items:
        raise UserError(f"{flag} is empty")
    return items


def build_context(args) -> tuple:
    """(Context, world, Options, base config or None) from parsed arguments; UserError on bad input."""

    if args.gpus is None and not args.cluster:
        raise UserError("--gpus N is required (the number of GPUs to plan for, or groups like 8xH100,8xA100)")
    if args.gpus is not None and args.cluster:
        raise UserError("give --gpus or --cluster, not both")
    if args.gpus_per_node < 1:
        raise UserError("--gpus-per-node must be >= 1")
    spec = read_cluster(args.cluster) if args.cluster else parse_gpus(args.gpus)
    if spec is not None and args.gpu_memory:
        raise UserError("--gpu-memory sets the memory of --gpu's GPUs; a heterogeneous cluster's come from its GPU "
                        "names or profiles")
    groups = None
    if spec is None:

        world = int(args.gpus)
        if world < 1:
            raise UserError("--gpus and --gpus-per-node must be >= 1")
        if world > MAX_GPUS:
            raise UserError(f"--gpus {world} is more than {MAX_GPUS} GPUs (a typo?); the planner enumerates the "
                            "layouts of at most that many")
        if world > args.gpus_per_node and world % args.gpus_per_node:
            raise UserError(f"--gpus {world} is not divisible by --gpus-per-node {args.gpus_per_node} "
                            "(whole nodes only)")
        hw = resolve_hardware(args.gpu, args.intra, args.inter, args.profile_dir)
        if args.gpu_memory:
            hw = dataclasses.replace(hw, memory_bytes=parse_memory(args.gpu_memory))
        per_node = min(args.gpus_per_node, world)
    else:
        groups = build_groups(spec, args.gpus_per_node, args.intra, args.inter, args.profile_dir)
        world = sum(g.count for g in groups)
        hw = slowest_first(groups)
        per_node = min(g.gpus_per_node for g in groups)
        if len(groups) == 1:
            groups = None  # one type: the ordinary planner

    headroom = check_headroom(HEADROOM if args.headroom is None else args.headroom)

    name, margs, base = model_from(args.model, args.vocab_size)
    seq = args.seq or min(margs.max_seq_len, 4096)
    if seq < 1:
        raise UserError(f"--seq must be >= 1, got {seq}")
    native = None
    if seq > margs.max_seq_len:  # a long-context stage: the model trained on longer sequences than its preset's
        native, margs = margs.max_seq_len, dataclasses.replace(margs, max_seq_len=seq)
    tokens = args.global_batch_tokens or min(4 * 2**20, 512 * seq)
    if tokens % seq:
        raise UserError(f"--global-batch-tokens {tokens} is not a multiple of --seq {seq}")
    precision = "fp8" if args.float8 else args.precision or ("fp32" if hw.device == "cpu" else "bf16")
    if precision not in PRECISIONS:
        raise UserError(f"--precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if float8_matmuls(precision):
        check_float8_cores([g.hw for g in groups] if groups else [hw])

    flags = layout_flags(args, PLAN_FLAG_KEYS)
    parallel = dataclasses.replace(ParallelConfig(), **flags)
    compression = Compression.from_config(parallel).check_flags()
    if parallel.ddp_bucket_mb <= 0:
        raise UserError(f"--ddp-bucket-mb must be > 0, got {parallel.ddp_bucket_mb}")
    compile_ = args.compile if args.compile is not None else bool(base is not None and base.training.compile)
    tf32 = args.tf32 if args.tf32 is not None else base.training.tf32 if base is not None else None
    entry = optimizer_entry(args.optimizer or (base.optimizer.name if base is not None else "adamw"))
    entry.check_compression(compression.method, "--grad-compression")
    optimizer = entry.name

    ctx = Context(margs, seq, tokens // seq, hw, per_node, precision, name, tf32, native_max_seq_len=native,
                  compression=compression, optimizer=optimizer,
                  ddp_bucket_mb=parallel.ddp_bucket_mb, mode="compile" if compile_ else "eager",
                  float8=float8_matmuls(precision),
                  cluster=groups, lora=_lora(args, base),
                  host_memory_bytes=parse_memory(args.host_memory) if args.host_memory else None)
    fixed = _fixed(flags)
    opts = Options(
        dp_modes=_one_or_csv(fixed.get("dp_mode"), "--dp-mode", args.dp_modes, "--dp-modes", DP_MODES),
        schedules=_one_or_csv(fixed.get("pp_schedule"), "--pp-schedule", args.schedules, "--schedules",
                              PLANNED_SCHEDULES, SCHEDULES),
        ac_modes=_csv(args.checkpointing, AC_MODES, flag="--checkpointing") or AC_MODES,
        micro_batches=_csv(args.micro_batches, cast=_posint, flag="--micro-batches"),
        max_tp=args.max_tp, max_pp=args.max_pp, max_cp=args.max_cp, headroom=headroom, fixed=fixed,
        memory_tiers=not args.no_memory_tiers)
    return ctx, world, opts, base


def _fixed(flags: dict) -> dict:
    """The Layout fields the layout flags fix (every planned layout has them): dp_shard -1 fixes nothing."""
    field_of = {key: field for field, key in CONFIG_KEYS.items()}
    fixed = {field_of[k]: v for k, v in flags.items() if k in PINNED_KEYS and not (k == "dp_shard" and v == -1)}
    if "dp_mode" in fixed:
        if fixed["dp_mode"] not in DP_MODE_OPTIONS:
            raise UserError(f"--dp-mode '{fixed['dp_mode']}' is not one of {', '.join(DP_MODE_OPTIONS)}")
        fixed["dp_mode"] = dp_mode_of(fixed["dp_mode"])
    if "pp_schedule" in fixed and fixed["pp_schedule"] not in SCHEDULES:
        raise UserError(f"--pp-schedule '{fixed['pp_schedule']}' is not one of {', '.join(SCHEDULES)}")
    return fixed


def _one_or_csv(one, one_flag: str, text, flag: str, default: tuple, allowed: tuple | None = None) -> tuple:
    """A layout flag's one value, or the comma-separated choices to search (`default` when neither is given)."""
    if one is not None and text is not None:
        raise UserError(f"give {one_flag} or {flag}, not both")
    if one is not None:
        return (one,)
    return _csv(text, allowed or default, flag=flag) or default


def _lora(args, base):
    """The adapters planned: --lora-rank (with the config's other [lora] keys), else the --model config's."""

    section = dataclasses.replace(base.lora) if base is not None else LoRAConfig()
    if args.lora_rank is not None:
        section.rank = args.lora_rank
    why = lora_problem(section)
    if why:
        raise UserError(why.replace("lora.rank", "--lora-rank"))
    return LoRA.from_config(section)


def context_from_argv(argv: list[str]) -> tuple:
    """build_context for `paratrain plan` arguments (tests and benchmarks)."""
    return build_context(_parser().parse_args(list(argv)))


def _posint(x: str) -> int:
    try:
        v = int(x)
    except ValueError:
        raise UserError(f"--micro-batches: '{x}' is not an integer") from None
    if v < 1:
        raise UserError("--micro-batches must be >= 1")
    return v


def config_for(c, ctx, base=None, model_spec: str | None = None):
    """A paratrain Config that runs candidate `c` (validated by load_config's rules)."""

    cfg = base if base is not None else Config()
    if base is None and model_spec is not None:
        cfg.model.preset = model_spec
    # Every degree written out (no dp_shard=-1): the file names its layout and world size, so `paratrain estimate
    # --model plan/config.toml` estimates the planned layout and the trainer refuses another world size. A
    # heterogeneous cluster's layout carries its uneven split. The memory tiers as the plan estimated them.
    c.recipe(ctx).to_config(cfg)
    t, p = cfg.training, cfg.parallel
    t.global_batch, t.accum_steps = ctx.global_seqs, 1  # (the accumulation follows from the global batch)
    if ctx.native_max_seq_len:  # planned beyond the preset's context: the config says so
        cfg.model.max_seq_len = ctx.args.max_seq_len
    if ctx.hw.device == "cpu":
        t.device = "cpu"
    p.ddp_bucket_mb = ctx.ddp_bucket_mb
    if ctx.cluster:  # which GPU type each pipeline rank runs on

        p.pp_stage_gpus = ",".join(h.name for h in stage_hardware(ctx.cluster, c.layout.pp))
    t.compile = ctx.mode == "compile"
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


def check_float8_cores(hardware: list) -> None:
    """--precision fp8 on GPUs without FP8 tensor cores (before Ada/Hopper): one line naming the first."""
    for hw in hardware:
        if not hw.float8_gemm:
            raise UserError(f"--precision fp8 needs FP8 tensor cores (H100, H200, L4, L40S, RTX 4090, ...); {hw.name} "
                            "has none: plan bf16")


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


def format_table(results, ctx) -> str:
    hosted = any(r.estimate is not None and r.estimate.host_bytes for r in results)
    w = max([44] + [len(r.cand.name) for r in results])
    head = (f"{'#':>2} {'layout':<{w}} {'tokens/s':>12} {'MFU':>6} {'mem/rank':>10} "
            + (f"{'host/rank':>10} " if hosted else "")
            + f"{'step':>9} {'compute':>9} {'exp.comm':>9} {'bubble':>8} {'recomp':>8}")
    lines = [head]
    for i, r in enumerate(results, 1):
        p = r.pred
        ms = lambda s: f"{s * 1e3:.1f}ms" if s < 10 else f"{s:.2f}s"  # noqa: E731
        host = f"{fmt_bytes(r.estimate.host_bytes) if r.estimate is not None else '-':>10} " if hosted else ""
        lines.append(f"{i:>2} {r.cand.name:<{w}} {p.tokens_per_s:>12,.0f} {p.mfu:>6.1%} "
                     f"{fmt_bytes(r.total_bytes) if r.total_bytes is not None else '-':>10} {host}{ms(p.step_s):>9} "
                     f"{ms(p.compute_s):>9} {ms(p.comm_exposed_s):>9} {ms(p.bubble_s):>8} {ms(p.recompute_s):>8}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.calibrate:
        # lazy: calibration runs torch and launches ranks; planning itself is torch-free
        import torch

        from paratrain.calibration import calibrate

        nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 4)
        check_nproc("auto", nproc, oversubscribe=None)
        model_given = any(a == "--model" or a.startswith("--model=") for a in argv)
        margs = model_from(args.model, args.vocab_size)[1] if model_given else None
        mbs = _csv(args.micro_batches, cast=_posint, flag="--micro-batches") or (1, 2)
        modes = _csv(args.calibrate_modes, ("eager", "compile"), flag="--calibrate-modes")
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
    import time


    ctx, world, opts, base = build_context(args)
    if not args.no_write and not args.explain:
        check_out(Path(args.out), args.overwrite)
    if args.explain:
        if ctx.cluster:
            raise UserError("--explain plans one GPU type; for a heterogeneous cluster run the plan and read its stages")
        print(explain(args.explain, ctx, world, opts))
        return 0
    started = time.perf_counter()
    if ctx.cluster:

        p = plan_hetero(ctx, opts, top=args.top)
    else:
        p = plan(ctx, world, opts, top=args.top)
    elapsed = time.perf_counter() - started
    best = p.ranked[0]
    written = None
    if not args.no_write:
        path, cmd, sb = write_outputs(best, ctx, world, args.out, base, None if base else args.model)
        written = {"config": str(path), "launch": cmd, "sbatch": str(sb) if sb else None}
    check = None
    if args.check:  # the first choice built for real, one rank per pipeline stage
        from paratrain.training.dryrun import dry_run  # lazy: builds the layout with torch

        check = dry_run(config_for(best.cand, ctx, base, None if base else args.model), world)
    if args.json:
        doc = plan_json(p, ctx, world, elapsed, written, args.top)
        if check is not None:
            doc["check"] = {"agrees": check.agrees, "seconds": check.seconds,
                            "ranks": [{"rank": r.rank, "built": r.built, "estimated": r.estimated,
                                       "difference": r.difference} for r in check.ranks]}
        print(json.dumps(doc, indent=2))
        return 0 if check is None or check.agrees else 1
    hw = ctx.hw
    rate = f" (matmuls at the {ctx.math()} peak, {hw.peak(ctx.math()) / 1e12:,.4g} TFLOP/s)" if hw.peaks else ""
    where = (" + ".join(f"{g.count} x {g.name}" for g in ctx.cluster) if ctx.cluster else f"{world} x {hw.name}")
    print(f"plan: {ctx.model_name} on {where} ({hw.source}; {ctx.gpus_per_node} per node, "
          f"intra {hw.intra.name}" + (f", inter {hw.inter.name}" if hw.inter and world > ctx.gpus_per_node else "")
          + f"), seq {ctx.seq_len}, {ctx.global_seqs} sequences = {ctx.global_seqs * ctx.seq_len:,} tokens per step, "
          f"{ctx.precision}{rate}, {ctx.mode}"
          + (", float8 linears" if ctx.float8 else ""))
    if ctx.lora is not None:

        trainable = trainable_count(ctx.args, ctx.lora)
        print(f"LoRA rank {ctx.lora.rank} on {','.join(ctx.lora.targets)}: {format_params(trainable)} trainable, "
              f"{format_params(count_params(ctx.args))} frozen (gradients, their reduction and the optimizer step: "
              "the adapters only)")
    if ctx.native_max_seq_len:
        print(f"note: --seq {ctx.seq_len} is longer than {ctx.model_name}'s max_seq_len {ctx.native_max_seq_len}: "
              f"planned as long-context training (model.max_seq_len={ctx.seq_len} in the written config)")

    print(f"{p.considered} layouts considered: {len(p.rejected)} rejected, {len(p.ranked)} fit among the fastest "
          f"predicted (memory: paratrain estimate, {limit_text(hw.memory_bytes, opts.headroom)}); planned in "
          f"{elapsed:.2f} s")
    print(format_table(p.ranked[: args.top], ctx))
    print(f"best: {best.cand.describe()} -- {best.pred.breakdown()}")
    if best.cand.tiers().active:

        print(f"memory tiers (no layout fits without them): {tiers_text(best.estimate.inputs)}; host memory "
              f"{fmt_bytes(best.estimate.host_bytes)} per rank, {fmt_bytes(best.estimate.host_node_bytes)} per node"
              + ("" if ctx.host_memory_bytes else " (not checked: give --host-memory)"))
    if best.stage_hw:
        split = best.cand.layout.pp_split
        print("stages: " + ", ".join(f"{r}: {split[r]} blocks on {h.name}" for r, h in enumerate(best.stage_hw))
              + f"; the even split {','.join(map(str, _even(best, ctx)))} is predicted "
              f"{best.even.step_s / best.pred.step_s - 1:+.0%} slower ({best.even.tokens_per_s:,.0f} tokens/s)")
    if written:
        print(f"wrote {written['config']}" + (f" and {written['sbatch']}" if written["sbatch"] else ""))
        print(f"launch: {written['launch']}")
    if check is not None:
        from paratrain.training.dryrun import format_dry_run  # lazy: (loaded with the dry run above)

        print(format_dry_run(check))
    sys.stdout.flush()
    return 0 if check is None or check.agrees else 1


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


def plan_json(p, ctx, world: int, elapsed: float, written: dict | None, top: int = 5) -> dict:
    """The plan as one JSON document (`paratrain plan --json`; the schema is in docs/estimate-and-plan.md)."""

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
               "memory_tiers": {"loss_chunks": r.cand.loss_chunks, "activation_offload": r.cand.act_offload,
                                "cpu_offload": r.cand.cpu_offload},
               "predicted": _prediction_json(r.pred), "memory_bytes_per_rank": r.total_bytes,
               "host_bytes_per_rank": r.estimate.host_bytes if r.estimate is not None else None}
        if r.stage_hw:
            out["stages"] = [{"pp_rank": i, "gpu": h.name, "blocks": lay.pp_split[i],
                              "memory_bytes": next((s["total_bytes"] for s in r.estimate.stages if s["stage"] == i),
                                                   None)} for i, h in enumerate(r.stage_hw)]
            out["even_split"] = {"pp_split": list(_even(r, ctx)), "predicted": _prediction_json(r.even)}
        return out

    hw = ctx.hw
    return {
        "model": ctx.model_name, "parameters": count_params(ctx.args), "gpus": world,
        "gpu": None if ctx.cluster else hw.name,
        "cluster": [{"gpu": g.name, "count": g.count, "gpus_per_node": g.gpus_per_node} for g in ctx.cluster]
        if ctx.cluster else None,
        "profile_source": hw.source, "gpus_per_node": ctx.gpus_per_node, "seq_len": ctx.seq_len,
        "global_batch_sequences": ctx.global_seqs, "tokens_per_step": ctx.global_seqs * ctx.seq_len,
        "precision": ctx.precision, "tf32": ctx.tf32, "matmul_math": ctx.math(), "execution_mode": ctx.mode,
        "float8": ctx.float8,
        "grad_compression": ctx.compression.method, "optimizer": ctx.optimizer,
        "considered": p.considered, "rejected": len(p.rejected), "planning_seconds": elapsed,
        "ranked": [layout_json(r) for r in p.ranked[:top]],
        "written": written,
    }
