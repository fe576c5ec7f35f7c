"""What a model family is: one `ModelFamily` per family, the only description of a model (registry.py knows them).

A family gives
- `module`: the nn.Module class to build (an import path "package.module:Class", loaded lazily: this file and the
  tables stay torch-free). It follows the decoder skeleton the parallel code relies on: `args`, `tok_embeddings`,
  `layers` (a ModuleDict of blocks keyed by index), `norm`, `output` (each may be None in a pipeline stage),
  `forward(tokens, seq_len=None, targets=None, loss_chunks=1, reduction="mean")` (with targets: the loss,
  `llama.chunked_cross_entropy`), `param_init_std(name)` and `reset_buffers()` (see models/llama.py);
- `params(args)`: its parameter table, every parameter in `named_parameters()` order with its shape and its
  tensor-parallel *role*. The estimator, the presets' counts, the pipeline split and the Hugging Face names all read
  it, and `paratrain/distributed/tensor_parallel.py` turns roles into the TP/SP plan;
- `sublayers(args, index)`: the block's sublayers by kind ("attention" called as (x, cos, sin), "mlp" and "moe"
  called as (x,)), which say where sequence parallelism gathers and scatters the residual stream;
- `hf`: its Hugging Face tensor names (`HFNames`), or None when it has no Hugging Face counterpart;
- `hf_archs`: the transformers architectures it is (`HFArch`: how their config.json maps to its dimensions, which
  paratrain/hf/arch.py reads for import and export);
- `attention`: its attention's shape for the estimator and the TP plan (`AttentionShape`), when it is not
  grouped-query attention over `n_heads`, `n_kv_heads` and `head_dim`;
- `verify_rows`: its `paratrain verify` rows (name -> (ranks, layout name, overrides...), as paratrain/verify.py's
  LAYOUTS), which verify lists among its own.

Adding a family is one module defining a `ModelFamily` plus one registry line: an entry in `registry.FAMILIES` for a
family shipped with paratrain, or `registry.register_family(FAMILY)` in the module that defines it (tests do this).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, get_args

from paratrain.models.args import ModelArgs

# How tensor parallelism treats a parameter (paratrain/distributed/tensor_parallel.py gives each its DTensor style):
#   embedding  vocabulary-parallel input embedding (rows split)      output  vocabulary-parallel output projection
#   colwise    column-parallel Linear: weight and bias split on dim 0
#   rowwise    row-parallel Linear: weight split on dim 1, bias replicated; its output goes back to its sublayer's
#              output layout (the residual stream; whole inside a mixture of experts)
#   norm       a norm gain: replicated, sequence-parallel under SP   replicated  replicated whatever the layout
#   head_norm  a norm gain over each attention head (Qwen3's q/k norm): replicated, its input split by heads like the
#              column-parallel projection it follows (its gradient is summed over the tp ranks' heads)
#   expert     a routed expert's stacked weight (E, ...): not split by tp, split on dim 0 by expert parallelism
#   shared_key a replicated Linear whose output ends with a key every attention head reads (a latent, then a key
#              `AttentionShape.shared_key` wide): tp splits the heads, so the gradient of that key is summed over the
#              tp ranks (the latent's arrives whole through the column-parallel projection that reads it)
Role = Literal["embedding", "output", "colwise", "rowwise", "norm", "head_norm", "replicated", "expert", "shared_key"]
ROLES = get_args(Role)
SublayerKind = Literal["attention", "mlp", "moe"]
SUBLAYER_KINDS = get_args(SublayerKind)
# Where a parameter lives, for pipeline stages: the first stage holds the embedding, the last the head.
Where = Literal["embedding", "block", "head"]


@dataclass(frozen=True)
class Param:
    """One parameter of a model: its name in `named_parameters()`, full shape and tensor-parallel role. What follows
    from the role is set on construction (plain attributes: the planner reads them millions of times)."""

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None = None  # block index (None: embedding / final norm / output)
    matmul: bool = False  # used as a matmul weight (autocast makes a low-precision copy of it)
    trainable: bool = True  # False: frozen (LoRA's base weights: no gradient, no optimizer state)
    exported: bool = True  # False: training only, left out of Hugging Face exports (a side head's: `SideHead`)
    tp_dim: int | None = field(init=False)  # the dim tensor parallelism splits (None: replicated)
    expert: bool = field(init=False)  # a routed-expert weight (split over ep on dim 0)
    where: Where = field(init=False)  # the pipeline stage holding it: first (embedding), any (block), last (head)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: unknown tensor-parallel role '{self.role}' (roles: {', '.join(ROLES)})")
        rowwise_weight = self.role == "rowwise" and len(self.shape) >= 2
        tp_dim = 0 if self.role in ("embedding", "output", "colwise") else 1 if rowwise_weight else None
        where = "block" if self.layer is not None else "embedding" if self.role == "embedding" else "head"
        object.__setattr__(self, "tp_dim", tp_dim)
        object.__setattr__(self, "expert", self.role == "expert")
        object.__setattr__(self, "where", where)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def hidden_matrix(self) -> bool:
        """A block's projection matrix (attention, MLP, shared or routed experts: one matrix per expert), what an
        optimizer that orthogonalises whole matrices updates (`OptimizerEntry.hidden_state`); not the embedding, the
        head, norms, biases or the router."""
        return self.layer is not None and self.role in ("colwise", "rowwise", "expert") and len(self.shape) >= 2

    @property
    def module(self) -> str:
        """The module holding it, relative to its block (to the model for layer None)."""
        name = self.name.split(".", 2)[2] if self.layer is not None else self.name
        return name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class HFNames:
    """A family's Hugging Face tensor names. `top` and `block` map paratrain names (a block's relative to
    `layers.{i}.`) to Hugging Face ones (relative to `model.layers.{i}.`); a routed-expert stacked weight
    `<...>.experts.{w}` (E, in, out) is E tensors named `expert.format(e=e, w=expert_weights.get(w, w))`, each w[e]
    transposed."""

    top: Mapping[str, str]
    block: Mapping[str, str]
    expert: str | None = None
    expert_weights: Mapping[str, str] = field(default_factory=dict)  # w1/w2/w3 -> Hugging Face's names for them


@dataclass(frozen=True)
class HFArch:
    """One transformers architecture a family is, and how its config.json maps to `ModelArgs` (paratrain/hf/arch.py
    reads this on import and writes it on export). Every field is data, so a new architecture is a new entry."""

    name: str  # the class in config.json's `architectures`, e.g. "Qwen3ForCausalLM"
    model_type: str
    moe: bool = False  # its blocks are mixtures of experts (the family's model with moe_experts > 0)
    exported: bool = True  # paratrain writes it (False: read only, e.g. Mistral, which is exported as Llama)
    # config.json fields with the one value this family computes (checked on import, a missing one read from
    # `defaults`; written on export): e.g. Llama's attention_bias=false.
    fixed: Mapping[str, object] = field(default_factory=dict)
    defaults: Mapping[str, object] = field(default_factory=dict)  # transformers' values for fields left out
    written: Mapping[str, object] = field(default_factory=dict)  # more fields written on export as they are
    # Mixture of experts: the keys of the experts' count and width; `sparse_layers`: decoder_sparse_step and
    # mlp_only_layers say which blocks keep a dense MLP (of intermediate_size); `norm_topk_key`: the key of the top-k
    # gates' renormalisation (None: always renormalised).
    experts_keys: tuple[str, ...] = ("num_local_experts",)  # read in this order, the first written
    expert_hidden_key: str = "intermediate_size"
    sparse_layers: bool = False
    norm_topk_key: str | None = None
    # The key of its one sigmoid-gated shared expert's width (Qwen2-MoE's shared_expert_intermediate_size): paratrain's
    # moe_shared_experts experts of the routed width (the width over moe_ffn_hidden) with moe_shared_gate; None: none.
    shared_expert_key: str | None = None
    # DeepSeek-V3's mixture of experts: the key of the count of its ungated shared experts of the routed width
    # (n_shared_experts), of its dense first blocks (first_k_dense_replace), its router's score function, and whether
    # it routes with a per-expert bias (e_score_correction_bias: the model's moe_expert_bias)
    shared_count_key: str | None = None
    first_dense_key: str | None = None
    score_func: str = "softmax"
    expert_bias: bool = False
    # More config.json fields that are ModelArgs fields as they are: {key: the fields it sets} (DeepSeek-V3's group
    # routing and latent attention widths); a null is 0 (q_lora_rank: no query latent) and 0 is written as null.
    dims: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    window_flag: str | None = None  # the field that turns `sliding_window` on (Qwen's use_sliding_window), if any


@dataclass(frozen=True)
class AttentionShape:
    """A block's attention as the estimator sees it (activations, FLOPs, ring traffic): `heads` query heads over
    `kv_heads` key/value heads as the attention kernel reads them, q and k `qk_dim` wide per head, v `v_dim` (as the
    kernel reads it: padded where narrower than q/k), the kernel's output `out_dim` per head as the output projection
    reads it, the rotary part `rope_dim` wide; `latents`: widths of normalised low-rank latents before the
    up-projections; `shared_key`: the width of the key at the tail of a "shared_key" projection's output (0: none);
    `score_width`: the width in the PaLM FLOPs convention's attention term 12 x layers x width x seq (dim for
    grouped-query attention, whatever its heads)."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    out_dim: int
    rope_dim: int
    latents: tuple[int, ...] = ()
    score_width: int = 0
    shared_key: int = 0


def gqa_shape(args: ModelArgs) -> AttentionShape:
    D = args.head_dim
    return AttentionShape(args.n_heads, args.n_kv_heads, D, D, D, D, score_width=args.dim)


@dataclass(frozen=True)
class SideHead:
    """Modules any family's model gets after its head when its dimensions ask for them, trained on targets of their
    own from the last block's output (registered in `registry.SIDE_HEADS`). Torch-free: the trainer, the pipeline, the
    tensor-parallel plan, the estimator and verify reach it only through these fields.

    `name`: the model's attribute holding it and its parameters' prefix; `module`: "package.module:Class" of its
    nn.Module, built as Class(args, attention_class) (the protocol is models/llama.py `Transformer.forward`'s);
    `params(args, block)`: its parameter table, after the family's (`block(i)`: the family's table of a block of index
    i, which its own blocks take); `blocks(args)`: the blocks it runs, on a pipeline's last stage, each with one more
    pass through the output head (0: the model has none); `metric`: its loss in the step's metrics; `weight(args)`: that
    loss's weight in the training loss; `layout_problem(layout, args)`: why a layout cannot run it (a one-line message)
    or None; `verify_rows`: its `paratrain verify` rows."""

    name: str
    module: str
    params: Callable[[ModelArgs, Callable[[int], list]], list[Param]]
    blocks: Callable[[ModelArgs], int]
    metric: str
    weight: Callable[[ModelArgs], float]
    layout_problem: Callable[[object, ModelArgs], str | None] = lambda layout, args: None
    verify_rows: Mapping[str, tuple] = field(default_factory=dict, hash=False)

    def module_class(self):
        path, _, attr = self.module.partition(":")
        return getattr(importlib.import_module(path), attr)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    module: str  # "package.module:Class" of the nn.Module
    params: Callable[[ModelArgs], list[Param]]
    sublayers: Callable[[ModelArgs, int], Mapping[str, SublayerKind]]
    hf: HFNames | None = None
    description: str = ""
    hf_archs: tuple[HFArch, ...] = ()
    attention: Callable[[ModelArgs], AttentionShape] = gqa_shape
    verify_rows: Mapping[str, tuple] = field(default_factory=dict, hash=False)

    def model_class(self):
        path, _, attr = self.module.partition(":")
        return getattr(importlib.import_module(path), attr)
