"""One training step: forward, loss (cross-entropy; the MoE balance loss trains through the MoE outputs'
backward, `models.moe.AuxLossScaler`), backward over the micro-batches,
gradient clipping, and the optimizer (or fp16 gradient scaler) update.

`build_train_step` assembles it (the model on the meta device, laid out by `parallelize` or cut into pipeline
stages, gradient communication, the optimizer, the fp16 scaler); the trainer, the memory measurement harness
(`bench/memory_measure.py`) and `bench/gpu.py` all call it, so the estimator's accuracy bench measures the
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
import dataclasses
import functools
from dataclasses import dataclass

from torch import nn
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import loss_parallel

from paratrain.config import ActivationCheckpointConfig, OptimizerConfig
from paratrain.capabilities import gradient_reduction, loss_pieces, optimizer_entry
from paratrain.capabilities.base import Capability, Where
from paratrain.data.batch import NOT_A_TARGET, as_batch
from paratrain.distributed.compression import GradComm
from paratrain.distributed.context_parallel import ContextParallel, WholeSequenceSampler, context_for, whole_sequences
from paratrain.distributed.expert_parallel import MoEMeter
from paratrain.distributed.grad_norm import clip_grad_norm
from paratrain.distributed.parallelize import SequenceParallelSampler, parallelize, unwrap
from paratrain.distributed.pipeline import Pipeline, PipelineSampler, build_pipeline
from paratrain.distributed.tensors import full_tensor, local_tensor, right_pad, torch_dtype
from paratrain.estimate.model_states import hidden_matrix_names
from paratrain.layout import Layout
from paratrain.models import build_model
from paratrain.models.llama import cross_entropy
from paratrain.models.moe import moe_modules, set_aux_loss_scale
from paratrain.models.registry import side_heads
from paratrain.modes import Precision
from paratrain.recipe import Recipe
from paratrain.training.optim import build_optimizer, inner_optimizer


def summed_rows(per_token: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """The sum of the per-token losses of the first `rows` sequences, in float64 (evaluation: the rows after them
    are padding; a sum, unlike a mean, adds up exactly over any split of the sequences). Positions that are not
    targets (NOT_A_TARGET) add nothing."""
    return full_tensor(per_token).view(targets.shape)[:rows].double().sum()


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """`summed_rows` of the logits' per-token losses (a pipeline's last stage hands its logits)."""
    return summed_rows(cross_entropy(logits, targets, reduction="none"), targets, rows)


def make_scaler(layout: Layout, precision: str, device: torch.device):
    """fp16's dynamic loss scaler (None otherwise). With DTensor gradients the sharded scaler unscales local
    shards and agrees on overflow across ranks."""
    if not Precision(precision).loss_scaled:
        return None
    if layout.uses_fsdp or layout.tp_enabled or layout.pipelined:
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


TF32_CAPABILITY = (8, 0)  # Ampere: the first tensor cores with TF32


def apply_tf32(tf32: bool | None, precision: str, device: torch.device) -> bool:
    """training.tf32 for this process's fp32 matmuls and convolutions, through torch's switches; whether TF32 is on
    (the MFU's peak follows it). Unset: on for fp32 runs on compute capability 8.0 and newer (modes.tf32_on). CUDA
    only: elsewhere nothing is set and it is off."""
    if device.type != "cuda":
        return False
    on = Precision(precision).tf32_on(tf32) and (tf32 is not None
                                                 or torch.cuda.get_device_capability(device) >= TF32_CAPABILITY)
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+: setting the old switches too would be an error there
        matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    return on


class TokenLoss:
    """The training loss of logits against targets: the cross-entropy plus the capabilities' loss terms (z-loss, ...;
    paratrain/capabilities), each term's value summed for the step's metrics while `recording` (in forward only: a
    chunked loss's pieces run again in backward). Without terms it is the cross-entropy alone. `extra`: the names of
    more metrics the step `record`s beside the terms, per target token like them (the side heads')."""

    def __init__(self, capabilities, device: torch.device, extra: tuple[str, ...] = ()):
        self.terms = [c for c in capabilities if type(c).loss_term is not Capability.loss_term]
        self.names = [t.name for t in self.terms] + list(extra)
        self.device, self.recording = device, False
        self.sums = None  # per metric, its per-token values summed over the step's targets; then the targets' count

    def reset(self) -> None:
        self.sums = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=self.device) if self.names else None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = cross_entropy(logits, targets, reduction)
        if self.recording and self.sums is not None:
            self.sums[-1] += (targets != NOT_A_TARGET).sum()
        if not self.terms:
            return loss
        loss = full_tensor(loss)  # loss parallel's replicated DTensor as a plain tensor: the terms are plain
        values = [term.loss_term(logits, targets, reduction) for term in self.terms]
        for term, value in zip(self.terms, values):
            self.record(term.name, value, reduction, targets)
        return loss + sum(values)

    def record(self, name: str, value: torch.Tensor, reduction: str, targets: torch.Tensor) -> None:
        """Add a metric's value on `targets` to the step's sums while recording: a mean over the targets ("mean"),
        counted once per target, or their sum."""
        if self.recording:
            count = (targets != NOT_A_TARGET).sum().double() if reduction == "mean" else 1
            self.sums[self.names.index(name)] += value.detach().double() * count

    def piece(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One piece's summed loss (a chunked loss: `models.llama.chunked_cross_entropy`)."""
        return self(logits, targets, "sum")

    def step_stats(self):
        """The step's term metrics (each term's mean per target token, over every rank): the all-reduce now, on the
        device; returns a callable that reads them on the host (the trainer calls it at its next settle point), or
        None without terms. Every rank calls it: tensor-parallel ranks count the same tokens, pipeline stages without
        the loss none, so the mean over the world is the mean over the global batch's targets."""
        if self.sums is None:
            return None
        sums = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(sums)
        names = self.names

        def read() -> dict:
            values = sums.tolist()
            return {name: value / max(values[-1], 1.0) for name, value in zip(names, values)}

        return read


class ScheduleLoss:
    """The loss a pipeline schedule backpropagates from the last stage, per microbatch (scaled for fp16): the mean,
    or with a batch's `target_count` the masked sum times `weight` (set before each step); plus `more(targets, mean,
    scale)`'s term of the stage's forward just run, when set (the model's side heads: `TrainStep._side_loss`),
    the schedule computing each microbatch's loss right after its forward."""

    def __init__(self, scaler, token_loss: TokenLoss):
        self.scaler, self.weight, self.token_loss, self.more = scaler, None, token_loss, None
        # the last stage ran one of the schedule's microbatch forwards since the last call (`TrainStep._counted_chunk`):
        # the schedule's metadata inference (its first step) calls the loss once on made-up activations without one, a
        # call the step's metrics must not count
        self.forwarded = False

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        recording, self.token_loss.recording = self.token_loss.recording, self.token_loss.recording and self.forwarded
        self.forwarded = False
        try:
            mean, weight = self.weight is None, self.weight
            value = self.token_loss(logits, targets) if mean else self.token_loss(logits, targets, "sum") * weight
            more = self.more(targets, mean, lambda v: v if mean else v * weight) if self.more is not None else None
        finally:
            self.token_loss.recording = recording
        if more is not None:
            value = full_tensor(value) + more  # (loss parallel's replicated DTensor as a plain tensor, like the term)
        return self.scaler.scale(value) if self.scaler is not None else value


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
                 comm=None, vocab_size: int = 0, capabilities=(), token_loss=None):
        """`loss_group`: the ranks the loss is averaged over (dp x cp); `comm`: the run's GradComm; `vocab_size`: the
        model's (the chunked loss's automatic pieces, resolved per micro-batch from its tokens: `chunks_for`);
        `capabilities`: the run's (paratrain/capabilities), checked against the layout, whose hooks run after each
        optimizer step; `token_loss`: the loss of logits (TokenLoss: the cross-entropy and the capabilities' loss
        terms)."""
        self.capabilities, self.where = capabilities, Where(device, layout, comm=comm, optimizer=optimizer)
        self.token_loss = token_loss or TokenLoss(capabilities, device)
        self.model, self.optimizer, self.layout, self.device = model, optimizer, layout, device
        self.context = context  # context parallelism: this rank's chunks of each sequence
        self.precision, self.grad_clip, self.scaler = precision, grad_clip, scaler
        self.step_scale: torch.Tensor | None = None  # fp16: the loss scale the last step ran at (a device scalar)
        self.pipeline, self.pp_group, self.loss_group, self.comm = pipeline, pp_group, loss_group, comm
        self.memory_budget, self.probe = memory_budget, probe or StepProbe()
        for capability in capabilities:  # (the chunked loss: not under a pipeline)
            capability.check_layout(layout)
        self.vocab_size = vocab_size
        # FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does the low-precision compute.
        self.autocast = Precision(precision).low_precision and not layout.uses_fsdp
        self.moe_layers = moe_modules(unwrap(model))
        # expert load statistics; under a pipeline on every stage of an MoE model (the stages' layers are gathered)
        moe_model = bool(self.moe_layers) or (pipeline is not None and any(
            m.args.moe_experts for m in pipeline.modules.values()))
        self.moe = MoEMeter(unwrap(model), device, pp_group if pipeline is not None else None) if moe_model else None
        if pipeline is not None:  # the schedule's microbatch forwards are what the metrics count
            for stage in pipeline.stages:
                stage.forward_one_chunk = self._counted_chunk(stage, pipeline.loss_fn, stage.forward_one_chunk)
        # the model's side heads (models/family.SideHead) and the model whose training forward leaves their losses (a
        # pipeline's last stage: their terms join the schedule's loss there)
        last = unwrap(model) if pipeline is None else pipeline.last_module
        self.side_heads = side_heads(last.args) if last is not None else ()
        self.side_model = last if self.side_heads else None
        if pipeline is not None and self.side_model is not None:
            pipeline.loss_fn.more = self._side_loss
        # fused AdamW (and SGD) take `found_inf` and skip the update in their kernel (AdamW's step counts too): no
        # host read
        self.skips_on_device = bool(getattr(inner_optimizer(optimizer), "_step_supports_amp_scaling", False))
        for capability in capabilities:
            capability.after_build(model, self.where)

    def contexts(self, sync: bool = True) -> contextlib.ExitStack:
        """No gradient all-reduce on DDP's accumulation micro-steps, autocast, and loss parallelism."""
        stack = contextlib.ExitStack()
        if not sync and hasattr(self.model, "no_sync"):
            stack.enter_context(self.model.no_sync())
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=torch_dtype(self.precision)))
        if self.layout.uses_loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def forward_backward(self, micro_batches, poisoned: bool = False) -> torch.Tensor:
        """Gradients of this rank's share of the global batch; returns its mean loss (poisoned: NaN, for tests)."""
        if self.moe:
            self.moe.reset()
        self.token_loss.reset()
        if self.pipeline is not None:
            # the schedule averages its microbatches' gradients (scale_grads): each balance loss counts once
            self._set_aux_loss_scale(1.0)
            loss = self._pipeline_forward_backward(micro_batches)
            return loss * float("nan") if poisoned else loss
        accum = len(micro_batches)
        self._set_aux_loss_scale(1.0 / accum)  # the balance loss's mean over the micro-batches, like the loss's
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            batch = self._local(as_batch(batch)).to(self.device)  # T this rank's tokens under context parallelism
            x, y = batch
            self.probe.micro_start(x, y)
            with self.contexts(sync=i == accum - 1):
                with self.memory_budget.track() if self.memory_budget else contextlib.nullcontext():
                    self._recording(True)
                    loss, side = self._loss(batch, accum)
                    self._recording(False)
                if poisoned:
                    loss = loss * float("nan")
                self.probe.forward_done()
                # The side heads' loss is one more root: the loss may be a DTensor (loss parallel), it never is. (The
                # balance loss needs no root: AuxLossScaler.)
                roots = [r for r in (loss, side) if r is not None]
                torch.autograd.backward([self.scaler.scale(r) for r in roots] if self.scaler else roots)
            if self.memory_budget:
                self.memory_budget.check()
            total += full_tensor(loss.detach()) + (side.detach() if side is not None else 0)
        return total

    def _recording(self, on: bool) -> None:
        """Training forwards record their loss terms and expert loads (a pipeline's: `_recording_moe`); evaluation's
        do not."""
        self.token_loss.recording = on
        if self.moe and self.pipeline is None:
            self.moe.recording = on

    def _counted_chunk(self, stage, loss_fn: ScheduleLoss, forward_one_chunk):
        """A stage's forward of one of the schedule's microbatches, which the step's metrics count (the schedule's
        first step also runs its stages on made-up tensors outside them, to infer shapes): the expert loads during it,
        and on the last stage the loss the schedule computes after it (`ScheduleLoss.forwarded`)."""
        def counted(*args, **kwargs):
            loss_fn.forwarded = loss_fn.forwarded or stage.is_last
            if self.moe:
                self.moe.recording = True
            try:
                return forward_one_chunk(*args, **kwargs)
            finally:
                if self.moe:
                    self.moe.recording = False

        return counted

    def _set_aux_loss_scale(self, scale: float) -> None:
        """The balance loss's gradient factor for this step's forwards: `scale` times fp16's loss scale (a device
        tensor: nothing read on the host)."""
        if self.moe_layers:
            if self.scaler:
                scale = self.scaler.scale(torch.full((), scale, device=self.device))  # (initialises the scale)
            set_aux_loss_scale(self.moe_layers, scale)

    def _model_loss(self, batch, reduction: str) -> torch.Tensor:
        """The model's cross-entropy on a Batch (targets NOT_A_TARGET count nothing). Chunked, inside the model's
        forward (its head's pieces); whole, after it, from the logits: FSDP2 frees its last all-gather's buffer when
        the root's forward ends, so the whole logits are made without it."""
        x, y = batch
        packed = {} if batch.positions is None else {"positions": batch.positions}
        chunks = self.chunks_for(x)
        loss_of = self.token_loss if reduction != "none" else cross_entropy  # evaluation: the cross-entropy alone
        if self.side_model is not None and reduction != "none":  # training: the side heads run too
            packed["side_targets"] = y
        if chunks > 1:  # (reduction "none" takes per-token losses, not pieces: the piece loss goes unused)
            return self.model(x, targets=y, loss_chunks=chunks, reduction=reduction, piece_loss=self.token_loss.piece,
                              **packed)
        return loss_of(self.model(x, **packed), y, reduction)

    def chunks_for(self, x: torch.Tensor) -> int:
        """The loss's pieces for a micro-batch of this rank's tokens `x` (cut by context parallelism): the rule the
        estimator reads too (`Capability.loss_pieces`: the chunked loss's), on the micro-batch's whole sequences."""
        return loss_pieces(self.capabilities, self.layout, self.precision, self.vocab_size, x.numel() * self.layout.cp)

    def _loss(self, batch, accum: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's share of the step's loss: the mean over its share of the batch (dp x cp ranks hold as many
        tokens each) / accum, or with a loss mask its summed target losses over the global batch's target count,
        times the dp x cp ranks whose gradients FSDP/DDP average; and the side heads', scaled so (or None)."""
        if batch.target_count is None:
            return self._model_loss(batch, "mean") / accum, self._side_loss(batch[1], True, lambda v: v / accum)
        per_target = self._per_target(batch)
        return self._model_loss(batch, "sum") * per_target, self._side_loss(batch[1], False, lambda v: v * per_target)

    def _side_loss(self, y: torch.Tensor, mean: bool, scale) -> torch.Tensor | None:
        """The side heads' term of the forward just run: each head's weight x the mean over its loss terms (each its
        mean over its targets, or with a loss mask its sum), `scale`d like the main loss; each unweighted mean is the
        step's metric of the head. None without side heads."""
        if self.side_model is None:
            return None
        total = None
        for head in self.side_heads:
            losses = self.side_model.side_losses.pop(head.name)
            per_term = torch.stack([full_tensor(v) for v, _ in losses])  # summed: loss parallel's replicated DTensors
            if mean:  # over each term's targets (they may have fewer than the main loss's)
                per_term = per_term / torch.stack([count for _, count in losses]).clamp(min=1)
            value = per_term.mean()
            self.token_loss.record(head.metric, value, "mean" if mean else "sum", y)
            term = scale(value) * head.weight(self.side_model.args)
            total = term if total is None else total + term
        return total

    def _per_target(self, batch) -> float:
        ranks = dist.get_world_size(self.loss_group) if self.loss_group is not None else 1
        return ranks / max(1, batch.target_count)

    def _pipeline_forward_backward(self, micro_batches) -> torch.Tensor:
        batch, = micro_batches  # this data-parallel rank's whole slice; the schedule cuts the microbatches
        batch = self._local(as_batch(batch)).to(self.device)
        if self.scaler:
            self.scaler.scale(torch.ones((), device=self.device))  # stages without the loss need the scale too
        # The schedule averages its microbatches' losses and gradients: the masked sum is scaled up by their count.
        weight = None if batch.target_count is None else self._per_target(batch) * self.layout.pp_microbatches
        self.pipeline.loss_fn.weight = weight
        self._recording(True)  # the last stage's loss runs once per microbatch, in forward
        with self.contexts():
            loss = self.pipeline.train_step(*batch, positions=batch.positions)
        self._recording(False)
        return loss / self.scaler.get_scale() if self.scaler else loss

    def clip(self) -> torch.Tensor:
        """Clip the gradients to training.grad_clip (0: measure only); returns the global norm (a device tensor).
        Gradients that stayed on their ranks (1-bit Adam after its warm-up) are clipped by the ranks' agreed norm."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        replicas = self.comm.replica_group if self.comm is not None and self.comm.local_gradients else None
        return clip_grad_norm(self.model.parameters(), self.grad_clip or float("inf"), pp_group=self.pp_group,
                              replica_group=replicas)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss: this rank's mean averaged over the data-parallel x context-parallel ranks (on the device)."""
        return dp_mean(loss, self.loss_group)

    def scaler_scale(self) -> torch.Tensor | None:
        """fp16: the scaler's loss scale, a copy on the device (GradScaler.get_scale() would wait for the device; the
        scale is its `_scale` tensor, updated in place). None without a scaler."""
        return self.scaler._scale.detach().clone() if self.scaler is not None else None

    @staticmethod
    def finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A device bool: the (global) loss and gradient norm are finite, the same on every rank."""
        return torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))

    def update(self, finite: torch.Tensor | bool = True) -> None:
        """Apply the gradients; a non-finite step (`finite` a device bool tensor that is False) is skipped. The fp16
        scaler decides that itself; fused AdamW skips on the device."""
        if self.scaler:
            self.step_scale = self.scaler_scale()  # the scale this step ran at, before update() changes it
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
        for capability in self.capabilities:
            capability.after_optimizer_step(self.model, self.where)
        balancers = [c for c in self.capabilities if type(c).after_expert_loads is not Capability.after_expert_loads]
        loads = self.moe.loads(self.loss_group) if self.moe and balancers else None  # (the metrics' all-reduce)
        for capability in balancers if loads is not None else ():
            capability.after_expert_loads(self.model, loads, finite)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer state (local shards of sharded tensors)."""
        def nbytes(t):
            t = local_tensor(t)
            parts = [getattr(t, a) for a in getattr(t, "tensor_attrs", ())] or [t]  # torchao's states: codes, scales
            return sum(x.numel() * x.element_size() for x in parts)

        params = list(self.model.parameters())
        opt = inner_optimizer(self.optimizer)  # ZeRO-1 wraps the optimizer that holds the state
        return {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
                + sum(r.held_bytes() for r in getattr(self.comm, "riders", {}).values())}  # (local SGD's copies)

    def _local(self, batch):
        """This rank's chunks of a Batch under context parallelism; unchanged otherwise."""
        return batch if self.context is None else batch.map(self.context.shard)

    @torch.no_grad()
    def eval_loss_sum(self, batch, rows: int) -> torch.Tensor:
        """Forward only: the summed loss (float64) of the first `rows` sequences of a Batch, the same on every tp/pp
        rank; under context parallelism the sum over this rank's chunks of them (the evaluator sums over dp x cp)."""
        batch = self._local(as_batch(batch)).to(self.device)
        x, y = batch
        with self.contexts():
            if self.pipeline is not None:  # stage by stage; the loss comes from the last stage
                return self.pipeline.eval_loss(x, y, functools.partial(summed_cross_entropy, rows=rows),
                                               positions=batch.positions)
            return summed_rows(self._model_loss(batch, "none"), y, rows)

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

    @torch.no_grad()
    def target_scores(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(2, B, T) float32 on the CPU: the log-probability of each target after the tokens up to it, and 1.0 where
        it is the most likely token; the same on every rank of a data-parallel replica (whole sequences under sp and
        cp, the last stage's answer under pp). lm-eval's requests are scored so (paratrain/harness)."""
        batch, length = tokens.shape
        targets = targets.to(self.device)

        def score(logits: torch.Tensor) -> torch.Tensor:  # (B, T', V) -> (2, B, T)
            logits = full_tensor(logits)[:, :length].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            return torch.stack([logp, (logits.argmax(-1) == targets).float()])

        x = right_pad(tokens.to(self.device), self.layout.tp if self.layout.sp else 1)  # sp splits T over tp
        modules = list(self.pipeline.modules.values()) if self.pipeline is not None else [self.model]
        whole = whole_sequences(modules) if self.context is not None else contextlib.nullcontext()
        was_training = self.model.training
        for m in modules:
            m.eval()
        try:
            with whole, self.contexts():
                if self.pipeline is not None:
                    out = self.pipeline.from_last_stage(x, score, (2, batch, length))
                else:
                    out = score(self.model(x))
        finally:
            for m in modules:
                m.train(was_training)
        return out.cpu()

    def eval_chunk(self, micro_batch: int, per_rank: int) -> int:
        """Sequences per forward in evaluation: the training micro-batch, or a pipeline microbatch (of `per_rank`,
        this rank's share of a global batch)."""
        return max(1, per_rank // self.layout.pp_microbatches) if self.pipeline is not None else micro_batch


@dataclass(frozen=True)
class StepOptions:
    """What a step is built with besides the model, the layout and the recipe: the run's seed (initial weights), its
    optimizer's hyperparameters (the section the recipe names but does not hold), clipping, the run's length, and the
    measuring harness's hooks."""

    seed: int = 0
    grad_clip: float = 1.0
    steps: int = 0  # the run's optimizer steps (1-bit Adam's default warm-up is a share of them)
    optimizer: OptimizerConfig | None = None  # the recipe's optimizer's hyperparameters (None: the defaults)
    memory_budget: object = None  # observe.oom.MemoryBudget
    probe: StepProbe | None = None

    @classmethod
    def of_run(cls, cfg, **more) -> "StepOptions":
        """A run's config (paratrain.config.Config) read into step options."""
        t = cfg.training
        return cls(seed=t.seed, grad_clip=t.grad_clip, steps=t.steps, optimizer=cfg.optimizer, **more)


def default_recipe(layout: Layout) -> Recipe:
    """The recipe of a step built without one: fp32, no checkpointing, the memory tiers automatic, AdamW."""
    return Recipe(layout, precision="fp32").replace(loss_chunks=0)


def build_train_step(model_args, dims, recipe: Recipe | None = None, device: torch.device = torch.device("cpu"),
                     options: StepOptions = StepOptions()) -> TrainStep:
    """The one place a training step is assembled, for the trainer, evaluation, the memory harness and the benches.

    `model_args` (ModelArgs), `dims` (ParallelDims: the layout and its meshes), `recipe` (paratrain.recipe.Recipe:
    precision, checkpointing, memory tiers, LoRA, compilation and the run's capabilities; None: `default_recipe`),
    `options` (StepOptions). The model is built on the meta device and materialised after sharding; tied embeddings
    are the exception (materialising from meta would untie them), so those models are built for real."""
    layout = dims.layout
    recipe = recipe or default_recipe(layout)
    capabilities = recipe.capabilities
    precision = recipe.precision
    for capability in capabilities:  # the device it runs on (fp8: FP8 tensor cores), the precision the model
        capability.check_device(device)  # computes in (fp8: bf16 around its 8-bit matmuls)
        precision = capability.compute_precision(precision)
    ac = ActivationCheckpointConfig(recipe.checkpointing, recipe.every_k)
    with torch.device(device if model_args.tie_embeddings else "meta"):
        model = build_model(model_args)
    scaler = make_scaler(layout, precision, device)
    optimizer = dataclasses.replace(options.optimizer or OptimizerConfig(), name=recipe.optimizer)
    # the gradient-communication point: buckets, prefetching, and what the reduction runs (the compression
    # capability decides it on this layout, with the schedule of an optimizer that communicates itself: 1-bit Adam's)
    reduction = gradient_reduction(recipe.compression, layout, optimizer_entry(recipe.optimizer), optimizer,
                                   options.steps)
    comm = GradComm(recipe, dims, device, options.seed, reduction)
    token_loss = TokenLoss(capabilities, device, tuple(head.metric for head in side_heads(model_args)))
    pipeline = None
    if layout.pipelined:  # this rank's stages, each laid out like a model, and the schedule
        pipeline = build_pipeline(dims, model, ac, precision, recipe.compile, device, options.seed,
                                  ScheduleLoss(scaler, token_loss), comm, capabilities)
        model = pipeline.model
    else:
        model = parallelize(model, dims, ac, precision, recipe.compile, device, options.seed, comm=comm,
                            capabilities=capabilities, cuda_graphs=recipe.cuda_graphs)
    comm.prepare()
    # CPU offload (Capability.states_on_host): the sharded parameters, their gradients and the optimizer state live in
    # host memory, and the optimizer steps there
    opt_device = torch.device("cpu") if any(c.states_on_host for c in capabilities) else device
    opt = build_optimizer(unwrap(model), optimizer, opt_device,
                          dims.dp_group if layout.zero1 else None, comm=comm, precision=precision,
                          hidden=hidden_matrix_names(model_args, recipe.lora),
                          replica_mesh=dims.dp_mesh if layout.uses_ddp else None)
    return TrainStep(model, opt, layout, precision=precision, device=device, grad_clip=options.grad_clip,
                     scaler=scaler, pipeline=pipeline, pp_group=dims.pp_group, loss_group=dims.loss_group,
                     memory_budget=options.memory_budget, probe=options.probe, comm=comm,
                     context=context_for(dims),  # cp: batches cut to this rank's chunks
                     vocab_size=model_args.vocab_size, capabilities=capabilities,
                     token_loss=token_loss)


def build_run_step(spec, dims, device: torch.device, memory_budget=None) -> TrainStep:
    """The step of the run `spec` (a RunSpec) on this rank: `build_train_step` with the run's recipe and settings, as
    the trainer and the dry run (`paratrain train --dry-run`) build it."""
    return build_train_step(spec.model_args, dims, spec.recipe(device.type), device,
                            StepOptions.of_run(spec.cfg, memory_budget=memory_budget))
