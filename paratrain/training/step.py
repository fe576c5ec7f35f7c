"""One training step: forward, loss (cross-entropy + the MoE balance loss), backward over the micro-batches,
gradient clipping, and the optimizer (or fp16 gradient scaler) update.

`build_train_step` assembles it (the model on the meta device, laid out by `parallelize` or cut into pipeline
stages, gradient communication, the optimizer, the fp16 scaler); the trainer, the memory measurement harness
(`paratrain/estimate/measure.py`) and `bench/gpu.py` all call it, so the estimator's accuracy bench measures the
code users train with.

The step never reads a device value on the host: the loss (averaged over dp x cp), the gradient norm and the
`finite` flag stay tensors on the device, clipping scales by a device tensor, and a non-finite step is skipped on
the device where the optimizer can (fused AdamW's `found_inf`, what `optimizer.impl=auto` picks on CUDA; the fp16
scaler). The trainer reads them on log steps only (`training/loop.py`). A pipelined model presents the same interface:
`forward_backward` hands this rank's slice of the batch to the schedule, which runs forward and backward of its
microbatches; evaluation and sampling run the stages forward one after the other. Under context parallelism
(`context`) every batch of whole sequences is cut to this rank's chunks first, and sampling runs whole prompts.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.context_parallel import ContextParallel, WholeSequenceSampler, context_for
from paratrain.distributed.expert_parallel import MoEMeter
from paratrain.distributed.grad_norm import clip_grad_norm
from paratrain.distributed.parallelize import PRECISION_DTYPES, SequenceParallelSampler, parallelize, unwrap
from paratrain.distributed.pipeline import Pipeline, PipelineSampler, build_pipeline
from paratrain.distributed.tensors import full_tensor
from paratrain.layout import Layout
from paratrain.models.llama import cross_entropy
from paratrain.models.moe import balance_loss, moe_modules
from paratrain.training.optim import build_optimizer, inner_optimizer


def summed_rows(per_token: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """The sum of the per-token losses of the first `rows` sequences, in float64 (evaluation: the rows after them
    are padding; a sum, unlike a mean, adds up exactly over any split of the sequences)."""
    return full_tensor(per_token).view(targets.shape)[:rows].double().sum()


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """`summed_rows` of the logits' per-token losses (a pipeline's last stage hands its logits)."""
    return summed_rows(cross_entropy(logits, targets, reduction="none"), targets, rows)


def make_scaler(layout: Layout, precision: str, device: torch.device):
    """fp16's dynamic loss scaler (None otherwise). With DTensor gradients the sharded scaler unscales local
    shards and agrees on overflow across ranks."""
    if precision != "fp16":
        return None
    if layout.uses_fsdp or layout.tp_enabled or layout.pipelined:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def schedule_loss(scaler):
    """The loss a pipeline schedule backpropagates from the last stage, per microbatch (scaled for fp16)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = cross_entropy(logits, targets)
        return scaler.scale(value) if scaler is not None else value

    return loss


def dp_mean(value: torch.Tensor, group) -> torch.Tensor:
    """The mean of a scalar over the ranks of `group` (gloo has no AVG: sum, then divide); stays on the device."""
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    value /= dist.get_world_size(group)
    return value


class StepProbe:
    """Hooks into a step for measurement (the memory harness labels allocations by phase); no-ops here."""

    def micro_start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    def forward_done(self) -> None:
        """After the micro-step's loss is computed, before its backward."""


class TrainStep:
    def __init__(self, model: nn.Module, optimizer, layout: Layout, *, precision: str, device: torch.device,
                 grad_clip: float, scaler=None, pipeline: Pipeline | None = None, pp_group=None, loss_group=None,
                 memory_budget=None, probe: StepProbe | None = None, context: ContextParallel | None = None,
                 comm=None, loss_chunks: int = 1):
        """`loss_group`: the ranks the loss is averaged over (dp x cp); `comm`: the run's GradComm; `loss_chunks`:
        pieces of each micro-batch's tokens the output projection and loss run over (paratrain/memory.py)."""
        self.model, self.optimizer, self.layout, self.device = model, optimizer, layout, device
        self.context = context  # context parallelism: this rank's chunks of each sequence
        self.precision, self.grad_clip, self.scaler = precision, grad_clip, scaler
        self.pipeline, self.pp_group, self.loss_group, self.comm = pipeline, pp_group, loss_group, comm
        self.memory_budget, self.probe = memory_budget, probe or StepProbe()
        self.loss_chunks = loss_chunks
        # FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does the low-precision compute.
        self.autocast = precision != "fp32" and not layout.uses_fsdp
        self.moe_layers = moe_modules(unwrap(model))
        self.moe = MoEMeter(unwrap(model)) if self.moe_layers else None  # expert load statistics
        # fused AdamW (and SGD) take `found_inf` and skip the update in their kernel (AdamW's step counts too): no
        # host read
        self.skips_on_device = bool(getattr(inner_optimizer(optimizer), "_step_supports_amp_scaling", False))

    def contexts(self, sync: bool = True) -> contextlib.ExitStack:
        """No gradient all-reduce on DDP's accumulation micro-steps, autocast, and loss parallelism."""
        stack = contextlib.ExitStack()
        if not sync and hasattr(self.model, "no_sync"):
            stack.enter_context(self.model.no_sync())
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=PRECISION_DTYPES[self.precision]))
        if self.layout.uses_loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack

    def forward_backward(self, micro_batches, poisoned: bool = False) -> torch.Tensor:
        """Gradients of this rank's share of the global batch; returns its mean loss (poisoned: NaN, for tests)."""
        if self.moe:
            self.moe.reset()
        if self.pipeline is not None:
            loss = self._pipeline_forward_backward(micro_batches)
            return loss * float("nan") if poisoned else loss
        accum = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = self._local(x), self._local(y)  # (B, T), T this rank's tokens under context parallelism
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.probe.micro_start(x, y)
            with self.contexts(sync=i == accum - 1):
                with self.memory_budget.track() if self.memory_budget else contextlib.nullcontext():
                    # mean over this rank's share of the batch (dp x cp ranks hold as many tokens each)
                    loss = self._loss(x, y) / accum
                    aux = None
                    if self.moe_layers:  # the balance loss, same scaling; recorded before backward recomputes
                        aux = balance_loss(self.moe_layers) / accum
                        self.moe.record()
                if poisoned:
                    loss = loss * float("nan")
                self.probe.forward_done()
                # The balance loss is a second root: the loss may be a DTensor (loss parallel), aux never is.
                roots = [loss] if aux is None else [loss, aux]
                torch.autograd.backward([self.scaler.scale(r) for r in roots] if self.scaler else roots)
            if self.memory_budget:
                self.memory_budget.check()
            total += full_tensor(loss.detach())
        return total

    def _loss(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The cross-entropy of the model on (x, y). Chunked, inside the model's forward (its head's pieces); whole,
        after it, from the logits: FSDP2 frees its last all-gather's buffer when the root's forward ends, so the whole
        logits are made without it."""
        if self.loss_chunks > 1:
            return self.model(x, targets=y, loss_chunks=self.loss_chunks, reduction=reduction)
        return cross_entropy(self.model(x), y, reduction)

    def _pipeline_forward_backward(self, micro_batches) -> torch.Tensor:
        (x, y), = micro_batches  # this data-parallel rank's whole slice; the schedule cuts the microbatches
        if self.scaler:
            self.scaler.scale(torch.ones((), device=self.device))  # stages without the loss need the scale too
        with self.contexts():
            loss = self.pipeline.train_step(self._local(x).to(self.device), self._local(y).to(self.device))
        return loss / self.scaler.get_scale() if self.scaler else loss

    def clip(self) -> torch.Tensor:
        """Clip the gradients to training.grad_clip (0: measure only); returns the global norm (a device tensor)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        return clip_grad_norm(self.model.parameters(), self.grad_clip or float("inf"), pp_group=self.pp_group)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss: this rank's mean averaged over the data-parallel x context-parallel ranks (on the device)."""
        return dp_mean(loss, self.loss_group)

    @staticmethod
    def finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A device bool: the (global) loss and gradient norm are finite, the same on every rank."""
        return torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))

    def update(self, finite: torch.Tensor | bool = True) -> None:
        """Apply the gradients; a non-finite step (`finite` a device bool tensor that is False) is skipped. The fp16
        scaler decides that itself; fused AdamW skips on the device."""
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif finite is True:
            self.optimizer.step()
        elif self.skips_on_device:
            inner = inner_optimizer(self.optimizer)
            # 1.0: the kernel leaves parameters, moments and step counts alone (on the parameters' device: host memory
            # under CPU offload, where the step waits for the gradients' copies anyway)
            inner.found_inf = (~finite).float().to(inner.param_groups[0]["params"][0].device)
            try:
                self.optimizer.step()
            finally:
                del inner.found_inf
        elif bool(finite):
            # The one host read left on the step: torch's foreach and for AdamW cannot skip an update on the device.
            # (On CUDA, optimizer.impl=auto picks fused AdamW, which does; on a CPU the flag is host memory.)
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return self.context.shard(t) if self.context is not None else t

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> torch.Tensor:
        """Forward only: the summed loss (float64) of the first `rows` sequences of (x, y), the same on every tp/pp
        rank; under context parallelism the sum over this rank's chunks of them (the evaluator sums over dp x cp)."""
        x, y = self._local(x).to(self.device), self._local(y).to(self.device)
        with self.contexts():
            if self.pipeline is not None:  # stage by stage; the loss comes from the last stage
                return self.pipeline.eval_loss(x, y, functools.partial(summed_cross_entropy, rows=rows))
            return summed_rows(self._loss(x, y, reduction="none"), y, rows)

    def sampler(self, vocab_size: int) -> nn.Module:
        """A callable model for `generate.sample` (whole prompts on every rank, also under context parallelism)."""
        multiple = self.layout.tp if self.layout.sp else 1  # sequence parallelism splits the sequence over tp
        if self.pipeline is not None:
            sampler = PipelineSampler(self.pipeline, vocab_size, multiple)
        else:
            sampler = SequenceParallelSampler(self.model, multiple) if multiple > 1 else self.model
        if self.context is None:
            return sampler
        modules = self.pipeline.modules.values() if self.pipeline is not None else [self.model]
        return WholeSequenceSampler(sampler, modules)

    def eval_chunk(self, micro_batch: int, per_rank: int) -> int:
        """Sequences per forward in evaluation: the training micro-batch, or a pipeline microbatch (of `per_rank`,
        this rank's share of a global batch)."""
        return max(1, per_rank // self.layout.pp_microbatches) if self.pipeline is not None else micro_batch


def build_train_step(model_args, dims, device: torch.device, *, precision: str = "fp32", activation_checkpoint=None,
                     compile: bool | str = False, seed: int = 0, optimizer=None, parallel=None, memory=None,
                     grad_clip: float = 1.0, memory_budget=None, probe: StepProbe | None = None) -> TrainStep:
    """The one place a training step is assembled, for the trainer, the memory harness and the benches alike.

    `model_args` (ModelArgs), `dims` (ParallelDims: the layout and its meshes), `activation_checkpoint`
    (ActivationCheckpointConfig; None: off), `optimizer` (OptimizerConfig; None: the defaults), `parallel`
    (ParallelConfig: gradient compression, DDP buckets, FSDP prefetching; None: the defaults), `memory` (MemoryConfig:
    the memory tiers, paratrain/memory.py; None: the defaults). The model is built on
    the meta device and materialised after sharding; tied embeddings are the exception (materialising from meta would
    untie them), so those models are built for real."""
    from paratrain.config import ActivationCheckpointConfig, MemoryConfig, OptimizerConfig, ParallelConfig
    from paratrain.memory import loss_chunks
    from paratrain.distributed.compression import GradComm
    from paratrain.models import build_model

    layout = dims.layout
    ac = activation_checkpoint or ActivationCheckpointConfig()
    memory = memory or MemoryConfig()
    with torch.device(device if model_args.tie_embeddings else "meta"):
        model = build_model(model_args)
    scaler = make_scaler(layout, precision, device)
    comm = GradComm(parallel or ParallelConfig(), dims, device, seed)  # gradient compression, buckets, prefetching
    pipeline = None
    if layout.pipelined:  # this rank's stages, each laid out like a model, and the schedule
        pipeline = build_pipeline(dims, model, ac, precision, compile, device, seed, schedule_loss(scaler), comm,
                                  memory)
        model = pipeline.model
    else:
        model = parallelize(model, dims, ac, precision, compile, device, seed, comm=comm, memory=memory)
    comm.prepare()
    # CPU offload: the sharded parameters, their gradients and the optimizer state live in host memory, and the
    # optimizer steps there
    opt_device = torch.device("cpu") if memory.cpu_offload else device
    opt = build_optimizer(unwrap(model), optimizer or OptimizerConfig(), opt_device,
                          dims.dp_group if layout.zero1 else None, comm=comm)
    return TrainStep(model, opt, layout, precision=precision, device=device, grad_clip=grad_clip, scaler=scaler,
                     pipeline=pipeline, pp_group=dims.pp_group, loss_group=dims.loss_group,
                     memory_budget=memory_budget, probe=probe, comm=comm,
                     context=context_for(dims),  # cp: batches cut to this rank's chunks
                     loss_chunks=loss_chunks(memory.loss_chunks, layout, precision))
