"""The hardware profile the cost model reads: a device (`Hardware`) and the links between devices (`Link`).

Plain data with no dependency inside paratrain, so that both the cost model (`planner/cost.py`, which reads
profiles) and the profile sources (`planner/hardware.py`: datasheet tables, saved JSON and calibration, which
uses the cost model) import it and neither imports the other back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

GPU_OVERLAP = 0.8  # fraction of overlappable communication NCCL hides under compute (separate streams)


@dataclass
class Link:
    name: str
    bandwidth: float  # bytes/s per rank and direction, effective (after LINK_EFFICIENCY for datasheet links)
    latency: float  # seconds per message step (alpha)


@dataclass
class Hardware:
    name: str
    memory_bytes: int
    peak_flops: float  # dense peak (bf16 for GPUs; measured fp32 matmul for CPUs) for MFU
    gemm: list[tuple[float, float]]  # (FLOPs of one GEMM, achieved FLOP/s): achieved rate grows with size
    mem_bandwidth: float  # bytes/s, for element-wise work
    op_overhead_s: float  # exposed fixed cost per operator (launch / dispatch)
    intra: Link
    inter: Link | None = None
    overlap: float = GPU_OVERLAP
    device: str = "cuda"  # cuda | cpu: the estimator counts CUDA/NCCL overhead only on cuda
    precision: str = "bf16"
    source: str = "datasheet"
    notes: list[str] = field(default_factory=list)
    compute_scale: float = 1.0  # measured / predicted time of a reference model's training step (calibration)

    def gemm_rate(self, flop: float) -> float:
        """Achieved FLOP/s for one GEMM of `flop` FLOPs: log-log interpolation of the curve, flat outside it."""
        pts = sorted(self.gemm)
        if flop <= pts[0][0]:
            return pts[0][1]
        for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
            if flop <= f1:
                w = (math.log(flop) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        return pts[-1][1]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Hardware":
        d = dict(d)
        d["intra"] = Link(**d["intra"])
        d["inter"] = Link(**d["inter"]) if d.get("inter") else None
        d["gemm"] = [tuple(x) for x in d["gemm"]]
        return cls(**d)
