"""fp8 training (`training.precision = "fp8"`): the blocks' linear layers multiply in float8 through torchao.

Which layers: `paratrain.models.registry.float8_linears` (the blocks' projections with dimensions divisible by 16,
less `[float8] keep_bf16`); the rest of the model computes in bf16 as a bf16 run does. Each converted layer casts its
input, its weight and its output gradient to float8 with a scale taken from the tensor's absolute maximum at that
moment (dynamic scaling): one scale per tensor ("tensorwise") or per row ("rowwise"). Off CUDA, and so in the test
suite, torchao emulates the float8 matmul (`emulate=True`: the same casts and scales, the product of the dequantised
values), so every layout's fp8 path runs on CPU ranks.

Where the layout is applied (`parallelize`): the conversion comes first (before tensor parallelism, which then gives
tensorwise layers torchao's float8 styles: the column-parallel input is cast before its all-gather), and FSDP shards
the converted layers like any others; with `fsdp_float8_all_gather`, the sharded weights are cast to float8 before
the all-gather (half the bytes), with their scales computed for every layer in one all-reduce after each optimizer
step (`precompute_scales`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError
from paratrain.models.registry import float8_linears
from paratrain.modes import tensorwise_scales

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first tensor cores with FP8


def keep_names(text: str) -> tuple[str, ...]:
    """[float8] keep_bf16 as names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def check_float8_device(device: torch.device) -> None:
    """A one-line refusal on a GPU without FP8 tensor cores (emulating there would be slower than bf16)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"training.precision=fp8 needs FP8 tensor cores (compute capability 8.9+: H100, H200, L4, "
                        f"L40S, RTX 4090, ...); {torch.cuda.get_device_name(device)} is {major}.{minor}: use bf16")


def gathers_float8(cfg, device: torch.device, uses_fsdp: bool) -> bool:
    """[float8] fsdp_float8_all_gather resolved: tensorwise under FSDP, on by default on CUDA."""
    if not tensorwise_scales(cfg.recipe) or not uses_fsdp:
        return False
    return device.type == "cuda" if cfg.fsdp_float8_all_gather is None else cfg.fsdp_float8_all_gather


def linear_config(cfg, device: torch.device, uses_fsdp: bool):
    """torchao's Float8LinearConfig of a [float8] section on this device."""
    from torchao.float8 import Float8LinearConfig  # lazy: torchao is imported by fp8 runs only

    emulate = device.type != "cuda"
    if not tensorwise_scales(cfg.recipe):
        return dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=emulate)
    return Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=gathers_float8(cfg, device, uses_fsdp))


def _autocast_input(module, args):
    # torchao's Float8Linear casts its input to CUDA's autocast dtype only; under a CPU autocast do the same, so an
    # emulated run computes in bf16 around its float8 matmuls as a CUDA run does
    x = args[0]
    if x.device.type != "cuda" and torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)), *args[1:])
    return None


def apply_float8(model: nn.Module, cfg, device: torch.device, uses_fsdp: bool) -> set[str]:
    """Convert the float8 linear layers of `model` (a whole model or a pipeline stage, on the meta device, before any
    other part of the layout); returns their module names."""
    from torchao.float8 import convert_to_float8_training  # lazy: torchao is imported by fp8 runs only

    check_float8_device(device)
    chosen = {p.name.rsplit(".", 1)[0] for p in float8_linears(model.args, keep_names(cfg.keep_bf16))}
    convert_to_float8_training(model, config=linear_config(cfg, device, uses_fsdp),
                               module_filter_fn=lambda module, name: name in chosen)
    for name in chosen:
        if name.split(".")[1] in model.layers:  # (a pipeline stage holds some of the blocks)
            model.get_submodule(name).register_forward_pre_hook(_autocast_input)
    return chosen


def float8_tp_styles(recipe: str, device: torch.device):
    """(column-parallel, row-parallel) styles for float8 layers under tensor parallelism: torchao's float8 styles for
    tensorwise scaling on CUDA (activations and their gradients cross the tp ranks as float8: NCCL carries it); None
    for rowwise, whose layers take the plain styles (torchao has none for it), and off CUDA, where gloo has no float8
    type: the plain styles move bf16 and each rank casts its own (the same values: a tensorwise scale is taken over
    the whole DTensor)."""
    if not tensorwise_scales(recipe) or device.type != "cuda":
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step with float8 all-gathers: every layer's weight scale in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state):
    """`state` (a nested state dict) with torchao's float8 weight wrappers (the parameters of float8 all-gathers, and
    the optimizer states made like them) replaced by the plain tensors they wrap, sharing their storage: what a
    checkpoint saves and loads into. DCP would otherwise pickle the wrapper's class into the checkpoint, which a
    weights-only load refuses (and which ties the checkpoint to torchao)."""
    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_tensors(v) for v in state]
    if isinstance(state, DTensor):
        local = state._local_tensor
        inner = _unwrapped(local)
        if inner is local:
            return state
        return DTensor.from_local(inner, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    return _unwrapped(state) if isinstance(state, torch.Tensor) else state


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a one-tensor wrapper subclass (torchao's WeightWithDynamicFloat8CastTensor)."""
    while type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        if len(names) != 1:
            break
        tensor = getattr(tensor, names[0])
    return tensor
