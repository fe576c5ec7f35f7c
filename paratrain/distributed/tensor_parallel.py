"""Tensor and sequence parallelism by parameter role: the family's parameter table (`paratrain.models.family`) says
what each module is (column- or row-parallel Linear, vocabulary-parallel embedding or output, norm, replicated,
routed expert) and its sublayers what kind they are (attention, mlp, moe); this file gives each its DTensor style.
A new model family needs no change here as long as its parameters use these roles.

Megatron-style: column-wise in, row-wise out, vocabulary-parallel embedding and output. With sequence parallelism the
norms and residual stream are sharded along the sequence (Shard(1)) and gathered just before each sublayer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput
from torch.distributed.tensor.parallel import parallelize_module

from paratrain.models.registry import attention_shape, family_of, parameters

# A sublayer's inputs under sequence parallelism: the residual stream first (gathered), the rest untouched.
_SUBLAYER_ARITY = {"attention": 3, "mlp": 1}  # attention(x, cos, sin), mlp(x)


def replicated_inputs(inputs, mesh) -> tuple:
    """A replicated module's inputs as replicated DTensors (a sublayer's input gathered under sequence parallelism
    already is one: a replicated down-projection reads it)."""
    return tuple(x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 for x in inputs)


def replicated_style():
    """Without sequence parallelism the norms see whole activations (and an MoE router always does); still
    make their weights replicated DTensors, so every parameter is a DTensor and gradient scaling/clipping
    never mixes the two kinds."""

    class ReplicateParallel(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            def to_dtensor(mod, inputs, mesh):
                return replicated_inputs(inputs, mesh)

            def to_local(mod, outputs, mesh):
                return outputs.to_local()

            return distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)

    return ReplicateParallel()


class _SumTailGradient(torch.autograd.Function):
    """Identity forward; backward sums the last `tail` columns of the gradient over the tp group (the part every
    rank's heads read, each rank contributing its own heads' share)."""

    @staticmethod
    def forward(ctx, x, tail: int, group):
        ctx.tail, ctx.group = tail, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tail = grad[..., -ctx.tail:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.tail:] = tail
        return grad, None, None


def shared_key_style(tail: int):
    """A replicated Linear whose output's last `tail` columns are a key every attention head reads (role
    "shared_key": a key-value down-projection whose rotary key every head shares). Tensor parallelism splits the heads, so each rank's
    gradient of that key holds its heads' share: summed here, the weight's gradient and the input's are whole, the
    same on every rank. (The rest of its output, the latent, feeds a column-parallel projection, whose input
    gradient arrives already reduced.)"""

    class SharedKeyParallel(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            def to_dtensor(mod, inputs, mesh):
                return replicated_inputs(inputs, mesh)

            def to_local(mod, outputs, mesh):
                return _SumTailGradient.apply(outputs.to_local(), tail, mesh.get_group())

            return distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)

    return SharedKeyParallel()


def gathered_sequence_parallel():
    """The final norm under sequence parallelism: sequence-sharded like every norm, its output all-gathered to the
    whole sequences once (the gather the output projection needs anyway), so a chunked loss cuts its pieces from whole
    hidden states (slicing a sequence-sharded tensor would gather it again for every piece)."""

    class GatheredSequenceParallel(SequenceParallel):
        @staticmethod
        def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
            return outputs.redistribute(placements=[Replicate()])

    return GatheredSequenceParallel()


def scattered_replicated():
    """A replicated matrix outside the blocks under sequence parallelism (a side head's projection): it
    reads the gathered norms' whole sequences (Replicate DTensors) and hands the residual stream back sharded along
    the sequence, a plain tensor like a block's output."""

    class ScatteredReplicate(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            def to_sequence_shard(mod, outputs, mesh):
                return outputs.redistribute(placements=[Shard(1)]).to_local()

            return distribute_module(module, mesh, output_fn=to_sequence_shard)

    return ScatteredReplicate()


def module_roles(params) -> dict[str, str]:
    """Module path -> role, in table order; every parameter of one module must share its role."""
    roles: dict[str, str] = {}
    for p in params:
        if roles.setdefault(p.module, p.role) != p.role:
            raise ValueError(f"{p.name}: role {p.role}, but its module's other parameters are {roles[p.module]}")
    return roles


class _Styles:
    def __init__(self, sequence_parallel: bool, loss_parallel: bool, shared_key: int = 0):
        self.sp, self.loss_parallel = sequence_parallel, loss_parallel
        self.shared_key = shared_key  # the width of a "shared_key" module's key (AttentionShape.shared_key)
        self.residual = Shard(1) if sequence_parallel else Replicate()

    def of(self, role: str, sublayer_output, style_classes=None):
        """The style of a module with this role; `sublayer_output`: the layout its sublayer hands back;
        `style_classes`: (column, row) style classes a capability gave the module (fp8's styles)."""
        colwise, rowwise = style_classes or (ColwiseParallel, RowwiseParallel)

        if role == "embedding":
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=self.residual)
        if role == "output":  # after the final norm, which hands whole sequences (gathered_sequence_parallel)
            return ColwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(-1) if self.loss_parallel else Replicate(),
                                   use_local_output=not self.loss_parallel)
        if role == "colwise":
            return colwise()
        if role == "rowwise":
            return rowwise(output_layouts=sublayer_output)
        if role == "norm":
            return SequenceParallel() if self.sp else replicated_style()
        if role == "head_norm":
            # Its input (B, T, H, D) holds this rank's heads (the column-parallel projection's output): sharded on
            # the head dim, with or without SP; the gain's gradient is then summed over the ranks' heads.
            return SequenceParallel(sequence_dim=2, use_local_output=True)
        if role == "replicated":
            return replicated_style()
        if role == "shared_key":
            return shared_key_style(self.shared_key)
        if role == "expert":
            return None  # routed experts are spread by expert parallelism, replicated over tp
        raise ValueError(f"unknown tensor-parallel role '{role}'")

    def sublayer(self, kind: str):
        """(the layout a rowwise projection inside hands back, the style preparing the sublayer's input or None)."""

        if kind == "moe":
            # Mixture of experts: every tp rank routes all of its data-parallel rank's tokens (gathered along the
            # sequence first under sequence parallelism) through the same replicated router and experts; only the
            # shared expert is tensor-parallel. Experts are spread by expert parallelism instead.
            if not self.sp:
                return Replicate(), None
            # Whole sequences in (routing and the balance loss are per sequence), the residual's shard out.
            return Replicate(), PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        if kind not in _SUBLAYER_ARITY:
            raise ValueError(f"unknown sublayer kind '{kind}'")
        if not self.sp:
            return self.residual, None
        rest = (None,) * (_SUBLAYER_ARITY[kind] - 1)
        return self.residual, PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                                 desired_input_layouts=(Replicate(), *rest))


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool, loss_parallel: bool,
             style_classes: dict | None = None) -> None:
    """Lay out `model` (a whole model or a pipeline stage, before any other wrapping) over `tp_mesh` by the roles of
    its family's parameter table. `style_classes`: {module name: (column, row) style classes} for the modules a
    capability changed (paratrain/capabilities: fp8's layers); the others take the plain ones."""
    style_classes = style_classes or {}
    args = model.args
    family, table = family_of(args), parameters(args)
    styles = _Styles(sequence_parallel, loss_parallel, attention_shape(args).shared_key)
    # Blocks outside `layers` (the side heads', layer None in the table: `Transformer.extra_blocks`) are laid out like
    # the model's; the side heads' other modules like those around the blocks (the norms like the final norm, a
    # replicated projection `scattered_replicated`).
    extra_blocks = model.extra_blocks()
    outside = [p for p in table if p.layer is None and not any(p.name.startswith(b) for b in extra_blocks)]
    # A pipeline stage lacks the embedding (all but the first) or the head (all but the last).
    top = {m: top_style(styles, r) for m, r in module_roles(outside).items()
           if getattr(model, m.split(".")[0]) is not None}
    # (routed experts outside the blocks: no style, spread by expert parallelism)
    parallelize_module(model, tp_mesh, {m: style for m, style in top.items() if style is not None})

    by_layer: dict[int, list] = {}
    for p in table:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
    for key, block in model.layers.items():
        roles = module_roles(by_layer[int(key)])
        classes = {m: style_classes.get(f"layers.{key}.{m}") for m in roles}
        parallelize_module(block, tp_mesh, block_plan(styles, family.sublayers(args, int(key)), roles, classes))
    for prefix, (index, block) in extra_blocks.items():
        roles = {m[len(prefix):]: r for m, r in module_roles(p for p in table if p.name.startswith(prefix)).items()}
        parallelize_module(block, tp_mesh, block_plan(styles, family.sublayers(args, index), roles, {}))


def top_style(styles: _Styles, role: str):
    """The style of a module outside the blocks: under sequence parallelism its norms gather their output (the final
    norm's, before the head; a side head's, before the head or its projection), which hands the residual
    stream back sharded."""
    if styles.sp and role == "norm":
        return gathered_sequence_parallel()
    if styles.sp and role == "replicated":
        return scattered_replicated()
    return styles.of(role, styles.residual)


def block_plan(styles: _Styles, kinds: dict, roles: dict[str, str], classes: dict) -> dict:
    """A block's plan: each module's style by its role (module paths relative to the block; `classes`: a
    capability's style classes per module, or None) and the styles preparing its sublayers' inputs."""
    outputs, prepare = {}, {}
    for name, kind in kinds.items():
        outputs[name], prepare[name] = styles.sublayer(kind)
    plan = {}
    for module, role in roles.items():
        style = styles.of(role, outputs.get(module.split(".")[0], styles.residual), classes.get(module))
        if style is not None:
            plan[module] = style
    plan.update({name: style for name, style in prepare.items() if style is not None})
    return plan
