"""A test-only model family, `llama-qkv-bias`: Llama with biases on the q/k/v projections (Qwen2's attention).

Adding it takes this one module (the nn.Module, its parameter table and sublayers) and one registry line (the
`register_family` call at the bottom); the estimator, the planner and the parallel code are untouched: they read
the table. Importing this module registers the family, which is how ranks spawned by a test find it (the
registry records this module in the environment they inherit)."""

from __future__ import annotations

from functools import partial

from torch import nn

from paratrain.models import ModelFamily, register_family
from paratrain.models.args import ModelArgs
from paratrain.models.llama import Attention, Transformer
from paratrain.models.llama_params import attention_params, decoder_params, decoder_sublayers

NAME = "llama-qkv-bias"


class BiasAttention(Attention):
    """Llama's attention with `bias=True` on wq, wk and wv (wo keeps none)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for name in ("wq", "wk", "wv"):
            linear = getattr(self, name)
            setattr(self, name, nn.Linear(linear.in_features, linear.out_features, bias=True))


class QKVBiasTransformer(Transformer):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for block in self.layers.values():
            block.attention = BiasAttention(args)


def qkv_bias_params(args: ModelArgs):
    # q/k/v biases are column-parallel like their weights: split on dim 0 under tensor parallelism.
    return decoder_params(args, partial(attention_params, bias=True))


FAMILY = register_family(ModelFamily(
    name=NAME, module=f"{__name__}:QKVBiasTransformer", params=qkv_bias_params, sublayers=decoder_sublayers,
    hf=None, description="test only: Llama with q/k/v biases"))


def tp_placements(args: ModelArgs, group_up: bool = False) -> dict:
    """On each of 2 ranks: every parameter's placement after the tensor-parallel plan, without and with sequence
    parallelism (tests/test_model_family.py, tests/test_qwen.py); `group_up`: the ranks' process group exists already
    (it is destroyed at the end either way)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.distributed.tensor_parallel import apply_tp
    from paratrain.models import build_model

    if not group_up:
        dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        out = {}
        for sp in (False, True):
            with torch.device("meta"):
                model = build_model(args)
            apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=False)
            out[sp] = {n: ",".join(map(str, p.placements)) for n, p in model.named_parameters()}
        return out
    finally:
        dist.destroy_process_group()
