"""`paratrain estimate`: memory per rank for a model, layout, precision and batch, before renting GPUs."""

from __future__ import annotations

import argparse
import json
import math
import sys

from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.layout_grammar import FLAG_KEYS, add_layout_flags, with_layout_flags
from paratrain.modes import OPTIMIZER_IMPLS
from paratrain.config import Config
from paratrain.estimate import target_device
from paratrain.estimate.core import estimate
from paratrain.estimate.gpus import GiB, HEADROOM, check_headroom, gpu_memory, parse_memory
from paratrain.estimate.inputs import Target, inputs_for
from paratrain.layout import Layout
from paratrain.capabilities.grad_compression import Compression
from paratrain.recipe import Recipe
from paratrain.commands.recipe_flags import add_recipe_flags, add_section_flags, with_recipe_flags, with_section_flags
from paratrain.spec import batch_of, model_from

# The layout flags `paratrain estimate` takes (paratrain/layout_grammar.py): every [parallel] setting that changes
# the memory of a step (not DDP's bucket size: its buckets are as large as the gradients).
ESTIMATE_FLAG_KEYS = tuple(k for k in FLAG_KEYS if k != "ddp_bucket_mb")

EPILOG = """examples:
  paratrain estimate --model llama3-8b --gpu H100 --dp-shard 8 --micro-batch 2 --seq-len 8192 --checkpointing full
  paratrain estimate --model llama3-70b --gpu H100 --world-size 64 --tp 8 --dp-mode fsdp --json
  paratrain estimate --model llama3-8b --precision bf16 --accounting classic   # the 16/16/64/32 GB breakdown
  paratrain estimate --model runs/default/config.toml --world-size 8 --gpu-memory 24GiB
  paratrain estimate --model plan/config.toml --gpu H100      # the layout paratrain plan chose: its memory per rank
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
    add_layout_flags(p, ESTIMATE_FLAG_KEYS, "the [parallel] settings, over the --model config's or the defaults\n"
                     "(a pipeline: --microbatches micro-batches per step, default 2 x pp, of --micro-batch sequences)")
    p.add_argument("--moe-imbalance", type=float, default=1.0, help="routed tokens per ep rank / balanced share")
    add_section_flags(p, "estimate")  # (keys of the capabilities' own sections: Capability.section_flags)
    p.add_argument("--accounting", default="paratrain", help="paratrain | classic (see below)")
    p.add_argument("--optimizer-impl", default=None, help=f"{' | '.join(OPTIMIZER_IMPLS)} (default fused on GPUs)")
    p.add_argument("--accum-steps", type=int, default=None, help="gradient accumulation micro-steps")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (accumulation derived)")
    # the recipe's settings (training, checkpointing, optimizer, memory tiers), one flag each (recipe_flags.py)
    m = add_recipe_flags(p, skip=("parallel.fsdp_backward_prefetch",))["memory"]  # (a [parallel] flag above)
    m.add_argument("--host-memory", help="host memory per node, e.g. 512GiB: checks what the tiers put there")
    m.add_argument("--gpus-per-node", type=int, default=None, help="ranks sharing a node's host memory (default: "
                   "the world size, at most 8)")
    p.add_argument("--overhead-gib", type=float, help="runtime overhead per rank, GiB (default 1.0, +0.5 with NCCL)")
    p.add_argument("--units", choices=("GiB", "GB"), help="GiB (2^30; default) or GB (10^9; default for --accounting "
                   "classic)")
    p.add_argument("--headroom", type=float, default=None, help="fraction of the GPU's memory kept free (0.10, as "
                   "paratrain plan: the allocator's fragmentation and NCCL buffers)")
    p.add_argument("--no-suggest", action="store_true", help="do not search for a change that fits")
    p.add_argument("--json", action="store_true")
    return p


MODEL_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "moe_experts", "moe_top_k",
               "moe_shared_experts", "moe_ffn_hidden", "moe_first_dense_layers")


def _model_from(args):
    """(name, ModelArgs, the config or None) from --model and the model flags (`spec.model_from`)."""

    return model_from(args.model, args.vocab_size, {k: getattr(args, k) for k in MODEL_FLAGS})


def _estimate_defaults(model_args):
    """The config a preset is estimated with: the trainer's defaults, but bf16, one sequence per micro-batch and the
    preset's context up to 2,048 tokens."""

    cfg = Config()
    t = cfg.training
    t.precision, t.micro_batch, t.accum_steps, t.seq_len = "bf16", 1, 1, min(model_args.max_seq_len, 2048)
    return cfg


def _with_flags(cfg, args):
    """The config with the command line's flags written over its [parallel], [training], [activation_checkpoint] and
    [memory] values (explicit flags win). A flag that fixes the accumulation (--accum-steps) or a pipeline's micro-batches
    (--micro-batch / --microbatches) replaces the config's global batch, which is then derived from them."""
    t = cfg.training
    for flag in ("world_size", "micro_batch", "seq_len", "accum_steps", "global_batch", "every_k", "offload_every_k",
                 "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    cfg.parallel = with_layout_flags(cfg.parallel, args, ESTIMATE_FLAG_KEYS)
    with_recipe_flags(cfg, args)
    for flag in ("accum_steps", "global_batch"):  # the batch's shape: not recipe settings (accumulation is derived)
        if getattr(args, flag) is not None:
            setattr(t, flag, getattr(args, flag))
    if args.accum_steps is not None and args.global_batch is None:
        t.global_batch = None
    with_section_flags(cfg, args, "estimate")
    return cfg


def world_of(parallel) -> int:
    """The world size a [parallel] section names when its degrees are all given (dp_shard=-1 counts 1)."""
    return math.prod(max(d, 1) for d in (parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp,
                                         parallel.pp))


def _layout_and_batch(cfg, args, model_args, from_file: bool):
    """(layout validated against the model and the batch, micro-batch size, accumulation steps), as the trainer
    resolves them (`Layout.from_config`, `spec.batch_of`, `Layout.validate`). A pipeline estimated from a preset, or
    with --micro-batch / --microbatches, runs --microbatches (default 2 x pp) micro-batches of --micro-batch."""

    p, t = cfg.parallel, cfg.training
    world = args.world_size or world_of(p)
    layout = Layout.from_config(p, world)
    if layout.pipelined and (not from_file or args.micro_batch is not None or args.pp_microbatches is not None):
        p.pp_microbatches = p.pp_microbatches or 2 * layout.pp
        t.global_batch = t.micro_batch * p.pp_microbatches * layout.dp
        layout = Layout.from_config(p, world)
    batch, _ = batch_of(t, layout)
    layout.check_checkpointing(cfg.activation_checkpoint.mode)
    layout = layout.validate(model_args, world, batch)
    return layout, layout.forward_batch(batch), layout.accumulation(batch)


def inputs_from_argv(argv: list[str]):
    """Parse `paratrain estimate` arguments into EstimateInputs (UserError on bad input). A config file's [parallel],
    [training] and [activation_checkpoint] sections are read as the trainer reads them; flags override them."""

    args = _parser().parse_args(argv)
    name, model_args, cfg = _model_from(args)
    from_file = cfg is not None
    cfg = _with_flags(cfg or _estimate_defaults(model_args), args)
    p = cfg.parallel
    layout, micro_batch, accum_steps = _layout_and_batch(cfg, args, model_args, from_file)
    args.notes = []
    if from_file and p.dp_shard == -1 and not args.world_size:
        args.notes.append(f"{args.model} leaves parallel.dp_shard = -1 (the rest of the world): estimated for "
                          f"{layout.world_size} rank(s); give --world-size N (or --dp-shard) for the run's")
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
    if args.optimizer_impl:
        cfg.optimizer.impl = args.optimizer_impl
    Compression.from_config(p).check_flags()
    device = target_device(cfg.training)
    recipe = Recipe.from_config(cfg, layout, micro_batch, accum_steps, device)
    target = Target(gpu_name=gpu_name, gpu_bytes=gpu_bytes, device=device,
                    headroom=check_headroom(HEADROOM if args.headroom is None else args.headroom),
                    overhead_bytes=overhead, host_bytes=parse_memory(args.host_memory) if args.host_memory else None,
                    ranks_per_node=args.gpus_per_node or 0)
    return inputs_for(model_args, recipe, target, model_name=name, accounting=args.accounting,
                      moe_imbalance=args.moe_imbalance), args


def main(argv: list[str]) -> int:
    inputs, args = inputs_from_argv(argv)
    est = estimate(inputs, suggest=not args.no_suggest)
    est.notes.extend(args.notes)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(est.format_table(args.units or ("GB" if inputs.accounting == "classic" else "GiB")))
    sys.stdout.flush()
    return 0
