"""`paratrain estimate`: memory per rank for a model, layout, precision and batch, before renting GPUs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from paratrain.errors import OneLineArgumentParser, UserError

EPILOG = """examples:
  paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --micro-batch 2 --seq-len 8192 --checkpointing full
  paratrain estimate --model llama3-70b --gpu H100 --world-size 64 --tp 8 --dp-mode fsdp --json
  paratrain estimate --model llama3-8b --precision bf16 --accounting classic   # the 16/16/64/32 GB breakdown
  paratrain estimate --model runs/default/config.toml --gpu-memory 24GiB
  paratrain estimate --model llama3-70b --gpu H100 --world-size 32 --pp 4 --tp 8 --pp-schedule interleaved_1f1b

model overrides: --dim, --n-layers, --n-heads, --n-kv-heads, --ffn-hidden, --max-seq-len, --moe-experts,
--moe-top-k, --moe-shared-experts, --moe-ffn-hidden, --moe-first-dense-layers change the preset's dimensions.
accounting: "paratrain" (default) is what `paratrain train` allocates: fp32 parameters and gradients (the
master copy), bf16 compute through FSDP2 mixed precision or autocast. "classic" is Megatron/DeepSpeed-style
mixed precision: bf16 parameters and gradients plus fp32 master weights and moments (16 bytes per parameter
with Adam). Both print the classic ZeRO-1/2/3 breakdown of the model states for bf16/fp16.
runtime overhead (not in torch.cuda.max_memory_allocated): CUDA context + allocator slack 1.0 GiB, plus NCCL
0.5 GiB per rank when there is more than one rank; --overhead-gib replaces the sum."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="paratrain estimate", description=__doc__.splitlines()[0], epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="a preset name, or a config TOML (its [model] section)")
    p.add_argument("--vocab-size", type=int, help="for presets that take the vocabulary from the data")
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-hidden", "max-seq-len", "moe-experts", "moe-top-k",
                 "moe-shared-experts", "moe-ffn-hidden", "moe-first-dense-layers"):
        p.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", help="GPU name (H100, A100-40GB, RTX4090, MI300X, ...)")
    g.add_argument("--gpu-memory", help="memory per GPU, e.g. 24GiB, 80GB, 24576MiB")
    p.add_argument("--world-size", type=int, help="number of ranks (default: the product of the degrees)")
    p.add_argument("--dp-mode", default=None, help="ddp | zero1 | zero2 | zero3 | fsdp | hsdp (default fsdp)")
    p.add_argument("--dp-shard", type=int, default=None, help="-1: the rest of the world (default)")
    p.add_argument("--dp-replicate", type=int, default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--no-loss-parallel", action="store_true")
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--pp-schedule", default=None,
                   help="gpipe | 1f1b (default) | interleaved_1f1b | interleaved_zero_bubble | zbv")
    p.add_argument("--pp-virtual", type=int, default=None, help="stages per rank for the interleaved schedules (2)")
    p.add_argument("--pp-split", help="blocks per stage, e.g. 9,8,8,7 (default: balanced by parameter count)")
    p.add_argument("--microbatches", type=int, help="pipeline micro-batches per step (default 2 x pp); "
                   "--micro-batch is the size of each")
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--moe-imbalance", type=float, default=1.0, help="routed tokens per ep rank / balanced share")
    p.add_argument("--grad-compression", default=None, help="none | bf16 | powersgd | sign_ef (error-feedback state)")
    p.add_argument("--powersgd-rank", type=int, default=None)
    p.add_argument("--sign-ef-block", type=int, default=None)
    p.add_argument("--fsdp-backward-prefetch", type=int, default=None, help="blocks gathered ahead in backward (1)")
    p.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default bf16)")
    p.add_argument("--accounting", default="paratrain", help="paratrain | classic (see below)")
    p.add_argument("--optimizer", default="adamw", help="adamw | adam | sgd | sgd-nomomentum")
    p.add_argument("--optimizer-impl", default="fused", help="fused (default on GPUs) | foreach | for")
    p.add_argument("--checkpointing", default=None, help="none | full | every_k | selective")
    p.add_argument("--every-k", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--accum-steps", type=int, default=None, help="gradient accumulation micro-steps")
    p.add_argument("--overhead-gib", type=float, help="runtime overhead per rank, GiB (default 1.0, +0.5 with NCCL)")
    p.add_argument("--units", choices=("GiB", "GB"), help="GiB (2^30; default) or GB (10^9; default for --accounting "
                   "classic)")
    p.add_argument("--no-suggest", action="store_true", help="do not search for a change that fits")
    p.add_argument("--json", action="store_true")
    return p


MODEL_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "moe_experts", "moe_top_k",
               "moe_shared_experts", "moe_ffn_hidden", "moe_first_dense_layers")


def _model_from(args):
    """(name, ModelArgs, the config or None) from --model (a preset, or a config TOML) and the model flags, which
    override the preset's or the config's [model] values."""
    from paratrain.models import preset_args

    overrides = {k: getattr(args, k) for k in MODEL_FLAGS}
    name = args.model
    if not (name.endswith(".toml") or Path(name).is_file()):
        try:
            return name, preset_args(name, vocab_size=args.vocab_size, **overrides), None
        except TypeError as e:  # an override the model does not have
            raise UserError(f"--model {args.model}: {e}") from None
    from paratrain.config import load_config
    from paratrain.spec import model_args_from

    cfg = load_config(name)
    for key, value in {**overrides, "vocab_size": args.vocab_size}.items():
        if value is not None:
            setattr(cfg.model, key, value)
    return f"{Path(name).name} ({cfg.model.preset})", model_args_from(cfg), cfg


def inputs_from_argv(argv: list[str]):
    """Parse `paratrain estimate` arguments into EstimateInputs (UserError on bad input). Flags override a config
    file's values."""
    from paratrain.config import Config
    from paratrain.estimate.core import EstimateInputs
    from paratrain.estimate.gpus import GiB, gpu_memory, parse_memory
    from paratrain.layout import Layout

    args = _parser().parse_args(argv)
    name, model_args, cfg = _model_from(args)
    from_file = cfg is not None
    cfg = cfg or Config()
    p, t, ac = cfg.parallel, cfg.training, cfg.activation_checkpoint

    def pick(flag, configured, default):
        """The flag, else the config file's value, else the estimator's default."""
        return flag if flag is not None else (configured if from_file else default)

    for flag, value in (("--world-size", args.world_size), ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    pp = pick(args.pp, p.pp, 1)
    tp = pick(args.tp, p.tp, 1)
    dp_replicate, dp_shard = pick(args.dp_replicate, p.dp_replicate, 1), pick(args.dp_shard, p.dp_shard, -1)
    # Without --world-size: the product of the degrees (dp_shard=-1 counts 1; Layout.resolve names a bad degree).
    world = args.world_size or math.prod(max(d, 1) for d in (dp_replicate, dp_shard, tp, pp))
    # Pipeline microbatches per step: --microbatches, else the config's parallel.pp_microbatches, else 2 x pp
    # (pp for a config file that leaves them automatic, as before Layout: the estimate has no global batch to cut).
    microbatches = args.microbatches or (p.pp_microbatches if from_file else 0) or (pp if from_file else 2 * pp)
    layout = Layout.resolve(
        world, dp_mode=pick(args.dp_mode, p.dp_mode, "fsdp"), dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
        pp=pp, ep=pick(args.ep, p.ep, 1),
        sequence_parallel=not args.no_sequence_parallel and (p.sequence_parallel or not from_file),
        loss_parallel=not args.no_loss_parallel and (p.loss_parallel or not from_file),
        pp_schedule=pick(args.pp_schedule, p.pp_schedule, "1f1b"),
        pp_virtual=pick(args.pp_virtual, p.pp_virtual_stages, 1), pp_microbatches=microbatches,
        pp_split=pick(args.pp_split, p.pp_split, None) or None)
    gpu_name = gpu_bytes = None
    if args.gpu:
        gpu_name, gpu_bytes = gpu_memory(args.gpu)
    elif args.gpu_memory:
        gpu_bytes = parse_memory(args.gpu_memory)
    overhead = None
    if args.overhead_gib is not None:
        if args.overhead_gib < 0:
            raise UserError(f"--overhead-gib must be >= 0, got {args.overhead_gib}")
        overhead = int(args.overhead_gib * GiB)
    from paratrain.estimate.compression import Compression

    compression = Compression(pick(args.grad_compression, p.grad_compression, "none"),
                              pick(args.powersgd_rank, p.powersgd_rank, 4),
                              pick(args.sign_ef_block, p.sign_ef_block, 0)).check_flags()
    return EstimateInputs(
        compression=compression, fsdp_backward_prefetch=pick(args.fsdp_backward_prefetch, p.fsdp_backward_prefetch, 1),
        model_args=model_args, layout=layout, model_name=name, precision=pick(args.precision, t.precision, "bf16"),
        optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
        checkpointing=pick(args.checkpointing, ac.mode, "none"), every_k=pick(args.every_k, ac.every_k, 2),
        micro_batch=pick(args.micro_batch, t.micro_batch, 1),
        seq_len=pick(args.seq_len, t.seq_len, min(model_args.max_seq_len, 2048)),
        accum_steps=pick(args.accum_steps, t.accum_steps, 1), accounting=args.accounting, gpu_name=gpu_name,
        gpu_bytes=gpu_bytes, overhead_bytes=overhead, moe_imbalance=args.moe_imbalance), args


def main_estimate(argv: list[str]) -> int:
    from paratrain.estimate.core import estimate

    inputs, args = inputs_from_argv(argv)
    est = estimate(inputs, suggest=not args.no_suggest)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(est.format_table(args.units or ("GB" if inputs.accounting == "classic" else "GiB")))
    sys.stdout.flush()
    return 0
