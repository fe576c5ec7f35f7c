"""What an estimate is asked about (`EstimateInputs`: model, layout, precision, optimizer, checkpointing, batch, GPU)
and the checks on it (`validate`): one-line UserErrors before any walking."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from paratrain.errors import UserError
from paratrain.estimate.gpus import HEADROOM, check_headroom
from paratrain.layout import Batch, Layout, grad_compression_site
from paratrain.memory import check_cpu_offload, check_offload, loss_chunks
from paratrain.models.args import ModelArgs
from paratrain.models.lora_params import LoRA, targets_of
from paratrain.modes import ACTIVATION_OFFLOAD_MODES, CHECKPOINT_MODES, OPTIMIZER_IMPLS, PRECISIONS, Compression
from paratrain.optimizers import OPTIMIZER_NAMES, optimizer_entry

ACCOUNTINGS = ("paratrain", "classic")


@dataclass
class EstimateInputs:
    model_args: ModelArgs
    layout: Layout  # pp > 1: with pp_microbatches (validation fills in a balanced pp_split)
    model_name: str = "model"
    precision: str = "bf16"
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"  # fused | foreach | for (foreach adds one group-sized temporary)
    checkpointing: str = "none"
    every_k: int = 2
    micro_batch: int = 1
    seq_len: int = 2048
    accum_steps: int = 1  # gradient accumulation micro-steps (pp > 1: layout.pp_microbatches instead)
    accounting: str = "paratrain"  # paratrain | classic
    gpu_name: str | None = None
    gpu_bytes: int | None = None
    headroom: float = HEADROOM  # fraction of gpu_bytes kept free (estimate.gpus: the rule plan and estimate share)
    overhead_bytes: int | None = None  # None: CONTEXT_OVERHEAD_GIB (+ NCCL_OVERHEAD_GIB if world > 1)
    moe_imbalance: float = 1.0  # routed tokens per ep rank relative to the balanced share
    device: str = "cuda"  # cuda: counts runtime overhead; cpu: tensors only
    compression: Compression = field(default_factory=Compression)  # parallel.grad_compression and its settings
    fsdp_backward_prefetch: int = 1  # blocks whose parameters backward gathers ahead (FSDP2's default: 1)
    lora: LoRA | None = None  # adapters on a frozen model (`[lora]`, --lora-rank): only they have gradients and states
    loss_chunks: int = 0  # memory.loss_chunks (0: automatic, paratrain.memory.loss_chunks)
    activation_offload: str = "none"  # memory.activation_offload: none | all | every_k (offload_every_k)
    offload_every_k: int = 2
    cpu_offload: bool = False  # memory.cpu_offload: sharded parameters, gradients and optimizer state in host memory
    host_bytes: int | None = None  # host memory per node (--host-memory; None: not checked)
    ranks_per_node: int = 0  # ranks sharing a node's host memory (0: the world size, at most 8)

    @property
    def node_ranks(self) -> int:
        return self.ranks_per_node or min(self.layout.world_size, 8)

    def replace(self, **kw) -> "EstimateInputs":
        return dataclasses.replace(self, **kw)


def validate(i: EstimateInputs) -> EstimateInputs:
    """Check the inputs (UserError; the layout's ConfigError names the setting); returns them with the layout
    validated against the model and the batch (a pipeline's blocks per stage filled in)."""
    for name, value, options in (("--precision", i.precision, PRECISIONS), ("--optimizer", i.optimizer, OPTIMIZER_NAMES),
                                 ("--checkpointing", i.checkpointing, CHECKPOINT_MODES),
                                 ("--accounting", i.accounting, ACCOUNTINGS),
                                 ("--optimizer-impl", i.optimizer_impl, OPTIMIZER_IMPLS)):
        if value not in options:
            raise UserError(f"{name} '{value}' is not one of {', '.join(options)}")
    if i.every_k < 1:
        raise UserError(f"--every-k must be >= 1, got {i.every_k}")
    if i.accum_steps < 1:
        raise UserError(f"--accum-steps must be >= 1, got {i.accum_steps}")
    if i.moe_imbalance < 1:
        raise UserError(f"--moe-imbalance must be >= 1 (1 = perfectly balanced), got {i.moe_imbalance}")
    if i.micro_batch < 1 or i.seq_len < 1:
        raise UserError("--micro-batch and --seq-len must be >= 1")
    args, lay = i.model_args, i.layout
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        raise UserError(f"model dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: dim must "
                        "divide by n_heads and n_heads by n_kv_heads")
    if lay.pp > 1 and lay.pp_microbatches < 1:
        raise UserError("a pipeline's estimate needs its microbatches per step (--microbatches, "
                        "Layout.pp_microbatches)")
    if i.fsdp_backward_prefetch < 1:
        raise UserError(f"--fsdp-backward-prefetch must be >= 1, got {i.fsdp_backward_prefetch}")
    check_headroom(i.headroom)
    if i.lora is not None and not targets_of(args, i.lora):
        raise UserError(f"--lora-targets {','.join(i.lora.targets)}: the model has none of these projections")
    lay.check_checkpointing(i.checkpointing)
    steps = lay.pp_microbatches if lay.pp > 1 else i.accum_steps
    batch = Batch(global_batch=i.micro_batch * steps * lay.dp, micro_batch=i.micro_batch, seq_len=i.seq_len)
    grad_compression_site(lay, i.compression.method)  # ConfigError where it cannot apply
    entry = optimizer_entry(i.optimizer)
    entry.check_compression(i.compression.method, "--grad-compression")
    entry.check_layout(lay)
    if i.activation_offload not in ACTIVATION_OFFLOAD_MODES:
        raise UserError(f"--activation-offload '{i.activation_offload}' is not one of "
                        f"{', '.join(ACTIVATION_OFFLOAD_MODES)}")
    if i.offload_every_k < 1:
        raise UserError(f"--offload-every-k must be >= 1, got {i.offload_every_k}")
    check_offload(i.activation_offload, lay)
    check_cpu_offload(i.cpu_offload, lay)
    if i.ranks_per_node < 0 or (i.host_bytes is not None and i.host_bytes <= 0):
        raise UserError("--gpus-per-node and --host-memory must be positive")
    if i.loss_chunks < 0:
        raise UserError(f"--loss-chunks must be >= 0 (0: automatic), got {i.loss_chunks}")
    chunks = loss_chunks(i.loss_chunks, lay, i.precision)
    return i.replace(layout=lay.validate(args, lay.world_size, batch), loss_chunks=chunks)
