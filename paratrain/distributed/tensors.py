"""Helpers for code that sees either plain tensors or DTensors, depending on the layout."""

from __future__ import annotations

import torch

from paratrain.modes import Precision


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype of a precision's name (paratrain.modes.Precision: fp32, bf16, fp16)."""
    return getattr(torch, Precision(precision).dtype_name)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value: a DTensor is gathered (a collective: every rank of its mesh must call this)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class _OwnTensor(torch.autograd.Function):
    """The same memory as a tensor of its own in autograd's eyes, not a view: FSDP2 warns of a view among a module's
    outputs, because an in-place op on a view would bypass the pre-backward hook it registers there."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()  # shares x's memory and version counter: no copy, and in-place changes are still caught

    @staticmethod
    def backward(ctx, grad):
        return grad


def not_a_view(module, args, output):
    """A forward hook handing on a view output as a tensor of its own (no copy): tensor parallelism's `to_local()`
    (the output projection's, laid out by ColwiseParallel) returns a view of the DTensor's local tensor."""
    return _OwnTensor.apply(output) if output._is_view() else None


def right_pad(tokens: torch.Tensor, multiple: int) -> torch.Tensor:
    """(B, T) token ids padded at the end to a multiple of `multiple` (sequence parallelism splits the sequence over
    tp ranks). Causal attention keeps every real position's output independent of the padding after it."""
    extra = -tokens.shape[1] % multiple
    return torch.nn.functional.pad(tokens, (0, extra)) if extra else tokens
