"""Accelerator memory sizes by name, and memory-size strings ("24GiB", "80GB", "24576MiB").

Each GPU's size is the total memory the driver reports (`nvidia-smi` / `torch.cuda.get_device_properties
().total_memory`, typical values, in MiB), which is a little below the marketing size: an "80 GB" H100
reports 81,559 MiB = 79.6 GiB. Training can use all of it minus the CUDA context, NCCL and allocator
overhead, which the estimator counts separately (`--overhead-gib`).
"""

from __future__ import annotations

import difflib
import re

from paratrain.errors import UserError

GiB = 2**30
MiB = 2**20
GB = 10**9

# name -> (bytes of device memory, description). Names match case-insensitively, ignoring spaces,
# dashes and underscores ("h100", "H100-SXM", "h100_sxm").
GPUS: dict[str, tuple[int, str]] = {
    "A100-40GB": (40_960 * MiB, "NVIDIA A100 40GB"),
    "A100-80GB": (81_920 * MiB, "NVIDIA A100 80GB"),
    "H100-SXM": (81_559 * MiB, "NVIDIA H100 SXM5 80GB HBM3"),
    "H100-PCIe": (81_559 * MiB, "NVIDIA H100 PCIe 80GB"),
    "H100-NVL": (95_830 * MiB, "NVIDIA H100 NVL 94GB"),
    "H200": (143_771 * MiB, "NVIDIA H200 141GB HBM3e"),
    "B200": (183_359 * MiB, "NVIDIA B200 180GB"),
    "GH200": (97_871 * MiB, "NVIDIA GH200 96GB HBM3"),
    "L40S": (46_068 * MiB, "NVIDIA L40S 48GB"),
    "L40": (46_068 * MiB, "NVIDIA L40 48GB"),
    "L4": (23_034 * MiB, "NVIDIA L4 24GB"),
    "A10": (23_028 * MiB, "NVIDIA A10 24GB"),
    "A10G": (23_028 * MiB, "NVIDIA A10G 24GB (AWS)"),
    "A6000": (49_140 * MiB, "NVIDIA RTX A6000 48GB"),
    "RTX6000-Ada": (49_140 * MiB, "NVIDIA RTX 6000 Ada 48GB"),
    "RTX4090": (24_564 * MiB, "NVIDIA GeForce RTX 4090 24GB"),
    "RTX3090": (24_576 * MiB, "NVIDIA GeForce RTX 3090 24GB"),
    "RTX5090": (32_607 * MiB, "NVIDIA GeForce RTX 5090 32GB"),
    "T4": (15_360 * MiB, "NVIDIA T4 16GB"),
    "V100-16GB": (16_160 * MiB, "NVIDIA V100 16GB"),
    "V100-32GB": (32_510 * MiB, "NVIDIA V100 32GB"),
    "MI250X-GCD": (65_520 * MiB, "AMD Instinct MI250X, one GCD (one rank) 64GB"),
    "MI300X": (196_592 * MiB, "AMD Instinct MI300X 192GB"),
    "MI325X": (262_128 * MiB, "AMD Instinct MI325X 256GB"),
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
        return canonical, GPUS[canonical][0]
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
        return min(options, key=lambda o: abs(GPUS[o][0] - total_bytes))
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


# Substring of torch.cuda.get_device_name() -> peak dense bf16 FLOP/s. Longest match wins.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 6000 Ada": 364e12,
    "RTX A6000": 155e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
    "B200": 2250e12,
}


def gpu_peak_flops(device_name: str) -> float | None:
    matches = [key for key in GPU_PEAK_BF16 if key.lower() in device_name.lower()]
    return GPU_PEAK_BF16[max(matches, key=len)] if matches else None
