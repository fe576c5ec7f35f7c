"""Turn a plain Transformer into a parallel one, in a fixed order:

    the capabilities' model changes (adapters on a frozen base, fp8's linear layers) -> tensor/sequence parallel ->
    context parallel (ring attention) -> expert parallel -> activation checkpointing -> torch.compile -> activation offloading -> FSDP (over
    dp_shard x cp) -> materialise + deterministic init -> DDP / ZeRO-1 wrapping (DDP needs real weights)

The model file stays free of parallel code; the tensor-parallel plan is read from the model family's parameter roles
(`tensor_parallel.py`). The rules of the layout live in `paratrain/layout.py`, its mesh in
`parallel_dims.py`; pipeline stages (`pipeline.py`) are each laid out by this same `parallelize`.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial

from torch import nn
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import (CheckpointPolicy, SAC_IGNORED_OPS, _checkpoint_without_reentrant_generator,
                                    create_selective_checkpoint_contexts)

from paratrain.capabilities.base import Where
from paratrain.config import ActivationCheckpointConfig
from paratrain.distributed.compression import GradComm
from paratrain.distributed.context_parallel import apply_context_parallel, attention_modules, context_for
from paratrain.distributed.expert_parallel import distribute_experts, shard_experts
from paratrain.distributed.initialize import init_weights
from paratrain.distributed.offload import apply_activation_offload
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.tensor_parallel import apply_tp
from paratrain.distributed.tensors import full_tensor, right_pad, torch_dtype
from paratrain.modes import CheckpointMode


class SequenceParallelSampler(nn.Module):
    """A callable model for `generate.sample` under sequence parallelism, whose forward needs a sequence length that
    divides by tp: prompts are right-padded (causal attention hides the padding) and the logits cut back."""

    def __init__(self, model: nn.Module, tp: int):
        super().__init__()
        self._model, self._tp = model, tp

    def train(self, mode: bool = True):
        super().train(mode)
        self._model.train(mode)
        return self

    def forward(self, tokens: torch.Tensor, **cache) -> torch.Tensor:  # (B, T) -> (B, T, V)
        # a KV cache (`cache=`) gets the padding's keys too: its caller commits only the tokens' (generate.Decoder)
        return full_tensor(self._model(right_pad(tokens, self._tp), **cache))[:, :tokens.shape[1]]


def _selective_policy(ctx, op, *args, **kwargs):
    """Keep matmul and attention outputs (expensive to recompute); recompute cheap element-wise ops."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_mm.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
_SAVE_OPS.add(torch.ops.paratrain.ring_attention.default)  # context parallel attention (its output and lse)
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)  # the experts' matmuls


def _sac_ignore_profiler_ops() -> None:
    """FSDP's hooks on a module inside a checkpointed block (the experts under expert parallelism) open
    profiler ranges a different number of times in the forward and in the recompute; they compute nothing,
    so selective checkpointing should not count them (torch keeps such ops in SAC_IGNORED_OPS)."""
    profiler = torch.ops.profiler
    SAC_IGNORED_OPS.update({profiler._record_function_enter_new.default, profiler._record_function_enter.default,
                            profiler._record_function_exit.default, profiler._record_function_exit._RecordFunction})


class CheckpointedSegment:
    """Consecutive blocks checkpointed as one unit: what they save for backward is not kept (only the first block's
    inputs are), and the first backward that needs any of it runs the whole segment's forward again.

    The model's forward calls its blocks one by one (models/llama.py stays plain), so no single call runs the segment.
    Hooks open torch's non-reentrant checkpoint (the generator behind torch's composable `checkpoint`, which spans one
    module the same way) in the first block's forward pre-hook, on that block's inputs, and close it in the last
    block's forward hook: every tensor saved in between belongs to the checkpoint. The recomputation calls the blocks
    in order (their FSDP hooks run as in forward; ours stand aside). Nothing is wrapped or registered: parameter names,
    state dicts and checkpoints stay as they are."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = blocks
        self.frame = None  # the open checkpoint, from the first block's pre-hook to the last block's hook
        self.recomputing = False
        blocks[0].register_forward_pre_hook(self._open, with_kwargs=True)
        # first among the last block's hooks: the checkpoint closes before FSDP's post-forward (as torch's does)
        blocks[-1].register_forward_hook(self._close, prepend=True, always_call=True)

    def run(self, h, *args, **kwargs):
        for block in self.blocks:
            h = block(h, *args, **kwargs)
        return h

    @contextmanager
    def _recomputation(self):
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False

    def _open(self, module, args, kwargs):
        if self.recomputing:
            return
        if self.frame is not None:  # a forward that raised inside the segment left its checkpoint open
            self.frame.close()
        # (fn, preserve_rng_state: no dropout, context_fn, determinism_check, debug, early_stop, *inputs)
        self.frame = _checkpoint_without_reentrant_generator(
            self.run, False, lambda: (nullcontext(), self._recomputation()), "default", False, True, *args, **kwargs)
        next(self.frame)

    def _close(self, module, args, output):
        frame, self.frame = self.frame, None
        if frame is not None:
            next(frame, None)  # leaves the checkpoint's context (the generator ends)


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointConfig, capabilities=()) -> None:
    checkpointing = CheckpointMode(cfg.mode)
    if not checkpointing.recomputes:
        return
    for capability in capabilities:  # a mode that is a capability: its units of this stage's blocks, each recomputed
        # as one
        units = capability.checkpoint_units(list(model.layers.values()), model.args.n_layers)
        if units is not None:
            for blocks in units:
                CheckpointedSegment(blocks)
            return

    if checkpointing.selective:
        _sac_ignore_profiler_ops()
    blocks = list(model.layers.items())
    for (key, block), mode in zip(blocks, checkpointing.block_checkpointing(len(blocks), cfg.every_k)):
        if not mode.recomputes:
            continue
        kwargs = dict(preserve_rng_state=False)
        if mode.selective:
            kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
        model.layers[key] = checkpoint_wrapper(block, **kwargs)


def apply_compile(model: nn.Module, backend: str | None = None, cuda_graphs: bool = False) -> None:
    # Per block, in place (Module.compile keeps parameter names); blocks share one compiled graph. `backend`: torch's
    # default (inductor) unless given (bench/gpu.py checks the path on a CPU with "aot_eager"). cuda_graphs: Inductor's
    # reduce-overhead mode, which records each compiled graph's kernels once per shape and replays them (one launch
    # instead of hundreds: what a small model's step on a fast GPU waits on).
    options = {"backend": backend} if backend else {}
    if cuda_graphs:
        options["mode"] = "reduce-overhead"
    for block in model.layers.values():
        block.compile(**options)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_not_a_view)


def _not_a_view(module, args, output):
    # Under tensor parallelism the embedding hands the first block a view of its DTensor's local tensor (to_local),
    # under sequence parallelism still wrapped as a pending collective. A compiled block takes a view input as its base
    # plus a view replayed inside the graph, and in backward hands the gradient to the base's producer (DTensor's
    # redistribution) as a plain tensor, skipping to_local's backward, which would have made it a DTensor again (torch
    # 2.13: AttributeError '_local_tensor'); and a wrapped input is another type, so the blocks' shared graph would be
    # compiled again for it. A plain copy is an input of its own.
    return output.clone() if isinstance(output, AsyncCollectiveTensor) or output._is_view() else None


def apply_fsdp(model: nn.Module, dims: ParallelDims, precision: str, expert_dp_mesh=None,
               comm: GradComm | None = None, offload: OffloadPolicy | None = None) -> None:
    """offload: FSDP2's offload policy for every group (a capability's `fsdp_offload_policy`: CPU offload's keeps the
    sharded parameters, gradients and so the optimizer state in host memory); None: nothing offloaded."""
    comm = comm or GradComm.default(dims, torch.device("cpu"))
    # Gradients are reduced in fp32, or in bf16 with bf16 gradient compression (`comm.reduce_dtype`).
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(precision), reduce_dtype=comm.reduce_dtype)
    policies = dict(mp_policy=mp, offload_policy=offload if offload is not None else OffloadPolicy())
    mesh = comm.fsdp_mesh()  # hsdp compressing its replicate all-reduce shards over dp_shard only
    # zero2: gradients and optimizer state sharded, parameters kept gathered from forward to backward.
    reshard = dims.layout.reshard_after_forward
    if expert_dp_mesh is not None:
        # Expert-parallel experts first, on their own mesh, so the blocks' groups leave them out.
        shard_experts(model, comm.expert_fsdp_mesh(expert_dp_mesh), policies, reshard)
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        # The last block is resharded by the root right after forward anyway; skip the extra work.
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and i < len(layers) - 1, **policies)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policies)
    comm.attach_fsdp(model, layers)  # prefetching; hsdp's compressed replicate all-reduce


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _whole_length(layout):
    def hook(module, args, kwargs):
        shards = layout.tp if layout.sp and module.tok_embeddings is None else 1
        attentions = attention_modules([module])
        if attentions:  # ring attention holds cp chunks; sampling may put whole sequences back for a while
            shards *= getattr(attentions[0].sequence, "cp", 1)
        return args, {**kwargs, "seq_len": args[0].shape[1] * shards}

    return hook


def parallelize(model: nn.Module, dims: ParallelDims, activation_checkpoint: ActivationCheckpointConfig,
                precision: str, compile: bool | str, device: torch.device, seed: int, ddp_bucket_mb: float = 25.0,
                comm: GradComm | None = None, capabilities=(),
                cuda_graphs: bool = False) -> nn.Module:
    """Apply the layout to a model or pipeline stage built on the meta device; returns the module to train
    (maybe a DDP wrapper). compile: True for torch.compile's default backend, or a backend name. `comm` carries the
    gradient communication settings (`[parallel]`: compression, DDP buckets, FSDP prefetching); None: no
    compression, FSDP2's default prefetching, `ddp_bucket_mb` buckets. `capabilities`: the run's
    (paratrain/capabilities), whose `before_parallelize` hooks change the plain model first (`precision` is what the
    rest computes in: fp8's 8-bit layers take their own), inside whose `around_tensor_parallel` contexts tensor
    parallelism lays it out, whose `checkpoint_units` recompute together (a checkpointing mode's), whose
    `host_activations` blocks keep their saved tensors
    in host memory (activation offload) and whose `fsdp_offload_policy` FSDP's groups take (CPU offload);
    `cuda_graphs`: the compiled blocks replay CUDA graphs."""
    layout = dims.layout
    comm = comm or GradComm.default(dims, device, ddp_bucket_mb)
    style_classes = {}  # before tensor parallelism, which gives the modules they change their own styles
    for capability in capabilities:
        style_classes.update(capability.before_parallelize(model, Where(device, layout, precision)))
    if layout.tp_enabled:
        with ExitStack() as around:
            for capability in capabilities:
                around.enter_context(capability.around_tensor_parallel(model, dims.tp_mesh))
            apply_tp(model, dims.tp_mesh, layout.sequence_parallel, layout.uses_loss_parallel, style_classes)
    if layout.cp_enabled:  # each rank attends over its chunks of every sequence by ring attention
        apply_context_parallel(model, context_for(dims))
    if layout.cp_enabled or (layout.sp and model.tok_embeddings is None):
        # The input holds part of each sequence (cp chunks; a later pipeline stage's residual stream split over tp
        # under sequence parallelism): tell the model the whole length, so its rotary angles cover every position.
        model.register_forward_pre_hook(_whole_length(layout), with_kwargs=True)
    # Mixture of experts: experts sharded over ep / replicated over tp, all-to-all token routing when ep > 1.
    expert_dp_mesh = distribute_experts(model, dims)
    apply_activation_checkpointing(model, activation_checkpoint, capabilities)
    if compile:
        apply_compile(model, compile if isinstance(compile, str) else None, cuda_graphs)
    for capability in capabilities:  # each chosen block's saved tensors to host (distributed/offload.py)
        on_host = capability.host_activations(model.args.n_layers)
        if on_host is not None:
            apply_activation_offload(model, on_host[0], device, on_host[1])
    if layout.uses_fsdp:
        offload = [p for p in (c.fsdp_offload_policy(Where(device, layout)) for c in capabilities) if p is not None]
        apply_fsdp(model, dims, precision, expert_dp_mesh, comm, offload[0] if offload else None)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        # (CPU offload: the sharded parameters live in host memory; the buffers (rotary tables) on the device)
        if any(c.states_on_host for c in capabilities):
            model.to_empty(device="cpu")
            _buffers_to(model, device)
        else:
            model.to_empty(device=device)
    if device.type != "meta":  # a dry run (`paratrain train --dry-run`) keeps the laid-out model on meta: no values
        init_weights(model, seed, device=device)  # drawn on the device whatever holds them: the same values
    if layout.uses_ddp:
        model = DistributedDataParallel(model, process_group=dims.dp_group, bucket_cap_mb=comm.bucket_mb,
                                        device_ids=[device.index] if device.type == "cuda" else None)
        comm.attach_ddp(model)  # the compression hook, if any
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model
