"""`paratrain plan`: rank parallel layouts by predicted step time, write the best as a config and a launch command.

    paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576
    paratrain plan --calibrate --name mybox --nproc 4        # measure this machine; later: --gpu mybox
    paratrain plan ... --explain fsdp,tp=2,ac=full,mb=1     # why a layout is rejected, or how it ranks

Public API: hardware.resolve_hardware / calibrate, cost.predict (the documented cost model), search.plan /
rank_all / explain, and write_outputs (TOML + launch command).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from paratrain.errors import OneLineArgumentParser, UserError

__all__ = ["build_context", "context_from_argv", "main_plan", "write_outputs", "config_for", "launch_command"]


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="paratrain plan", description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="a preset name or a config TOML (its [model] section)")
    p.add_argument("--vocab-size", type=int, default=128, help="for presets that take the vocabulary from the data")
    p.add_argument("--gpus", type=int, help="number of GPUs (ranks) in all")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="H100", help="GPU name from the table, or a saved calibration profile name")
    p.add_argument("--intra", help="intra-node link: nvlink | pcie4 | pcie5 (default: the GPU's usual one)")
    p.add_argument("--inter", help="inter-node link: ib400 (default) | ib200 | eth100 | eth25")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 512 sequences or 4Mi tokens, whichever is smaller)")
    p.add_argument("--precision", default=None, help="bf16 (GPUs) | fp32 (default on a CPU profile)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of device memory kept free (0.10)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--dp-modes", help="comma-separated subset of ddp,zero1,zero2,fsdp,hsdp")
    p.add_argument("--checkpointing", help="comma-separated subset of none,selective,every_k,full")
    p.add_argument("--micro-batches", help="comma-separated micro-batch sizes to try (default 1,2,4,8,16)")
    p.add_argument("--schedules", help="comma-separated pipeline schedules (default gpipe,1f1b,interleaved_1f1b,zbv)")
    p.add_argument("--grad-compression", default="none", help="none | bf16 | powersgd | sign_ef: plan only the layouts "
                   "it applies to, with its bytes and compute (see README, Communication)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--sign-ef-block", type=int, default=0)
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0)
    p.add_argument("--max-tp", type=int)
    p.add_argument("--max-pp", type=int)
    p.add_argument("--max-cp", type=int, help="largest context-parallel degree to try (default: any that leaves each "
                   "rank 1024 tokens or more of a sequence)")
    p.add_argument("--out", default="plan", help="folder for the best layout's config.toml and launch script")
    p.add_argument("--no-write", action="store_true", help="print the plan only")
    p.add_argument("--explain", metavar="LAYOUT", help="why LAYOUT (as printed, e.g. fsdp,tp=2,ac=full,mb=1) is "
                   "rejected, or how it ranks")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and save a profile")
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


def _model(spec: str, vocab: int):
    """(name, ModelArgs, the config or None) from --model: a preset, or a config TOML. `vocab` (--vocab-size) is the
    vocabulary of presets that take it from the data, unless the config sets model.vocab_size."""
    from paratrain.models import preset_args

    if spec.endswith(".toml") or Path(spec).is_file():
        from paratrain.config import load_config
        from paratrain.spec import model_args_from

        cfg = load_config(spec)
        m = cfg.model if cfg.model.vocab_size is not None else dataclasses.replace(cfg.model, vocab_size=vocab)
        return f"{Path(spec).name} ({m.preset})", model_args_from(dataclasses.replace(cfg, model=m)), cfg
    return spec, preset_args(spec, vocab_size=vocab), None


def build_context(args) -> tuple:
    """(Context, world, Options, base config or None) from parsed arguments; UserError on bad input."""
    from paratrain.planner.cost import Context
    from paratrain.planner.hardware import resolve_hardware
    from paratrain.planner.search import AC_MODES, DP_MODES, SCHEDULES, Options

    if args.gpus is None:
        raise UserError("--gpus N is required (the number of GPUs to plan for)")
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise UserError("--gpus and --gpus-per-node must be >= 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not divisible by --gpus-per-node {args.gpus_per_node} "
                        "(whole nodes only)")
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom must be in [0, 1), got {args.headroom}")
    hw = resolve_hardware(args.gpu, args.intra, args.inter, args.profile_dir)
    name, margs, base = _model(args.model, args.vocab_size)
    seq = args.seq or min(margs.max_seq_len, 4096)
    if seq < 1:
        raise UserError(f"--seq must be >= 1, got {seq}")
    native = None
    if seq > margs.max_seq_len:  # a long-context stage: the model trained on longer sequences than its preset's
        native, margs = margs.max_seq_len, dataclasses.replace(margs, max_seq_len=seq)
    tokens = args.global_batch_tokens or min(4 * 2**20, 512 * seq)
    if tokens % seq:
        raise UserError(f"--global-batch-tokens {tokens} is not a multiple of --seq {seq}")
    precision = args.precision or ("fp32" if hw.device == "cpu" else "bf16")
    if precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"--precision '{precision}' is not one of fp32, bf16, fp16")
    from paratrain.estimate.compression import Compression
    from paratrain.layout import GRAD_COMPRESSIONS

    if args.grad_compression not in GRAD_COMPRESSIONS:
        raise UserError(f"--grad-compression '{args.grad_compression}' is not one of {', '.join(GRAD_COMPRESSIONS)}")
    if args.powersgd_rank < 1 or args.sign_ef_block < 0 or args.sign_ef_block % 8 or args.ddp_bucket_mb <= 0:
        raise UserError("--powersgd-rank must be >= 1, --sign-ef-block 0 or a multiple of 8, --ddp-bucket-mb > 0")
    ctx = Context(margs, seq, tokens // seq, hw, min(args.gpus_per_node, args.gpus), precision, name, native,
                  Compression(args.grad_compression, args.powersgd_rank, args.sign_ef_block), args.ddp_bucket_mb)
    opts = Options(
        dp_modes=_csv(args.dp_modes, DP_MODES, flag="--dp-modes") or DP_MODES,
        schedules=_csv(args.schedules, SCHEDULES, flag="--schedules") or SCHEDULES,
        ac_modes=_csv(args.checkpointing, AC_MODES, flag="--checkpointing") or AC_MODES,
        micro_batches=_csv(args.micro_batches, cast=_posint, flag="--micro-batches"),
        max_tp=args.max_tp, max_pp=args.max_pp, max_cp=args.max_cp, headroom=args.headroom)
    return ctx, args.gpus, opts, base


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
    from paratrain.config import Config, validate

    cfg = base if base is not None else Config()
    if base is None and model_spec is not None:
        cfg.model.preset = model_spec
    t, p, lay = cfg.training, cfg.parallel, c.layout
    t.seq_len, t.micro_batch, t.global_batch, t.accum_steps = ctx.seq_len, c.micro_batch, ctx.global_seqs, 1
    t.precision = ctx.precision
    if ctx.native_max_seq_len:  # planned beyond the preset's context: the config says so
        cfg.model.max_seq_len = ctx.args.max_seq_len
    if ctx.hw.device == "cpu":
        t.device = "cpu"
    p.dp_mode = lay.dp_mode
    p.dp_replicate = lay.dp_replicate if lay.hybrid else 1  # else one data-parallel axis: dp_shard=-1 fills it
    p.dp_shard = -1
    p.tp, p.pp, p.ep, p.cp = lay.tp, lay.pp, lay.ep, lay.cp
    p.sequence_parallel = True
    comp = ctx.compression
    p.grad_compression, p.powersgd_rank, p.sign_ef_block = comp.method, comp.powersgd_rank, comp.sign_ef_block
    p.ddp_bucket_mb = ctx.ddp_bucket_mb
    p.loss_parallel = lay.pp == 1  # the last pipeline stage computes whole logits
    if lay.pp > 1:
        p.pp_schedule, p.pp_microbatches, p.pp_virtual_stages = lay.pp_schedule, lay.pp_microbatches, lay.pp_virtual
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.every_k = c.ac, c.every_k
    validate(cfg)
    return cfg


def launch_command(c, ctx, world: int, config_path: str) -> tuple[str, str | None]:
    """(command line, sbatch script or None)."""
    gpn = ctx.gpus_per_node
    nodes = max(1, world // gpn)
    if ctx.hw.device == "cpu":
        return f"paratrain train --nproc {world} --config {config_path}", None
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {world} -m paratrain train --config {config_path}", None
    script = f"""#!/bin/bash
#SBATCH --job-name=paratrain-{c.describe().replace(' ', '')[:40]}
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


def write_outputs(best, ctx, world: int, out_dir, base=None, model_spec=None) -> tuple[Path, str, Path | None]:
    from paratrain.config import dump_toml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(best.cand, ctx, base, model_spec)
    path = out / "config.toml"
    head = (f"# paratrain plan: {best.cand.name} ({best.cand.describe()}) on {world} x {ctx.hw.name}\n"
            f"# predicted {best.pred.tokens_per_s:,.0f} tokens/s, MFU {best.pred.mfu:.1%}; set [data] to your corpus\n")
    path.write_text(head + dump_toml(cfg))
    cmd, script = launch_command(best.cand, ctx, world, str(path))
    sb = None
    if script:
        sb = out / "plan.sbatch"
        sb.write_text(script)
        cmd = f"sbatch {sb}"
    return path, cmd, sb


def format_table(results, ctx) -> str:
    from paratrain.estimate.gpus import fmt_bytes

    head = (f"{'#':>2} {'layout':<44} {'tokens/s':>12} {'MFU':>6} {'mem/rank':>10} {'step':>9} {'compute':>9} "
            f"{'exp.comm':>9} {'bubble':>8} {'recomp':>8}")
    lines = [head]
    for i, r in enumerate(results, 1):
        p = r.pred
        ms = lambda s: f"{s * 1e3:.1f}ms" if s < 10 else f"{s:.2f}s"  # noqa: E731
        lines.append(f"{i:>2} {r.cand.name:<44} {p.tokens_per_s:>12,.0f} {p.mfu:>6.1%} "
                     f"{fmt_bytes(r.total_bytes) if r.total_bytes is not None else '-':>10} {ms(p.step_s):>9} "
                     f"{ms(p.compute_s):>9} {ms(p.comm_exposed_s):>9} {ms(p.bubble_s):>8} {ms(p.recompute_s):>8}")
    return "\n".join(lines)


def main_plan(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.calibrate:
        from paratrain.planner.hardware import calibrate

        import torch

        nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 4)
        from paratrain.preflight import check_nproc

        check_nproc("auto", nproc, oversubscribe=None)
        hw, path = calibrate(args.name, nproc, args.profile_dir)
        print(f"profile '{hw.name}' ({hw.source}) saved to {path}")
        print("  matmul: " + ", ".join(f"{(f / 2) ** (1 / 3):.0f}^3 {r / 1e9:.2f} GFLOP/s" for f, r in hw.gemm))
        print(f"  memory bandwidth {hw.mem_bandwidth / 1e9:.2f} GB/s, per-operator overhead "
              f"{hw.op_overhead_s * 1e6:.1f} us; compute scale {hw.compute_scale:.2f} (reference model step, measured / "
              "predicted)")
        print(f"  collectives over {nproc} ranks: latency {hw.intra.latency * 1e6:.1f} us per step, bandwidth "
              f"{hw.intra.bandwidth / 1e9:.2f} GB/s (alpha-beta fit of all-reduce and all-gather)")
        print(f"  plan with: paratrain plan --gpu {hw.name} --gpus {nproc} --gpus-per-node {nproc}"
              + (f" --profile-dir {args.profile_dir}" if args.profile_dir else "") + " ...")
        return 0
    from paratrain.planner.search import explain, plan

    ctx, world, opts, base = build_context(args)
    if args.explain:
        print(explain(args.explain, ctx, world, opts))
        return 0
    p = plan(ctx, world, opts, top=args.top)
    hw = ctx.hw
    print(f"plan: {ctx.model_name} on {world} x {hw.name} ({hw.source}; {ctx.gpus_per_node} per node, "
          f"intra {hw.intra.name}" + (f", inter {hw.inter.name}" if hw.inter and world > ctx.gpus_per_node else "")
          + f"), seq {ctx.seq_len}, {ctx.global_seqs} sequences = {ctx.global_seqs * ctx.seq_len:,} tokens per step, "
          f"{ctx.precision}")
    if ctx.native_max_seq_len:
        print(f"note: --seq {ctx.seq_len} is longer than {ctx.model_name}'s max_seq_len {ctx.native_max_seq_len}: "
              f"planned as long-context training (model.max_seq_len={ctx.seq_len} in the written config)")
    print(f"{p.considered} layouts considered: {len(p.rejected)} rejected, {len(p.ranked)} fit among the fastest "
          f"predicted (memory: paratrain estimate, {opts.headroom:.0%} headroom)")
    print(format_table(p.ranked[: args.top], ctx))
    best = p.ranked[0]
    print(f"best: {best.cand.describe()} -- {best.pred.breakdown()}")
    if not args.no_write:
        path, cmd, sb = write_outputs(best, ctx, world, args.out, base, None if base else args.model)
        print(f"wrote {path}" + (f" and {sb}" if sb else ""))
        print(f"launch: {cmd}")
    sys.stdout.flush()
    return 0
