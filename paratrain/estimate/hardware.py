"""Hardware profiles for the planner: a device (memory, peak, achievable matmul rate, memory bandwidth, per-op
overhead) and the links between devices (bandwidth, latency), either from datasheet tables or measured on this
machine by `paratrain plan --calibrate` (paratrain/calibration.py) and saved as JSON.

Memory sizes, memory bandwidth and dense peaks come from `paratrain.estimate.gpus` (one table); this module only adds
what the cost model needs on top: the achievable fraction of peak, and links. The `Hardware` and `Link`
types live in `estimate/profile.py` (the cost model reads them; calibration runs the cost model).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import UserError
from paratrain.estimate.gpus import GPUS, gpu_memory
from paratrain.estimate.profile import GPU_OVERLAP, Hardware, Link

# Link name -> (bandwidth per GPU and direction in bytes/s, latency per message step in s). Bandwidth is the
# datasheet number; the cost model multiplies it by LINK_EFFICIENCY (what NCCL's bus bandwidth reaches).
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": (450e9, 4e-6),   # NVLink 4 (H100/H200): 900 GB/s bidirectional. A100 (NVLink 3): see NVLINK_BY_GPU
    "pcie4": (32e9, 8e-6),     # PCIe 4.0 x16
    "pcie5": (64e9, 8e-6),     # PCIe 5.0 x16
    "ib400": (50e9, 8e-6),     # 400 Gb/s InfiniBand NDR, one NIC per GPU
    "ib200": (25e9, 8e-6),     # 200 Gb/s InfiniBand HDR, one NIC per GPU
    "eth100": (12.5e9, 25e-6),  # 100 Gb/s Ethernet (RoCE/TCP), per GPU
    "eth25": (3.125e9, 40e-6),  # 25 Gb/s Ethernet
}
NVLINK_BY_GPU = {"A100-40GB": 300e9, "A100-80GB": 300e9,  # NVLink 3: 600 GB/s bidirectional
                 "A800-80GB": 200e9, "H800": 200e9}  # 400 GB/s bidirectional (their datasheets)
LINK_EFFICIENCY = 0.8

# -- the host side (CPU offload, activation offloading) ------------------------------------------------------------
# Device <-> host memory per GPU and direction (datasheets; pinned copies reach about LINK_EFFICIENCY of them):
#   pcie3 PCIe 3.0 x16, 16 GB/s (V100, T4)   pcie4 PCIe 4.0 x16, 32 GB/s (A100, L40S, RTX4090, ...)
#   pcie5 PCIe 5.0 x16, 64 GB/s (H100, H200, B200)
#   c2c   NVLink-C2C, 900 GB/s bidirectional between the Grace CPU and the Hopper GPU (NVIDIA GH200 datasheet)
HOST_LINKS: dict[str, tuple[float, float]] = {"pcie3": (16e9, 10e-6), "pcie4": (32e9, 10e-6), "pcie5": (64e9, 10e-6),
                                              "c2c": (450e9, 5e-6)}
GPU_HOST_LINK = {"H100-SXM": "pcie5", "H100-PCIe": "pcie5", "H100-NVL": "pcie5", "H800": "pcie5", "H200": "pcie5",
                 "B200": "pcie5", "RTX5090": "pcie5",
                 "GH200": "c2c", "V100-16GB": "pcie3", "V100-32GB": "pcie3", "T4": "pcie3",
                 "MI300X": "pcie5", "MI325X": "pcie5"}  # others: pcie4
# The optimizer step of CPU offload runs torch's fused AdamW on the host's cores: measured 2.6e8 parameters/s on one
# core (torch 2.13 fused CPU AdamW, fp32, 20M parameters, AMD EPYC; bench/RESULTS.md 2026-12-01), reading and writing
# ADAM_HOST_BYTES per parameter (p, grad, 2 moments read; p and 2 moments written) until the host's memory bandwidth
# caps it. A GPU server's CPU side, shared by its GPUs: HOST_CORES_PER_GPU cores (DGX H100: 2 x 56 cores for 8 GPUs;
# 4-GPU workstations: 16-32 cores) and HOST_MEM_BANDWIDTH_PER_GPU (8-channel DDR5-4800: 307 GB/s per socket, 2
# sockets for 8 GPUs, at ~75% achievable).
CPU_ADAM_PARAMS_PER_S_PER_CORE = 2.6e8
ADAM_HOST_BYTES = 28
HOST_CORES_PER_GPU = 8
HOST_MEM_BANDWIDTH_PER_GPU = 2 * 307e9 * 0.75 / 8


def host_link(name: str) -> Link:
    if name not in HOST_LINKS:
        raise UserError(f"unknown host link '{name}'; known: {', '.join(HOST_LINKS)}")
    bw, lat = HOST_LINKS[name]
    return Link(name, bw * LINK_EFFICIENCY, lat)


def host_adam_rate(cores: float = HOST_CORES_PER_GPU, bandwidth: float = HOST_MEM_BANDWIDTH_PER_GPU) -> float:
    """AdamW parameters per second one rank's share of the host steps (CPU offload)."""
    return min(cores * CPU_ADAM_PARAMS_PER_S_PER_CORE, bandwidth / ADAM_HOST_BYTES)

# GPU -> its default intra-node link: NVLink for SXM parts (AMD Instinct's Infinity Fabric counted as NVLink 4), PCIe
# for cards
GPU_INTRA = {
    "A100-40GB": "nvlink", "A100-80GB": "nvlink", "A800-80GB": "nvlink", "H100-SXM": "nvlink", "H100-PCIe": "pcie5",
    "H100-NVL": "pcie5", "H800": "nvlink", "H200": "nvlink", "B200": "nvlink", "GH200": "nvlink", "L40S": "pcie4",
    "L40": "pcie4", "L4": "pcie4", "A10": "pcie4", "A10G": "pcie4", "A6000": "pcie4", "RTX6000-Ada": "pcie4",
    "RTX4090": "pcie4", "RTX3090": "pcie4", "RTX5090": "pcie5", "V100-16GB": "nvlink", "V100-32GB": "nvlink",
    "T4": "pcie4", "MI300X": "nvlink", "MI250X-GCD": "nvlink", "MI325X": "nvlink",
}
GPU_GEMM_HALF_FLOP = 2 * 1024**3  # a GEMM of this many FLOPs reaches half the large-GEMM rate (small ones can't fill
GPU_OP_OVERHEAD_S = 1.5e-6  # exposed launch cost per kernel (mostly hidden by asynchronous launches)


# -- the efficiency model ----------------------------------------------------------------------------------------------
# What a training step reaches of the datasheet, by GPU generation and execution mode. The cost model (cost.py) times
# each GEMM at the profile's rate for its size, attention at its own rate, and the rest (element-wise kernels, launch
# and dispatch) from memory traffic and operator counts, scaled by the execution mode's factor (GPU_MODES).
#
#   gemm         bf16 GEMMs of a training step, fraction of the dense bf16 peak (a GEMM of GPU_GEMM_HALF_FLOP FLOPs
#                reaches half of it). Not what a GEMM benchmark reaches alone (cuBLAS: ~0.7 on H100), but what they
#                reach inside a step, beside what the model does not count (FSDP's copies on the critical path, NCCL
#                kernels taking SMs and memory bandwidth, allocator, clocks under power capping). An fp32 run's GEMMs
#                and attention (plain fp32, or TF32) reach the same fraction of their own dense peak (Hardware.speed:
#                the ratio of the peaks in estimate/gpus.py), an assumption no measurement here checks.
#   attention    PyTorch's fused attention (SDPA) forward + backward, fraction of the dense bf16 peak
#   fp8          fp8 GEMMs (dynamic scaling), fraction of the fp8 dense peak (estimate/gpus.py); None: no fp8 cores
#   elementwise  fraction of the HBM bandwidth that eager element-wise kernels reach
#
# Sources (numbers as published; no text copied):
#   hopper  torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP over 8 H100, local batch 2,
#           seq 8192, selective checkpointing: 5,762 tokens/s/GPU eager, 6,667 with torch.compile (+16%), 8,532
#           compiled with fp8 linears (+28%); those H100s ran at 500 W, and the page's footnote puts their peak
#           between the SXM's and the NVL's, so the targets here are its numbers x 989/912 (the midpoint). gemm,
#           elementwise, GPU_MODES["compile"] and fp8 are fitted to those three rows (grid search, bench/RESULTS.md);
#           attention keeps FlashAttention-3's ratio (Shah et al. 2024, arXiv 2407.08608: FlashAttention-2, which SDPA
#           runs on H100, reaches about 35% of the peak where GEMMs reach about 62%).
#   ampere  torchtitan, docs/performance.md: FSDP on 64 A100 80GB, local batch 1, seq 8192: Llama 3 8B with
#           selective checkpointing 2,973 tokens/s/GPU (58% MFU), 70B with full checkpointing 331 (51.7%): gemm fitted
#           to both (+5% / -5%); attention at FlashAttention-2's reach on A100 relative to GEMMs (Dao 2023, arXiv
#           2307.08691: 50-73% of the peak forward, less backward). Megatron-LM (Narayanan et al., SC'21) reports 52%
#           of peak end to end on 3,072 A100: the same range.
#   cdna3   SemiAnalysis, "MI300X vs H100 vs H200 Benchmark Part 1: Training" (Dec 2024): MI300X BF16 GEMMs reach well
#           under half of the datasheet peak with the public ROCm stack, about 2/3 of what H100's reach: hopper's
#           numbers x 2/3.
#   blackwell, ada: hopper's; volta, turing, cdna2: below ampere's. No public measurement verified here; calibrate on
#           the machine (`paratrain plan --calibrate --model M`) to replace them.
@dataclass(frozen=True)
class Efficiency:
    gemm: float
    attention: float
    fp8: float | None
    elementwise: float = 0.5


EFFICIENCY: dict[str, Efficiency] = {
    "hopper": Efficiency(0.46, 0.26, 0.35, 0.5),
    "blackwell": Efficiency(0.46, 0.26, 0.35, 0.5),
    "ada": Efficiency(0.46, 0.26, 0.35, 0.5),
    "ampere": Efficiency(0.68, 0.47, None, 0.5),
    "volta": Efficiency(0.55, 0.30, None, 0.5),
    "turing": Efficiency(0.45, 0.25, None, 0.5),
    "cdna3": Efficiency(0.30, 0.17, 0.23, 0.5),
    "cdna2": Efficiency(0.35, 0.20, None, 0.5),
}
GENERATION = {
    "A100-40GB": "ampere", "A100-80GB": "ampere", "A800-80GB": "ampere", "A10": "ampere", "A10G": "ampere",
    "A6000": "ampere", "RTX3090": "ampere", "H100-SXM": "hopper", "H100-PCIe": "hopper", "H100-NVL": "hopper",
    "H800": "hopper", "H200": "hopper", "GH200": "hopper", "B200": "blackwell", "RTX5090": "blackwell",
    "L40S": "ada", "L40": "ada", "L4": "ada", "RTX6000-Ada": "ada",
    "RTX4090": "ada", "V100-16GB": "volta", "V100-32GB": "volta", "T4": "turing", "MI300X": "cdna3",
    "MI325X": "cdna3", "MI250X-GCD": "cdna2",
}
# Execution mode -> factor on the non-matmul time (element-wise traffic and per-kernel cost). torch.compile fuses a
# block's norms, rotary, SwiGLU and residual adds into a few kernels; the factor is set so the cost model reproduces
# torchtitan's eager -> compile gain on H100 (+16%, above). Calibration measures it at the model's shapes.
GPU_MODES = {"eager": 1.0, "compile": 0.30}


_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
         "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}


def parse_bandwidth(text: str) -> float:
    """'1Gbit', '10Gbit', '25GB/s' (a node's link to the others) -> bytes/s; a one-line UserError otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z/]+)\s*", text or "")
    unit = _BITS.get(m.group(2).lower().removesuffix("ps").replace("bits", "bit")) if m else None
    if unit is None or not float(m.group(1)) > 0:
        raise UserError(f"cannot read bandwidth '{text}': use a number and a unit, e.g. 1Gbit, 10Gbit, 25GB/s")
    return float(m.group(1)) * unit


def bandwidth_link(text: str, gpus_per_node: int) -> Link:
    """`--inter-node-bandwidth`: a node's link to the others, shared by its GPUs (each rank gets its share), at an
    Ethernet's latency."""
    return Link(f"{text} per node", parse_bandwidth(text) * LINK_EFFICIENCY / gpus_per_node, LINKS["eth25"][1])


def link(name: str, gpu: str | None = None) -> Link:
    if name not in LINKS:
        raise UserError(f"unknown link '{name}'; known: {', '.join(LINKS)}")
    bw, lat = LINKS[name]
    if name == "nvlink" and gpu in NVLINK_BY_GPU:
        bw = NVLINK_BY_GPU[gpu]
    return Link(name, bw * LINK_EFFICIENCY, lat)


def default_profile_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paratrain" / "profiles"


def gpu_profile(name: str, intra: str | None = None, inter: str | None = None) -> Hardware:
    """A datasheet profile for a named GPU; UserError for an unknown one (naming the closest)."""

    # (the planner needs a device's speed as well as its memory: a size alone cannot stand in for a name)
    canonical, memory = gpu_memory(name, "or a profile measured on the machine (`paratrain plan --calibrate --name "
                                         "NAME`, then --gpu NAME)")
    gpu = GPUS[canonical]
    peaks = gpu.peaks()
    peak = peaks["bf16"]
    generation = GENERATION[canonical]
    eff = EFFICIENCY[generation]

    def curve(rate):  # a GEMM of x FLOPs reaches rate * x / (x + half)
        half = GPU_GEMM_HALF_FLOP
        return [(x, rate * x / (x + half)) for x in (half / 64, half / 8, half, 8 * half, 64 * half, 512 * half)]

    fp8 = eff.fp8 and peaks.get("fp8")
    return Hardware(canonical, memory, peak, curve(eff.gemm * peak), gpu.bandwidth * eff.elementwise,
                    GPU_OP_OVERHEAD_S, link(intra or GPU_INTRA[canonical], canonical),
                    link(inter or "ib400", canonical), GPU_OVERLAP, "cuda", "bf16", "datasheet", generation=generation,
                    attention=curve(eff.attention * peak), fp8_gemm=curve(eff.fp8 * fp8) if fp8 else [],
                    modes=dict(GPU_MODES), host=host_link(GPU_HOST_LINK.get(canonical, "pcie4")),
                    host_adam_params_per_s=host_adam_rate(), peaks=peaks)


def load_profile(name: str, profile_dir: str | Path | None = None) -> Hardware | None:
    path = Path(profile_dir or default_profile_dir()) / f"{name}.json"
    if not path.is_file():
        return None
    try:
        hw = Hardware.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"profile {path} is not a valid planner profile ({e}); recalibrate it") from None
    if hw.host is None:  # saved before profiles had a host side
        add_host_side(hw)
    return hw


def add_host_side(hw: Hardware, cores_per_rank: int = 1) -> None:
    """The host side of a measured profile: a CPU rank's "host" is its own memory (copies at the measured bandwidth)
    and its AdamW runs on its `cores_per_rank` cores; a GPU's is PCIe 4.0 and the default server's CPU."""
    cpu = hw.device == "cpu"
    hw.host = Link("memory", hw.mem_bandwidth, 0.0) if cpu else host_link("pcie4")
    hw.host_adam_params_per_s = host_adam_rate(cores_per_rank) if cpu else host_adam_rate()


def resolve_hardware(name: str, intra: str | None = None, inter: str | None = None,
                     profile_dir: str | Path | None = None) -> Hardware:
    """A saved calibration profile by name first, then the GPU table."""
    hw = load_profile(name, profile_dir)
    if hw is None:
        try:
            return gpu_profile(name, intra, inter)
        except UserError as e:
            saved = sorted(p.stem for p in Path(profile_dir or default_profile_dir()).glob("*.json"))
            raise UserError(f"{e}" + (f"; saved profiles: {', '.join(saved)}" if saved else "")) from None
    if intra:
        hw.intra = link(intra)
    if inter:
        hw.inter = link(inter)
    return hw


# -- calibration ---------------------------------------------------------------------------------------------------
