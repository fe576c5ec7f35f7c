"""What an estimate is asked about (`EstimateInputs`: a model, a `Recipe`, a `Target`), made in one place
(`inputs_for`), and the checks on it (`validate`): one-line UserErrors before any walking."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.capabilities import OPTIMIZER_NAMES, optimizer_entry
from paratrain.errors import UserError
from paratrain.estimate.gpus import HEADROOM, check_headroom
from paratrain.layout import Batch, Layout
from paratrain.models.args import ModelArgs
from paratrain.modes import OPTIMIZER_IMPLS
from paratrain.recipe import Recipe

ACCOUNTINGS = ("paratrain", "classic")


@dataclass(frozen=True)
class Target:
    """Where a recipe is estimated: the device's memory and what the estimate counts beside the tensors."""

    gpu_name: str | None = None
    gpu_bytes: int | None = None
    headroom: float = HEADROOM  # fraction of gpu_bytes kept free (estimate.gpus: the rule plan and estimate share)
    overhead_bytes: int | None = None  # None: CONTEXT_OVERHEAD_GIB (+ NCCL_OVERHEAD_GIB if world > 1)
    device: str = "cuda"  # cuda: counts runtime overhead; cpu: tensors only
    host_bytes: int | None = None  # host memory per node (--host-memory; None: not checked)
    ranks_per_node: int = 0  # ranks sharing a node's host memory (0: the world size, at most 8)


@dataclass(frozen=True)
class EstimateInputs:
    """What an estimate is about: a model, a recipe (paratrain/recipe.py) and a target. Made only by `inputs_for`."""

    model_args: ModelArgs
    recipe: Recipe  # its layout with pp > 1: with pp_microbatches (validation fills in a balanced pp_split)
    target: Target
    model_name: str = "model"
    accounting: str = "paratrain"  # paratrain | classic
    moe_imbalance: float = 1.0  # routed tokens per ep rank relative to the balanced share

    @property
    def layout(self) -> Layout:
        return self.recipe.layout

    @property
    def node_ranks(self) -> int:
        return self.target.ranks_per_node or min(self.layout.world_size, 8)

    def with_recipe(self, **changes) -> "EstimateInputs":
        """The same question about a changed recipe (the suggestions' what-ifs)."""
        return dataclasses.replace(self, recipe=self.recipe.replace(**changes))

    def with_target(self, **changes) -> "EstimateInputs":
        return dataclasses.replace(self, target=dataclasses.replace(self.target, **changes))


def inputs_for(model_args: ModelArgs, recipe: Recipe, target: Target = Target(), *, model_name: str = "model",
               accounting: str = "paratrain", moe_imbalance: float = 1.0) -> EstimateInputs:
    """The one way to ask the estimator about a model trained by a recipe on a target (checked by `validate`)."""
    return EstimateInputs(model_args, recipe, target, model_name, accounting, moe_imbalance)


def validate(i: EstimateInputs) -> EstimateInputs:
    """Check the inputs (UserError; the layout's ConfigError names the setting); returns them with the layout
    validated against the model and the batch (a pipeline's blocks per stage filled in)."""
    for name, value, options in (("--optimizer", i.recipe.optimizer, OPTIMIZER_NAMES),
                                 ("--accounting", i.accounting, ACCOUNTINGS),
                                 ("--optimizer-impl", i.recipe.optimizer_impl, OPTIMIZER_IMPLS)):
        if value not in options:
            raise UserError(f"{name} '{value}' is not one of {', '.join(options)}")
    if i.recipe.every_k < 1:
        raise UserError(f"--every-k must be >= 1, got {i.recipe.every_k}")
    if i.recipe.segment_blocks < 0:
        raise UserError(f"--segment-blocks must be >= 0 (0: round(sqrt(n_layers))), got {i.recipe.segment_blocks}")
    if i.recipe.accum_steps < 1:
        raise UserError(f"--accum-steps must be >= 1, got {i.recipe.accum_steps}")
    if i.moe_imbalance < 1:
        raise UserError(f"--moe-imbalance must be >= 1 (1 = perfectly balanced), got {i.moe_imbalance}")
    if i.recipe.micro_batch < 1 or i.recipe.seq_len < 1:
        raise UserError("--micro-batch and --seq-len must be >= 1")
    args, lay = i.model_args, i.layout
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        raise UserError(f"model dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: dim must "
                        "divide by n_heads and n_heads by n_kv_heads")
    if lay.pp > 1 and lay.pp_microbatches < 1:
        raise UserError("a pipeline's estimate needs its microbatches per step (--microbatches, "
                        "Layout.pp_microbatches)")
    if i.recipe.fsdp_backward_prefetch < 1:
        raise UserError(f"--fsdp-backward-prefetch must be >= 1, got {i.recipe.fsdp_backward_prefetch}")
    check_headroom(i.target.headroom)
    if i.recipe.lora is not None and not i.recipe.lora.target_weights(args):
        raise UserError(f"--lora-targets {','.join(i.recipe.lora.targets)}: the model has none of these projections")
    lay.check_checkpointing(i.recipe.checkpointing)
    steps = lay.pp_microbatches if lay.pp > 1 else i.recipe.accum_steps
    batch = Batch(global_batch=i.recipe.micro_batch * steps * lay.dp, micro_batch=i.recipe.micro_batch,
                  seq_len=i.recipe.seq_len)
    i.recipe.compression.site(lay)  # ConfigError where it cannot apply
    entry = optimizer_entry(i.recipe.optimizer)
    i.recipe.compression.check_optimizer(entry, "--grad-compression")
    entry.check_layout(lay)
    for capability in i.recipe.capabilities:  # (activation offload: its mode and schedule; CPU offload: FSDP layouts)
        capability.check_layout(lay)
        capability.check_checkpointing(i.recipe.checkpointing)
    if i.target.ranks_per_node < 0 or (i.target.host_bytes is not None and i.target.host_bytes <= 0):
        raise UserError("--gpus-per-node and --host-memory must be positive")
    tokens = i.recipe.micro_batch * i.recipe.seq_len  # (the chunked loss's automatic pieces decided for the model)
    resolved = (c.resolved(lay, i.recipe.precision, args.vocab_size, tokens) for c in i.recipe.capabilities)
    return i.with_recipe(layout=lay.validate(args, lay.world_size, batch),
                         capabilities=tuple(c for c in resolved if c is not None))
