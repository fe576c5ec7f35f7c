"""fp8 training (`training.precision = "fp8"`): the blocks' linear layers multiply in float8 through torchao.

Which layers: `float8_linears` (the blocks' projections with dimensions divisible by 16,
less `[float8] keep_bf16`); the rest of the model computes in bf16 as a bf16 run does. Each converted layer casts its
input, its weight and its output gradient to float8 with a scale taken from the tensor's absolute maximum at that
moment (dynamic scaling): one scale per tensor ("tensorwise") or per row ("rowwise"). Off CUDA, and so in the test
suite, torchao emulates the float8 matmul (`emulate=True`: the same casts and scales, the product of the dequantised
values), so every layout's fp8 path runs on CPU ranks.

Where the layout is applied (`parallelize`, through the `before_parallelize` hook): the conversion comes first (before tensor parallelism, which then gives
tensorwise layers torchao's float8 styles: the column-parallel input is cast before its all-gather), and FSDP shards
the converted layers like any others; with `fsdp_float8_all_gather`, the sharded weights are cast to float8 before
the all-gather (half the bytes), with their scales computed for every layer in one all-reduce after each optimizer
step (`precompute_scales`).

Everything fp8 is here: the `[float8]` section, its checks, the hooks into the step, the verify rows (one fp8 process as
the reference, at FP8_TOLERANCE) and the checkpoint's plain tensors. Torch and torchao are imported inside the
functions that need them: the config checks, the estimator and the planner read this module without them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from paratrain.capabilities.base import MOE_PRESET, Capability, PlanFlag, RowTerms, WeightCopies
from paratrain.errors import ConfigError, UserError
from paratrain.models.args import ModelArgs
from paratrain.models.family import Param
from paratrain.models.registry import parameters
from paratrain.modes import Precision

Float8Recipe = Literal["tensorwise", "rowwise"]  # [float8] recipe: one scale per tensor, or per row
Float8Compute = Literal["bf16", "fp32"]  # [float8] compute: the precision around the float8 matmuls
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first tensor cores with FP8
FLOAT8_MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both dimensions of a weight to be multiples of 16


def float8_linears(args: ModelArgs, keep_bf16: tuple[str, ...] = ()) -> tuple[Param, ...]:
    """The weights of the linear layers an fp8 run multiplies in float8: the blocks' column- and row-parallel
    projections (attention, MLP, shared experts) whose dimensions are multiples of 16, apart from the modules named in
    `keep_bf16` (a whole name, `layers.0.attention.wq`, or its last part, `wq`). The embedding, the output projection,
    norms, MoE routers and routed experts stay in bf16."""
    out = []
    for p in parameters(args):
        module = p.name.rsplit(".", 1)[0]
        if (p.layer is not None and p.role in ("colwise", "rowwise") and len(p.shape) == 2
                and all(d % FLOAT8_MULTIPLE == 0 for d in p.shape)
                and module not in keep_bf16 and module.rsplit(".", 1)[-1] not in keep_bf16):
            out.append(p)
    return tuple(out)


def tensorwise_scales(recipe: str) -> bool:
    """[float8] recipe tensorwise: one scale per tensor (float8 all-gathers and tensor-parallel styles exist for it)."""
    return recipe == "tensorwise"


def keep_names(text: str) -> tuple[str, ...]:
    """[float8] keep_bf16 as names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def check_float8_device(device: torch.device) -> None:
    """A one-line refusal on a GPU without FP8 tensor cores (emulating there would be slower than bf16)."""
    import torch  # lazy: the config checks and the estimator read this module without torch

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
    import torch  # lazy: the config checks and the estimator read this module without torch

    x = args[0]
    if x.device.type != "cuda" and torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)), *args[1:])
    return None


def apply_float8(model: nn.Module, cfg, device: torch.device, uses_fsdp: bool) -> set[str]:
    """Convert the float8 linear layers of `model` (a whole model or a pipeline stage, on the meta device, before any
    other part of the layout); returns their module names."""
    from torchao.float8 import convert_to_float8_training  # lazy: torchao is imported by fp8 runs only

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
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # lazy: torchao for fp8 runs only

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state):
    """`state` (a nested state dict) with torchao's float8 weight wrappers (the parameters of float8 all-gathers, and
    the optimizer states made like them) replaced by the plain tensors they wrap, sharing their storage: what a
    checkpoint saves and loads into. DCP would otherwise pickle the wrapper's class into the checkpoint, which a
    weights-only load refuses (and which ties the checkpoint to torchao)."""
    # lazy: the config checks and the estimator read this module without torch
    import torch
    from torch.distributed.tensor import DTensor

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
    # lazy: the config checks and the estimator read this module without torch
    import torch
    from torch import nn

    while type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        if len(names) != 1:
            break
        tensor = getattr(tensor, names[0])
    return tensor


@dataclass
class Float8Config:
    """training.precision = "fp8" (docs/precision.md; paratrain/capabilities/float8.py): which linear layers multiply
    in float8 and how their scales are taken. The output projection, MoE routers and experts, and any layer whose
    dimensions are not multiples of 16 always stay in bf16."""

    # tensorwise: one scale per tensor (fastest; float8 all-gathers under FSDP and float8 tensor-parallel styles);
    # rowwise: one scale per row (more accurate with outliers; bf16 all-gathers)
    recipe: Float8Recipe = "tensorwise"
    # module names (or their last part, e.g. "w2") also kept in bf16, comma-separated
    keep_bf16: str = ""
    # what the model computes in around the float8 matmuls: bf16 (the speed fp8 is for), or fp32 to see float8's own
    # error apart from bf16's (what paratrain verify's fp8 rows compute in: docs/precision.md)
    compute: Float8Compute = "bf16"
    # tensorwise under FSDP: all-gather the float8 weights (half the bytes) with scales precomputed after each
    # optimizer step; unset: on for tensorwise with FSDP on CUDA
    fsdp_float8_all_gather: bool | None = None


FLOAT8_WEIGHT_COPIES, FLOAT8_SCALE_BYTES = 2, 4  # a float8 layer's weight cast for forward and for backward
FLOAT8_CAST_VALUES = 6  # values per token and width read/written by amax + cast, forward + backward
FP8 = "training.precision=fp8"  # the blocks' projections as float8 matmuls (emulated on a CPU), fp32 around them
FP8_FP32 = "float8.compute=fp32"
FP8_MICRO_BATCH = 2  # sequences per forward of every fp8 row and of its reference
# An fp8 row's loss and val loss against one fp8 process: float8 rounds to 3 mantissa bits, so a reduction-order
# difference of 1e-7 that moves a value across a rounding boundary becomes a 2^-4 change of that element, and the runs
# drift apart faster than fp32 runs do. 3e-4 over 8 steps (the suite's) is 5x tighter than fp8 against fp32 or bf16
# on the same steps (1.5e-3; measured, docs/precision.md), and scales taken over other values fail it (forwards of 8
# sequences instead of 2: 7e-4; cp's per-chunk scales: 1.2e-3). Weights within 1e-2: Adam's normalised step moves an
# element by up to lr either way, so a near-zero gradient whose float8 rounding flips its sign moves it 2 x lr from
# the reference's.
FP8_TOLERANCE, FP8_WEIGHT_TOLERANCE = 3e-4, 1e-2
FP8_STEPS = 8  # what FP8_TOLERANCE was measured over: an fp8 row runs these steps (longer runs drift further apart)
FP8_ROW = RowTerms(FP8_STEPS, (FP8_TOLERANCE, FP8_WEIGHT_TOLERANCE, FP8_TOLERANCE))


@dataclass(frozen=True)
class Float8(Capability):
    """fp8 training's settings for one run (the `[float8]` section; on when training.precision = "fp8")."""

    recipe: str = "tensorwise"
    keep_bf16: str = ""
    compute: str = "bf16"
    fsdp_float8_all_gather: bool | None = None

    name = "float8"
    section = Float8Config
    section_after = "memory"
    # against one fp8 process with the same recipe and the same micro-batches (dynamic float8 scales are taken per
    # forward: FP8_MICRO_BATCH sequences), at FP8_TOLERANCE over FP8_STEPS (FP8_ROW, last in each row)
    verify_rows = {name: (*row, FP8_ROW) for name, row in {
        "fp8-fsdp2": (2, "fsdp,mb=2", FP8, FP8_FP32),
        "fp8-tp2": (2, "nodp,tp=2,mb=2", FP8, FP8_FP32),
        "fp8-fsdp2xtp2": (4, "fsdp,tp=2,mb=2", FP8, FP8_FP32),
        "fp8-pp2": (2, "nodp,pp=2,sched=1f1b", FP8, FP8_FP32),  # 4 microbatches of 2
        "fp8-rowwise-fsdp2": (2, "fsdp,mb=2", FP8, FP8_FP32, "float8.recipe=rowwise"),
        "fp8-rowwise-tp2": (2, "nodp,tp=2,mb=2", FP8, FP8_FP32, "float8.recipe=rowwise"),
        "fp8-fsdp2+gather": (2, "fsdp,mb=2", FP8, FP8_FP32, "float8.fsdp_float8_all_gather=true"),
        "fp8-hsdp2x2": (4, "hsdp,rep=2,mb=2", FP8, FP8_FP32),
        "fp8-fsdp2+selective": (2, "fsdp,ac=selective,mb=2", FP8, FP8_FP32),
        "fp8-fsdp2+full": (2, "fsdp,ac=full,mb=2", FP8, FP8_FP32),
        "fp8-ep2": (2, "fsdp,ep=2,mb=2", MOE_PRESET, FP8, FP8_FP32),  # the shared expert in float8, routed experts bf16
        "compile-fp8-fsdp2": (2, "fsdp,mb=2", "training.compile=true", FP8, FP8_FP32),  # Inductor around float8
    }.items()}
    reference_keys = ("training.precision=", "float8.recipe=", "float8.compute=")
    reference_micro_batch = FP8_MICRO_BATCH

    @classmethod
    def from_config(cls, cfg) -> "Float8 | None":
        if not Precision(cfg.training.precision).fp8_matmuls:
            return None
        return cls(**dataclasses.asdict(cfg.float8))

    @classmethod
    def implied_by(cls, recipe) -> bool:
        return Precision(recipe.precision).fp8_matmuls

    @classmethod
    def check(cls, cfg) -> None:
        if Precision(cfg.training.precision).fp8_matmuls and cfg.lora.rank:
            raise ConfigError("training.precision=fp8 with lora.rank > 0: the frozen base would be cast to float8 at "
                              "every forward for adapters that train in bf16; use training.precision=bf16 for LoRA")

    @classmethod
    def uses(cls, overrides: list[str]) -> bool:
        return FP8 in overrides

    def compute_precision(self, precision: str) -> str:
        return self.compute  # around the float8 matmuls: bf16, or fp32 ([float8] compute)

    def check_device(self, device) -> None:
        check_float8_device(device)

    def before_parallelize(self, model, where) -> dict:
        """Convert the chosen linear layers; under tensor parallelism they take float8 styles (on CUDA)."""
        chosen = apply_float8(model, self, where.device, where.layout.uses_fsdp)
        styles = float8_tp_styles(self.recipe, where.device)
        return {name: styles for name in chosen} if styles is not None else {}

    def weight_copies(self, args, params) -> WeightCopies:
        """Its layers cast their fp32 weights to float8 for each matmul instead of using autocast's cache: 1 byte per
        element and a 4-byte scale, cast again in backward (laid out for the input gradient's matmul), freed after
        it: at most the largest layer's two copies exist at once."""
        names = frozenset(p.name for p in float8_linears(args, keep_names(self.keep_bf16)))
        largest = max((n for p, count, n in params if p.name in names), default=0)
        return WeightCopies(names, FLOAT8_WEIGHT_COPIES * (largest + FLOAT8_SCALE_BYTES),
                            f"fp8: {len(names)} linear layers multiply float8 copies of their weights (1 byte per "
                            "element and a 4-byte scale, made for each matmul and freed after it)")

    plan_label = "float8 linears"
    plan_flag = PlanFlag("--float8", "the same as --precision fp8 (float8 linear layers)", "precision", "fp8")
    gemm_math = "fp8"

    @classmethod
    def time_gemm(cls, a, b, timed) -> float | None:
        """torch._scaled_mm of float8 copies (unit scales), on FP8 tensor cores and weights its layers can have."""
        import torch  # lazy: the config checks and the estimator read this module without torch

        if (a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < FP8_CAPABILITY
                or any(d % FLOAT8_MULTIPLE for d in b.shape)):
            return None
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device=a.device)
        return timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))

    def check_hardware(self, hardware: list) -> None:
        """GPUs without FP8 tensor cores (before Ada/Hopper): one line naming the first."""
        for hw in hardware:
            if not hw.fp8_gemm:
                raise UserError(f"--precision fp8 needs FP8 tensor cores (H100, H200, L4, L40S, RTX 4090, ...); "
                                f"{hw.name} has none: plan bf16")

    def linear_gemm_rate(self, hw, flop: float) -> float | None:
        """The profile's float8 GEMM rate, where the GPU has FP8 tensor cores."""
        return hw.fp8_rate(flop) if hw.fp8_gemm else None

    def elementwise_values(self, hw, dim: float, ffn_width: float) -> float:
        """Dynamic scaling: each linear's input and output gradient read for the scale and cast to float8 (where the
        GPU multiplies in float8)."""
        return FLOAT8_CAST_VALUES * (dim + ffn_width) if hw.fp8_gemm else 0.0

    def after_optimizer_step(self, model, where) -> None:
        if gathers_float8(self, where.device, where.layout.uses_fsdp):
            precompute_scales(model)  # the next forward all-gathers float8 weights cast with these scales

    @classmethod
    def checkpoint_state(cls, state):
        return plain_tensors(state)  # (the float8 all-gather wraps parameters and their optimizer states)
