"""Accelerators by name (memory, memory bandwidth, the dense peak FLOP/s of each matmul rate: one table, which the
estimator, the planner's profiles and the trainer's MFU read), and memory-size strings ("24GiB", "80GB", "24576MiB").

Each GPU's size is the total memory the driver reports (`nvidia-smi` / `torch.cuda.get_device_properties
().total_memory`, typical values, in MiB), which is a little below the marketing size: an "80 GB" H100
reports 81,559 MiB = 79.6 GiB. Training can use all of it minus the CUDA context, NCCL and allocator
overhead, which the estimator counts separately (`--overhead-gib`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratrain.errors import UserError
from paratrain.modes import MATMUL_MATHS

GiB = 2**30
MiB = 2**20
GB = 10**9


@dataclass(frozen=True)
class Gpu:
    """One accelerator as its vendor's datasheet gives it. Peaks are dense TFLOP/s (a datasheet's figure "with
    sparsity" halved), one per matmul rate a run uses (paratrain.modes.MatmulMath); None: no such tensor cores."""

    memory: int  # bytes the driver reports (see the module's doc)
    bandwidth: float  # device memory (HBM, GDDR), bytes/s
    fp32: float  # fp32 without tensor cores (NVIDIA: the CUDA cores; AMD: the FP32 matrix cores rocBLAS uses)
    tf32: float | None  # fp32 matmuls on TF32 tensor cores (Ampere and newer, CDNA3)
    bf16: float  # the 16-bit tensor cores, bf16 and fp16 alike, accumulating in fp32 (V100 and T4: fp16 only)
    fp8: float | None  # FP8 tensor cores, accumulating in fp32 (SM 8.9 and newer: Ada, Hopper, Blackwell; CDNA3)

    def peak(self, math: str) -> float | None:
        """Dense FLOP/s of `math` matmuls (paratrain.modes.MatmulMath); None: no such tensor cores."""
        tflops = getattr(self, math)
        return tflops * 1e12 if tflops else None

    def peaks(self) -> dict[str, float]:
        """{matmul rate: dense FLOP/s} of the rates this device has (a planner profile's `peaks`)."""
        return {math: self.peak(math) for math in MATMUL_MATHS if self.peak(math)}


# name -> its datasheet. Names match case-insensitively, ignoring spaces, dashes and underscores ("h100", "H100-SXM",
# "h100_sxm"). Gpu(memory, bandwidth, fp32, tf32, bf16, fp8) with its source above it; "*" marks a datasheet's
# figures "with sparsity", halved here.
GPUS: dict[str, Gpu] = {
    # NVIDIA A100 Tensor Core GPU datasheet: fp32 19.5, TF32 156, BF16 312; 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM).
    # A800: the A100's compute (NVLink 400 GB/s)
    "A100-40GB": Gpu(40_960 * MiB, 1.555e12, 19.5, 156, 312, None),
    "A100-80GB": Gpu(81_920 * MiB, 2.039e12, 19.5, 156, 312, None),
    "A800-80GB": Gpu(81_920 * MiB, 2.039e12, 19.5, 156, 312, None),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM fp32 67, TF32 989*, BF16 1,979*, FP8 3,958*, 3.35 TB/s; PCIe 51,
    # 756*, 1,513*, 3,026*, 2.0 TB/s; NVL 60, 835*, 1,671*, 3,341*, 3.9 TB/s. H800: the SXM's compute.
    "H100-SXM": Gpu(81_559 * MiB, 3.35e12, 67, 495, 989, 1979),
    "H100-PCIe": Gpu(81_559 * MiB, 2.0e12, 51, 378, 756, 1513),
    "H100-NVL": Gpu(95_830 * MiB, 3.9e12, 60, 418, 835, 1671),
    "H800": Gpu(81_559 * MiB, 3.35e12, 67, 495, 989, 1979),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100 SXM's compute, 4.8 TB/s
    "H200": Gpu(143_771 * MiB, 4.8e12, 67, 495, 989, 1979),
    # NVIDIA HGX B200 datasheet, per GPU: fp32 75, TF32 2.2 PF*, BF16 4.5 PF*, FP8 9 PF*, 8 TB/s
    "B200": Gpu(183_359 * MiB, 8.0e12, 75, 1100, 2250, 4500),
    # NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3): the H100 SXM's compute, 4 TB/s
    "GH200": Gpu(97_871 * MiB, 4.0e12, 67, 495, 989, 1979),
    # NVIDIA L40S datasheet: fp32 91.6, TF32 366*, BF16 733*, FP8 1,466*, 864 GB/s
    "L40S": Gpu(46_068 * MiB, 0.864e12, 91.6, 183, 362, 733),
    # NVIDIA L40 datasheet: fp32 90.5, TF32 181*, BF16 362*, FP8 724*, 864 GB/s
    "L40": Gpu(46_068 * MiB, 0.864e12, 90.5, 90.5, 181, 362),
    # NVIDIA L4 datasheet: fp32 30.3, TF32 120*, BF16 242*, FP8 485*, 300 GB/s
    "L4": Gpu(23_034 * MiB, 0.3e12, 30.3, 60, 121, 242),
    # NVIDIA A10 datasheet: fp32 31.2, TF32 62.5, BF16 125, 600 GB/s
    "A10": Gpu(23_028 * MiB, 0.6e12, 31.2, 62.5, 125, None),
    # A10G: AWS's A10 variant (EC2 G5), no NVIDIA datasheet: fp32 35, TF32 35, BF16 70 as third-party comparisons
    # list them (Baseten, "NVIDIA A10 vs A10G for ML model inference"); not checked against a vendor document
    "A10G": Gpu(23_028 * MiB, 0.6e12, 35, 35, 70, None),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, RTX A6000: fp32 38.7, TF32 77.4, BF16 154.8, 768 GB/s
    "A6000": Gpu(49_140 * MiB, 0.768e12, 38.7, 77.4, 155, None),
    # NVIDIA Ada GPU architecture whitepaper, RTX 6000 Ada: fp32 91.1, TF32 182.1, BF16 364.2, FP8 728.5, 960 GB/s
    "RTX6000-Ada": Gpu(49_140 * MiB, 0.96e12, 91.1, 182.1, 364, 728.5),
    # GeForce cards run the tensor cores at half rate when they accumulate in fp32, as training does; their
    # whitepapers give both. Ada whitepaper, RTX 4090: fp32 82.6, TF32 82.6, BF16 165.2, FP8 330.3, 1,008 GB/s
    "RTX4090": Gpu(24_564 * MiB, 1.008e12, 82.6, 82.6, 165, 330),
    # GA102 whitepaper, RTX 3090: fp32 35.6, TF32 35.6, BF16 71, 936 GB/s
    "RTX3090": Gpu(24_576 * MiB, 0.936e12, 35.6, 35.6, 71, None),
    # NVIDIA RTX Blackwell GPU architecture whitepaper, RTX 5090: fp32 104.8, TF32 104.8, BF16 209.5, FP8 419,
    # 1,792 GB/s
    "RTX5090": Gpu(32_607 * MiB, 1.792e12, 104.8, 104.8, 209.5, 419),
    # NVIDIA T4 datasheet: fp32 8.1, FP16 65 (no BF16 or TF32), 320 GB/s
    "T4": Gpu(15_360 * MiB, 0.32e12, 8.1, None, 65, None),
    # NVIDIA V100 datasheet (SXM2): fp32 15.7, FP16 tensor 125 (no BF16 or TF32), 900 GB/s
    "V100-16GB": Gpu(16_160 * MiB, 0.9e12, 15.7, None, 125, None),
    "V100-32GB": Gpu(32_510 * MiB, 0.9e12, 15.7, None, 125, None),
    # AMD Instinct MI250X datasheet, halved for one of its two dies (each is a rank): fp32 matrix 95.7, BF16 383,
    # 3.2 TB/s
    "MI250X-GCD": Gpu(65_520 * MiB, 1.6e12, 47.9, None, 191.5, None),
    # AMD Instinct MI300X datasheet: fp32 matrix 163.4, TF32 653.7, BF16 1,307.4, FP8 2,614.9, 5.3 TB/s; MI325X
    # datasheet: the same compute, 6 TB/s
    "MI300X": Gpu(196_592 * MiB, 5.3e12, 163.4, 653.7, 1307, 2615),
    "MI325X": Gpu(262_128 * MiB, 6.0e12, 163.4, 653.7, 1307, 2615),
}
# Short names people type.
ALIASES = {
    "A100": "A100-80GB", "A10040G": "A100-40GB", "A10080G": "A100-80GB", "A10040": "A100-40GB", "A10080": "A100-80GB",
    "H100": "H100-SXM", "H10080GB": "H100-SXM", "H100SXM5": "H100-SXM",
    "4090": "RTX4090", "3090": "RTX3090", "5090": "RTX5090",
    "V100": "V100-32GB", "V10016": "V100-16GB", "V10032": "V100-32GB", "V10016G": "V100-16GB", "V10032G": "V100-32GB",
    "H200SXM": "H200", "H200141GB": "H200",
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).upper()


_BY_KEY = {_key(k): k for k in GPUS} | {_key(a): t for a, t in ALIASES.items()}


def gpu_memory(name: str, otherwise: str = "or give --gpu-memory SIZE (e.g. 24GiB)") -> tuple[str, int]:
    """(canonical name, bytes) for a GPU name; a UserError naming the closest known one otherwise, ending with what
    else the command takes (`otherwise`)."""
    key = _key(name)
    if key in _BY_KEY:
        canonical = _BY_KEY[key]
        return canonical, GPUS[canonical].memory
    import difflib  # lazy: only a mistyped GPU name needs it

    close = difflib.get_close_matches(key, list(_BY_KEY), n=1, cutoff=0.5)
    hint = f" (did you mean '{_BY_KEY[close[0]]}'?)" if close else ""
    raise UserError(f"unknown GPU '{name}'{hint}; known: {', '.join(GPUS)}; {otherwise}")


def gpu_from_device_name(device_name: str, total_bytes: int | None = None) -> str | None:
    """The table's name for a device as torch.cuda.get_device_name() reports it ("NVIDIA H100 80GB HBM3" ->
    "H100-SXM", "NVIDIA A100-SXM4-40GB" -> "A100-40GB"): the longest model id (the part before the first dash)
    found in the name, then the variant named in it, else the one closest in memory, else the usual one."""
    key = _key(device_name)
    models: dict[str, list[str]] = {}
    for name in GPUS:
        models.setdefault(_key(name.split("-")[0]), []).append(name)
    found = [m for m in models if m in key]
    if not found:
        return None
    options = models[max(found, key=len)]
    named = [o for o in options if "-" in o and _key(o.split("-", 1)[1]) in key]
    if named:
        return max(named, key=len)
    if total_bytes and len(options) > 1:
        return min(options, key=lambda o: abs(GPUS[o].memory - total_bytes))
    default = _BY_KEY.get(_key(options[0].split("-")[0]))
    return default if default in options else options[0]


_UNITS = {"B": 1, "KB": 10**3, "KIB": 2**10, "MB": 10**6, "MIB": 2**20, "GB": GB, "GIB": GiB, "TB": 10**12,
          "TIB": 2**40, "K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}


def parse_memory(text: str) -> int:
    """'24GiB' -> bytes. Units: B, KB/KiB, MB/MiB, GB/GiB, TB/TiB; K, M, G, T alone are binary (as Slurm's
    --mem=80G reads). A unit is required: '24' alone is ambiguous."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"cannot read memory size '{text}': use a number and a unit, e.g. 24GiB, 80GB, 24576MiB")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UserError(f"memory size '{text}' must be positive")
    return int(value)


def fmt_bytes(n: float, unit: str = "GiB") -> str:
    """Bytes in one explicit unit: GiB (2^30) or GB (10^9); MiB/MB below 1 of the unit."""
    big, small = (GiB, 2**20) if unit == "GiB" else (GB, 10**6)
    small_unit = "MiB" if unit == "GiB" else "MB"
    if abs(n) >= big or n == 0:
        return f"{n / big:.2f} {unit}"
    return f"{n / small:.1f} {small_unit}"


# -- the headroom rule ------------------------------------------------------------------------------------------------
# One rule for `paratrain estimate` (FITS / DOES NOT FIT), `paratrain plan` (which layouts it keeps) and the trainer's
# estimate: a rank fits when its estimated total is at most this fraction of the device's memory. The rest is left
# for what the estimate does not count: the caching allocator's fragmentation and NCCL's buffers that grow with the
# communicators a run creates.
HEADROOM = 0.10
HEADROOM_WHY = "headroom for the allocator's fragmentation and NCCL buffers"


def check_headroom(headroom: float, flag: str = "--headroom") -> float:
    """The fraction of device memory kept free, checked (UserError unless 0 <= headroom < 1)."""
    if not 0 <= headroom < 1:
        raise UserError(f"{flag} must be in [0, 1), got {headroom}")
    return headroom


def usable_bytes(gpu_bytes: int, headroom: float = HEADROOM) -> int:
    """The memory a rank may use on a device of `gpu_bytes`: all of it less the headroom."""
    return int(gpu_bytes * (1 - headroom))


def fits(total_bytes: int, gpu_bytes: int, headroom: float = HEADROOM) -> bool:
    """The headroom rule: a rank's estimated total fits when it is at most the usable memory."""
    return total_bytes <= usable_bytes(gpu_bytes, headroom)


def limit_text(gpu_bytes: int, headroom: float = HEADROOM, unit: str = "GiB") -> str:
    """'limit 90% = 71.68 GiB: headroom for ...', as estimate and plan print it."""
    return (f"limit {1 - headroom:.0%} = {fmt_bytes(usable_bytes(gpu_bytes, headroom), unit)}: {HEADROOM_WHY}")


def verdict_text(total_bytes: int, gpu_bytes: int, headroom: float = HEADROOM, unit: str = "GiB") -> str:
    """'FITS: 61.96 GiB of 79.65 GiB (78%, limit 90% = 71.68 GiB: headroom for ...)' (or DOES NOT FIT)."""
    word = "FITS" if fits(total_bytes, gpu_bytes, headroom) else "DOES NOT FIT"
    return (f"{word}: {fmt_bytes(total_bytes, unit)} of {fmt_bytes(gpu_bytes, unit)} "
            f"({100 * total_bytes / gpu_bytes:.0f}%, {limit_text(gpu_bytes, headroom, unit)})")

