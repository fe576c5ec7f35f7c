"""LoRA adapters under tensor parallelism: split with the weight they adapt.

torch's ColwiseParallel splits every parameter of its Linear on dim 0 and RowwiseParallel only the weight and bias,
so the adapters are taken off their projection while the plan is applied and put back as DTensors laid out with the
weight: beside a column-parallel weight (Shard(0)) B is split by rows and A whole, so B A x comes out split like W x;
beside a row-parallel one (Shard(1)) A is split by columns and B whole, so B A x is a partial sum like W x, reduced
by the same output hook.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from paratrain.models.lora import LoRALinear


@contextlib.contextmanager
def adapters_aside(block: nn.Module, tp_mesh):
    """Apply a tensor-parallel plan to `block` inside this; its adapters come back split with their weights."""
    held = [(m, m._parameters.pop("lora_a"), m._parameters.pop("lora_b"))
            for m in block.modules() if isinstance(m, LoRALinear)]
    yield
    for module, a, b in held:
        colwise = module.weight.placements[0] == Shard(0)
        for name, value, placement in (("lora_a", a, Replicate() if colwise else Shard(1)),
                                       ("lora_b", b, Shard(0) if colwise else Replicate())):
            split = distribute_tensor(value.detach(), tp_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=value.requires_grad))
