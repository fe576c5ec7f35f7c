"""The hardware profile the cost model reads: a device (`Hardware`) and the links between devices (`Link`).

Plain data with no dependency inside paratrain, so that both the cost model (`estimate/step_time.py`, which reads
profiles) and the profile sources (`estimate/hardware.py`: datasheet tables, saved JSON and calibration, which
uses the cost model) import it and neither imports the other back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

GPU_OVERLAP = 0.8  # fraction of overlappable communication NCCL hides under compute (separate streams)
EXECUTION_MODES = ("eager", "compile")  # training.compile = false | true


def interpolate(points, x: float) -> float:
    """Log-log interpolation of (x, y) points, flat outside them."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            if x1 == x0:
                return y1
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


@dataclass
class Link:
    name: str
    bandwidth: float  # bytes/s per rank and direction, effective (after LINK_EFFICIENCY for datasheet links)
    latency: float  # seconds per message step (alpha)
    # measured reduce-scatter time over the ring formula's (calibrated links; 1 for datasheet links): gloo runs a
    # reduce-scatter as more than an all-reduce (bench/RESULTS.md), NCCL as the ring
    reduce_scatter_factor: float = 1.0

    def p2p_time(self, nbytes: float) -> float:
        """Seconds to send `nbytes` once over the link (alpha + bytes / bandwidth): a method, so that a capability's
        terms (which may not import the estimator) price their copies with it too."""
        return self.latency + nbytes / self.bandwidth


@dataclass
class Hardware:
    name: str
    memory_bytes: int
    peak_flops: float  # dense peak at `precision` (bf16 for GPUs; measured fp32 matmul for CPUs)
    gemm: list[tuple[float, float]]  # (FLOPs of one GEMM, achieved FLOP/s) at `precision`: grows with size
    mem_bandwidth: float  # bytes/s, for element-wise work
    op_overhead_s: float  # exposed fixed cost per operator (launch / dispatch)
    intra: Link
    inter: Link | None = None
    overlap: float = GPU_OVERLAP
    device: str = "cuda"  # cuda | cpu: the estimator counts CUDA/NCCL overhead only on cuda
    precision: str = "bf16"  # the matmul rate the curves (gemm, attention) are for: a key of `peaks`
    source: str = "datasheet"
    notes: list[str] = field(default_factory=list)
    compute_scale: float = 1.0  # measured / predicted time of a reference model's training step (calibration)
    generation: str = ""  # GPU generation of a datasheet profile (hopper, ampere, ...; estimate/hardware.py)
    # fused attention (SDPA) forward+backward: (forward FLOPs of one micro-step's attention on a rank, achieved
    # FLOP/s); empty: ATTENTION_EFFICIENCY x the GEMM rate (CPU profiles without a model calibration)
    attention: list[tuple[float, float]] = field(default_factory=list)
    fp8_gemm: list[tuple[float, float]] = field(default_factory=list)  # GEMMs on the FP8 tensor cores; empty: none
    # execution mode -> factor on the non-matmul time (element-wise traffic and per-operator cost); eager is 1
    modes: dict[str, float] = field(default_factory=lambda: {"eager": 1.0})
    shapes: dict[str, float] = field(default_factory=dict)  # calibration at a model's shapes: what -> seconds
    # The host side, for the memory tiers (CPU offload, activation offloading; estimate/hardware.py's HOST_* tables):
    # each device's link to host memory (PCIe or NVLink-C2C), and the host's AdamW rate for one rank's parameters.
    host: Link | None = None
    host_adam_params_per_s: float = 0.0
    # the datasheet's dense peak FLOP/s of each matmul rate (paratrain.modes.MatmulMath: fp32, tf32, bf16, fp8; from
    # estimate/gpus.py); empty: none known (a CPU, whose measured rate is its rate in any precision)
    peaks: dict[str, float] = field(default_factory=dict)

    def gemm_rate(self, flop: float) -> float:
        """Achieved FLOP/s for one GEMM of `flop` FLOPs at `precision`: log-log interpolation of the curve, flat
        outside it."""
        return interpolate(self.gemm, flop)

    def speed(self, math: str) -> float:
        """How much faster matmuls at rate `math` run than the curves' (`precision`): the ratio of their datasheet
        peaks, so an A100's fp32 GEMMs take 16 times its bf16 ones, TF32's twice; 1 without peaks."""
        if math not in self.peaks or self.precision not in self.peaks:
            return 1.0
        return self.peaks[math] / self.peaks[self.precision]

    def peak(self, math: str) -> float:
        """The dense peak of matmuls at rate `math`: MFU's denominator (without datasheet peaks: `peak_flops`)."""
        return self.peaks.get(math, self.peak_flops)

    def fp8_rate(self, flop: float) -> float | None:
        return interpolate(self.fp8_gemm, flop) if self.fp8_gemm else None

    def attention_rate(self, forward_flop: float) -> float | None:
        return interpolate(self.attention, forward_flop) if self.attention else None

    def mode_factor(self, mode: str) -> float:
        """The non-matmul time factor of an execution mode (a mode this profile does not know: eager's)."""
        return self.modes.get(mode, self.modes.get("eager", 1.0))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Hardware":
        d = dict(d)
        d["intra"] = Link(**d["intra"])
        d["inter"] = Link(**d["inter"]) if d.get("inter") else None
        d["host"] = Link(**d["host"]) if d.get("host") else None
        if "float8_gemm" in d:  # the FP8 curve's name in profiles saved before 2026-12-07
            d["fp8_gemm"] = d.pop("float8_gemm")
        for key in ("gemm", "attention", "fp8_gemm"):
            d[key] = [tuple(x) for x in d.get(key, [])]
        return cls(**d)
