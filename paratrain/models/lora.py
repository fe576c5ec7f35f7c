"""LoRA adapters on a plain model (no parallel code): `apply_lora` turns each target projection (models/lora_params.py)
into a `LoRALinear` — the same Linear, its `weight` (and bias) unchanged under the same names, plus `lora_a` and
`lora_b` — and freezes every other parameter. The capability's `before_parallelize` hook
(paratrain/capabilities/lora.py, whose `LoRA` value these functions take) calls it first, on the meta device, so
tensor parallelism, FSDP and pipeline stages lay the adapters out like the rest."""

from __future__ import annotations

from torch import nn
import torch
import torch.nn.functional as F

from paratrain.models.lora_params import is_adapter
from paratrain.models.presets import format_params


class LoRALinear(nn.Linear):
    """y = W x (+ b) + scale B A dropout(x). The adapter runs in the input's dtype: a frozen base stored in bf16 makes
    bf16 activations, and the fp32 adapters meet them (under autocast both are cast anyway)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        h = F.linear(dropped, self.lora_a.to(x.dtype))
        return super().forward(x) + F.linear(h, self.lora_b.to(x.dtype)) * self.lora_scale

    @classmethod
    def adapting(cls, linear: nn.Linear, lora) -> LoRALinear:
        """A LoRALinear holding `linear`'s own parameters (same tensors, same names) and new adapters on its device."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight
        out.bias = linear.bias
        like = dict(device=linear.weight.device, dtype=torch.float32)
        out.lora_a = nn.Parameter(torch.empty(lora.rank, linear.in_features, **like))
        out.lora_b = nn.Parameter(torch.empty(linear.out_features, lora.rank, **like))
        out.lora_dropout = lora.dropout  # a float, not a child module: TP styles lay out every submodule as a Linear
        out.lora_scale = lora.scale
        return out


def apply_lora(model: nn.Module, lora, frozen_dtype: torch.dtype | None = None) -> None:
    """Adapters on every target of `model` (a whole model or a pipeline stage: blocks it lacks are skipped); every
    other parameter frozen, and stored in `frozen_dtype` when given (it never changes: no fp32 master copy)."""
    for p in lora.target_weights(model.args):
        _, index, rest = p.name.split(".", 2)
        if index not in model.layers:
            continue
        parent_name, _, leaf = rest[: -len(".weight")].rpartition(".")
        parent = model.layers[index].get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear.adapting(getattr(parent, leaf), lora))
    freeze_base(model)
    if frozen_dtype is not None:
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(frozen_dtype)


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def lora_summary(model: nn.Module) -> str:
    """One line: the trainable and frozen parameters of `model` (of this rank's stages under a pipeline)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    share = trainable / max(1, trainable + frozen)
    return f"LoRA: {format_params(trainable)} trainable parameters ({share:.2%}), {format_params(frozen)} frozen"
