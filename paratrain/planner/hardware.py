"""Hardware profiles for the planner: a device (memory, peak, achievable matmul rate, memory bandwidth, per-op
overhead) and the links between devices (bandwidth, latency), either from datasheet tables or measured on this
machine by `paratrain plan --calibrate` and saved as JSON.

Memory sizes come from `paratrain.estimate.gpus` and dense bf16 peaks from `paratrain.observe.flops` (one table
each); this module only adds what the cost model needs on top: HBM bandwidth, the achievable fraction of peak, and
links. The `Hardware` and `Link` types live in `planner/profile.py` (the cost model reads them; calibration here
runs the cost model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import UserError
from paratrain.planner.profile import GPU_OVERLAP, Hardware, Link

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
NVLINK_BY_GPU = {"A100-40GB": 300e9, "A100-80GB": 300e9}  # NVLink 3: 600 GB/s bidirectional
LINK_EFFICIENCY = 0.8

# -- the host side (CPU offload, activation offloading) ------------------------------------------------------------
# Device <-> host memory per GPU and direction (datasheets; pinned copies reach about LINK_EFFICIENCY of them):
#   pcie3 PCIe 3.0 x16, 16 GB/s (V100, T4)   pcie4 PCIe 4.0 x16, 32 GB/s (A100, L40S, RTX4090, ...)
#   pcie5 PCIe 5.0 x16, 64 GB/s (H100, H200, B200)
#   c2c   NVLink-C2C, 900 GB/s bidirectional between the Grace CPU and the Hopper GPU (NVIDIA GH200 datasheet)
HOST_LINKS: dict[str, tuple[float, float]] = {"pcie3": (16e9, 10e-6), "pcie4": (32e9, 10e-6), "pcie5": (64e9, 10e-6),
                                              "c2c": (450e9, 5e-6)}
GPU_HOST_LINK = {"H100-SXM": "pcie5", "H100-PCIe": "pcie5", "H100-NVL": "pcie5", "H200": "pcie5", "B200": "pcie5",
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

# GPU -> (HBM/GDDR bandwidth B/s, default intra-node link). Memory and peak come from the shared tables.
GPU_EXTRA: dict[str, tuple[float, str]] = {
    "A100-40GB": (1.555e12, "nvlink"), "A100-80GB": (2.039e12, "nvlink"),
    "H100-SXM": (3.35e12, "nvlink"), "H100-PCIe": (2.0e12, "pcie5"), "H100-NVL": (3.9e12, "pcie5"),
    "H200": (4.8e12, "nvlink"), "B200": (8.0e12, "nvlink"), "GH200": (4.0e12, "nvlink"),
    "L40S": (0.864e12, "pcie4"), "L40": (0.864e12, "pcie4"), "L4": (0.3e12, "pcie4"),
    "A10": (0.6e12, "pcie4"), "A10G": (0.6e12, "pcie4"), "A6000": (0.768e12, "pcie4"),
    "RTX6000-Ada": (0.96e12, "pcie4"), "RTX4090": (1.008e12, "pcie4"), "RTX3090": (0.936e12, "pcie4"),
    "V100-16GB": (0.9e12, "nvlink"), "V100-32GB": (0.9e12, "nvlink"), "T4": (0.32e12, "pcie4"),
    "MI300X": (5.3e12, "nvlink"), "MI250X-GCD": (1.6e12, "nvlink"), "MI325X": (6.0e12, "nvlink"),
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
#                kernels taking SMs and memory bandwidth, allocator, clocks under power capping).
#   attention    PyTorch's fused attention (SDPA) forward + backward, fraction of the dense bf16 peak
#   float8       fp8 GEMMs (dynamic scaling), fraction of the fp8 dense peak (2x the bf16 one); None: no fp8 cores
#   elementwise  fraction of the HBM bandwidth that eager element-wise kernels reach
#
# Sources (numbers as published; no text copied):
#   hopper  torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP over 8 H100, local batch 2,
#           seq 8192, selective checkpointing: 5,762 tokens/s/GPU eager, 6,667 with torch.compile (+16%), 8,532
#           compiled with float8 linears (+28%); those H100s ran at 500 W, and the page's footnote puts their peak
#           between the SXM's and the NVL's, so the targets here are its numbers x 989/912 (the midpoint). gemm,
#           elementwise, GPU_MODES["compile"] and float8 are fitted to those three rows (grid search, bench/RESULTS.md);
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
    float8: float | None
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
    "A100-40GB": "ampere", "A100-80GB": "ampere", "A10": "ampere", "A10G": "ampere", "A6000": "ampere",
    "RTX3090": "ampere", "H100-SXM": "hopper", "H100-PCIe": "hopper", "H100-NVL": "hopper", "H200": "hopper",
    "GH200": "hopper", "B200": "blackwell", "L40S": "ada", "L40": "ada", "L4": "ada", "RTX6000-Ada": "ada",
    "RTX4090": "ada", "V100-16GB": "volta", "V100-32GB": "volta", "T4": "turing", "MI300X": "cdna3",
    "MI325X": "cdna3", "MI250X-GCD": "cdna2",
}
# Execution mode -> factor on the non-matmul time (element-wise traffic and per-kernel cost). torch.compile fuses a
# block's norms, rotary, SwiGLU and residual adds into a few kernels; the factor is set so the cost model reproduces
# torchtitan's eager -> compile gain on H100 (+16%, above). Calibration measures it at the model's shapes.
GPU_MODES = {"eager": 1.0, "compile": 0.30}


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
    from paratrain.estimate.gpus import GPUS, gpu_memory
    from paratrain.observe.flops import gpu_peak_flops

    canonical, memory = gpu_memory(name)
    peak = gpu_peak_flops(GPUS[canonical][1])
    if peak is None or canonical not in GPU_EXTRA:
        raise UserError(f"GPU '{canonical}' has no peak FLOPs/bandwidth in the planner's table; calibrate it with "
                        "`paratrain plan --calibrate --name NAME` on the machine and plan with --gpu NAME")
    if canonical == "MI250X-GCD":
        peak /= 2  # the table's MI250X figure is for both dies
    bw, default_intra = GPU_EXTRA[canonical]
    generation = GENERATION[canonical]
    eff = EFFICIENCY[generation]

    def curve(rate):  # a GEMM of x FLOPs reaches rate * x / (x + half)
        half = GPU_GEMM_HALF_FLOP
        return [(x, rate * x / (x + half)) for x in (half / 64, half / 8, half, 8 * half, 64 * half, 512 * half)]

    return Hardware(canonical, memory, peak, curve(eff.gemm * peak), bw * eff.elementwise, GPU_OP_OVERHEAD_S,
                    link(intra or default_intra, canonical), link(inter or "ib400", canonical), GPU_OVERLAP, "cuda",
                    "bf16", "datasheet", generation=generation, attention=curve(eff.attention * peak),
                    float8_gemm=curve(eff.float8 * 2 * peak) if eff.float8 else [], modes=dict(GPU_MODES),
                    host=host_link(GPU_HOST_LINK.get(canonical, "pcie4")), host_adam_params_per_s=host_adam_rate())


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
# The reference model whose training step calibrates `compute_scale` (what the GEMM/element-wise/operator terms
# miss: autograd, the loss, the optimizer, allocator). Deliberately not a preset the benchmark plans.
REF_BATCH, REF_SEQ = 4, 128


def reference_args():
    from paratrain.models.presets import preset_args

    return preset_args("tiny", vocab_size=256, dim=192, n_layers=3, n_heads=6, n_kv_heads=2, ffn_hidden=512,
                       max_seq_len=REF_SEQ)


def model_shapes(args, seq: int, micro_batches: tuple[int, ...], tp: int = 1) -> dict:
    """What a calibration measures at a model's own shapes: each micro-batch's GEMMs (q/k/v/o, w1/w3/w2, the output
    head; tp-split), its attention (heads / tp) and one block (for the execution modes' factor)."""
    hd, t = args.head_dim, tp
    gemms, attention = [], []
    for mb in micro_batches:
        T = mb * seq
        for k, n in ((args.dim, args.n_heads * hd // t), (args.dim, args.n_kv_heads * hd // t),
                     (args.n_heads * hd // t, args.dim), (args.dim, args.ffn_hidden // t),
                     (args.ffn_hidden // t, args.dim), (args.dim, args.vocab_size // t)):
            gemms.append((T, k, n))
        attention.append((mb, args.n_heads // t, seq, hd))
    block = dict(family=args.family, dim=args.dim, n_heads=args.n_heads // t, n_kv_heads=max(1, args.n_kv_heads // t),
                 head_dim=hd, ffn_hidden=args.ffn_hidden // t, vocab_size=args.vocab_size, n_layers=1, max_seq_len=seq,
                 norm_eps=args.norm_eps, rope_theta=args.rope_theta)
    return {"gemms": sorted(set(gemms)), "attention": sorted(set(attention)), "block": block,
            "block_batch": micro_batches[0], "seq": seq}


def _measure_model_shapes(job: dict, modes: tuple[str, ...], device, dtype, timed) -> dict:
    """GEMM, float8 GEMM, attention and one block forward+backward (per execution mode) at a model's shapes."""
    import torch
    import torch.nn.functional as F

    out = {"gemm": [], "float8": [], "attention": [], "block": {}}
    for m, k, n in job["gemms"]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out["gemm"].append((2.0 * m * k * n, 2.0 * m * k * n / timed(lambda: a @ b)))
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and k % 16 == 0 and n % 16 == 0:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device=device)
            t8 = timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            out["float8"].append((2.0 * m * k * n, 2.0 * m * k * n / t8))
    for b, h, s, d in job["attention"]:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        fwd = 4.0 * b * s * s * h * d / 2  # causal: half the square (the cost model's count)
        out["attention"].append((fwd, 3 * fwd / timed(fwd_bwd)))
    import dataclasses

    from paratrain.models import ModelArgs, build_model

    # One block of the model's family, cut out as a pipeline stage is (no embedding, no head): hidden states in and
    # out. Built with a one-token vocabulary, so the embedding and head it drops never take the device's memory.
    args = ModelArgs(**job["block"])
    block = build_model(dataclasses.replace(args, vocab_size=1)).to(device=device, dtype=dtype)
    block.tok_embeddings = block.output = None
    x = torch.randn(job["block_batch"], job["seq"], args.dim, device=device, dtype=dtype, requires_grad=True)
    for mode in modes:
        run = block if mode == "eager" else torch.compile(block)

        def step():
            run(x).sum().backward()
        out["block"][mode] = timed(step)
    return out


def _calibrate_worker(sizes: list[int], msg_sizes: list[int], seconds: float, shapes: dict | None = None,
                      modes: tuple[str, ...] = ("eager",)) -> dict:
    """On each local rank at once (so the rates are what a rank gets when all ranks compute): matmul rate at
    several sizes, memory bandwidth, per-operator overhead, and all-reduce / all-gather times by message size."""
    import time
    import warnings

    import torch
    import torch.distributed as dist

    from paratrain.distributed.env import init_process_group, world_from_env

    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", world_from_env()[2]) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    init_process_group(device, timeout_s=120)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn, min_s):
        """Local work: as many iterations as fit in min_s (each rank on its own, all at the same time); the median
        iteration (robust to the odd pause of a shared machine)."""
        fn()
        sync()
        dist.barrier()
        times, t0 = [], time.perf_counter()
        while True:
            t1 = time.perf_counter()
            fn()
            sync()
            t2 = time.perf_counter()
            times.append(t2 - t1)
            if t2 - t0 >= min_s and len(times) >= 3:
                return sorted(times)[len(times) // 2]

    def timed_collective(fn, iters):
        """Collectives: the same number of iterations on every rank; the median."""
        fn()
        sync()
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    out = {"gemm": [], "allreduce": [], "allgather": [], "reducescatter": []}
    try:
        for s in sizes:
            a = torch.randn(s, s, device=device, dtype=dtype)
            b = torch.randn(s, s, device=device, dtype=dtype)
            t = timed(lambda: a @ b, seconds)
            out["gemm"].append((2.0 * s**3, 2.0 * s**3 / t))
        big = torch.empty(8 * 2**20, device=device)  # 32 MiB
        t = timed(lambda: big.mul_(1.0001), seconds)
        out["mem_bandwidth"] = 2 * big.numel() * 4 / t
        x = torch.randn(16, 16, device=device, requires_grad=True)

        def ops():
            y = x
            for _ in range(20):
                y = y * 1.0001
            y.sum().backward()
        out["op_overhead_s"] = timed(ops, seconds) / 42  # 20 mul + sum forward, as many backward
        # a reference model (not the one being planned): one training step, forward + backward + AdamW
        from paratrain.models import build_model

        ref_args = reference_args()
        torch.manual_seed(0)
        model = build_model(ref_args).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, ref_args.vocab_size, (REF_BATCH, REF_SEQ + 1), device=device)

        def train_step():
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["reference_step_s"] = timed(train_step, 2 * seconds)
        if shapes is not None:
            out["shapes"] = _measure_model_shapes(shapes, modes, device, dtype, lambda fn: timed(fn, seconds))
        world = dist.get_world_size()
        for nbytes in msg_sizes:
            v = torch.ones(nbytes // 4, device=device)
            iters = 20 if nbytes <= 2**18 else 6
            out["allreduce"].append((nbytes, timed_collective(lambda: dist.all_reduce(v), iters)))
            part = torch.ones(nbytes // 4 // world, device=device)
            res = torch.empty(part.numel() * world, device=device)
            out["allgather"].append((nbytes, timed_collective(lambda: dist.all_gather_into_tensor(res, part), iters)))
            out["reducescatter"].append((nbytes, timed_collective(lambda: dist.reduce_scatter_tensor(part, v), iters)))
        # every rank's numbers: the slowest rank decides
        vec = torch.tensor([r for _, r in out["gemm"]] + [out["mem_bandwidth"]], dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN)
        out["gemm"] = [(f, float(r)) for (f, _), r in zip(out["gemm"], vec[:-1].tolist())]
        out["mem_bandwidth"] = float(vec[-1])
        times = torch.tensor([t for _, t in out["allreduce"] + out["allgather"] + out["reducescatter"]]
                             + [out["reference_step_s"], out["op_overhead_s"]], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        k = len(msg_sizes)
        tl = times.tolist()
        out["allreduce"] = [(n, tl[i]) for i, n in enumerate(msg_sizes)]
        out["allgather"] = [(n, tl[k + i]) for i, n in enumerate(msg_sizes)]
        out["reducescatter"] = [(n, tl[2 * k + i]) for i, n in enumerate(msg_sizes)]
        out["op_overhead_s"] = tl[-1]
        out["reference_step_s"] = tl[-2]
        out["world"], out["cuda"] = world, cuda
        if cuda:
            out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
            out["device_name"] = torch.cuda.get_device_name(device)
        return out
    finally:
        dist.destroy_process_group()


def _apply_model_shapes(hw: Hardware, measured: dict, model, shapes: dict, tp: int) -> None:
    """Fold what was measured at a model's shapes into the profile (see `calibrate`)."""
    import dataclasses

    from paratrain.layout import Layout
    from paratrain.planner.cost import Candidate, Context, block_costs

    hw.gemm = sorted(set(hw.gemm) | {tuple(x) for x in measured["gemm"]})
    hw.attention = sorted(tuple(x) for x in measured["attention"])
    hw.float8_gemm = sorted(tuple(x) for x in measured["float8"])
    block_args = dataclasses.replace(model, **{k: shapes["block"][k] for k in ("n_heads", "n_kv_heads", "ffn_hidden")},
                                     head_dim=model.head_dim)
    seq, mb = shapes["seq"], shapes["block_batch"]
    for mode, seconds in measured["block"].items():
        # the cost model's block at this shape, with and without its non-matmul part (mode factor 1 and 0)
        times = []
        for factor in (1.0, 0.0):
            probe = dataclasses.replace(hw, modes={"eager": factor}, compute_scale=1.0)
            ctx = Context(block_args, seq, mb, probe, 1, hw.precision, "calibration")
            bc = block_costs(ctx, probe, 1, mb, 1, "none")
            times.append(bc.forward + bc.backward)
        full, matmul = times
        hw.modes[mode] = min(20.0, max(0.05, (seconds - matmul) / max(full - matmul, 1e-12)))
        hw.shapes[f"block {mode} (micro-batch {mb} x seq {seq}, tp {tp})"] = seconds
    for flop, rate in measured["gemm"]:
        hw.shapes[f"gemm {flop / 1e9:.3g} GFLOP"] = flop / rate
    for flop, rate in measured["attention"]:
        hw.shapes[f"attention {flop / 1e9:.3g} GFLOP forward"] = 3 * flop / rate
    hw.notes.append(f"calibrated at the shapes of {model.n_layers}-block dim-{model.dim} model, seq {seq}, tp {tp}; "
                    + ", ".join(f"{m} non-matmul factor {f:.2f}" for m, f in hw.modes.items()))


def fit_alpha_beta(points: list[tuple[int, float]], steps: float, volume: float) -> tuple[float, float]:
    """Least squares for t = steps * alpha + volume * nbytes / bw over (nbytes, t): returns (alpha, bw)."""
    xs = [volume * n for n, _ in points]
    ys = [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    slope = max(slope, 1e-15)
    return max(intercept, 0.0) / max(steps, 1), 1.0 / slope


def calibrate(name: str, nproc: int, profile_dir: str | Path | None = None, seconds: float = 0.25, model=None,
              seq: int | None = None, micro_batches: tuple[int, ...] = (1, 2), tp: int = 1,
              modes: tuple[str, ...] | None = None) -> tuple[Hardware, Path]:
    """Measure this machine with `nproc` local ranks and save the profile as NAME.json.

    With `model` (ModelArgs), also at that model's own shapes (sequence `seq`, `micro_batches`, `tp`): its GEMMs (and
    float8 GEMMs where the GPU has them) join the GEMM curve, its attention gives the attention curve, and one of its
    blocks, timed forward + backward in each execution mode (`modes`; default eager and compile on CUDA, eager on a
    CPU), gives each mode's factor on the non-matmul time: (measured - the GEMMs and attention at the measured
    rates) / what the cost model counts for the rest."""
    import torch

    from paratrain.distributed.launch import launch
    from paratrain.planner.profile import EXECUTION_MODES

    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    if not name or "/" in name:
        raise UserError(f"profile name '{name}' must be a plain name (it becomes NAME.json)")
    cuda = torch.cuda.is_available()
    modes = tuple(modes or (("eager", "compile") if cuda else ("eager",)))
    bad = [m for m in modes if m not in EXECUTION_MODES]
    if bad:
        raise UserError(f"calibration mode '{bad[0]}' is not one of {', '.join(EXECUTION_MODES)}")
    shapes = None
    if model is not None:
        seq = seq or min(model.max_seq_len, 4096)
        if seq < 1 or seq > model.max_seq_len or tp < 1:
            raise UserError(f"--seq {seq} must be between 1 and the model's max_seq_len {model.max_seq_len}")
        shapes = model_shapes(model, seq, tuple(micro_batches), tp)
    sizes = [256, 1024, 4096, 8192] if cuda else [32, 64, 128, 256, 512]
    msgs = [2**12, 2**16, 2**20, 2**24] if cuda else [2**12, 2**15, 2**18, 2**20, 2**22]
    r = launch(_calibrate_worker, (sizes, msgs, seconds, shapes, modes), nproc)
    n = r["world"]
    # ring all-reduce: 2(n-1) steps moving 2(n-1)/n of the buffer; all-gather: (n-1) steps, (n-1)/n
    if n > 1:
        a_ar, bw_ar = fit_alpha_beta(r["allreduce"], 2 * (n - 1), 2 * (n - 1) / n)
        a_ag, bw_ag = fit_alpha_beta(r["allgather"], n - 1, (n - 1) / n)
        from paratrain.planner.cost import all_gather_time

        ring = Link("measured", (bw_ar + bw_ag) / 2, (a_ar + a_ag) / 2)
        # the reduce-scatter against the ring formula with these alpha and beta (median over the sizes)
        ratios = sorted(t / all_gather_time(nbytes, n, ring) for nbytes, t in r["reducescatter"])
        intra = dataclasses.replace(ring, reduce_scatter_factor=max(1.0, ratios[len(ratios) // 2]))
    else:
        intra = Link("measured", 1e12, 0.0)
    gemm = [(f, rate) for f, rate in r["gemm"]]
    if cuda:
        memory = int(r["memory_bytes"])
        from paratrain.observe.flops import gpu_peak_flops

        peak = gpu_peak_flops(r["device_name"]) or max(rate for _, rate in gemm)
    else:
        import psutil

        memory = psutil.virtual_memory().total // nproc
        peak = max(rate for _, rate in gemm)
    cores = os.cpu_count() or 1
    # On a CPU, gloo's collectives run on threads that compete with the compute of nproc ranks: with no spare core
    # nothing overlaps.
    overlap = GPU_OVERLAP if cuda else (0.5 if cores >= 2 * nproc else 0.0)
    hw = Hardware(name, memory, peak, gemm, r["mem_bandwidth"], r["op_overhead_s"], intra, None, overlap,
                  "cuda" if cuda else "cpu", "bf16" if cuda else "fp32", f"calibrated with {n} local ranks",
                  [f"all-reduce points {r['allreduce']}", f"all-gather points {r['allgather']}",
                   f"reduce-scatter points {r['reducescatter']} (x{intra.reduce_scatter_factor:.2f} the ring formula)"])
    add_host_side(hw, max(1, cores // nproc))  # for the memory tiers
    if shapes is not None:
        _apply_model_shapes(hw, r["shapes"], model, shapes, tp)
    # compute_scale: the reference step measured against what the cost model predicts for it on this profile
    from paratrain.layout import Layout
    from paratrain.planner.cost import Candidate, Context, predict

    ref = predict(Candidate(Layout.resolve(1), micro_batch=REF_BATCH),
                  Context(reference_args(), REF_SEQ, REF_BATCH, hw, 1, hw.precision, "reference"))
    hw.compute_scale = max(1.0, r["reference_step_s"] / (ref.compute_s + ref.optimizer_s))
    hw.notes.append(f"reference step {r['reference_step_s'] * 1e3:.2f} ms measured, "
                    f"{(ref.compute_s + ref.optimizer_s) * 1e3:.2f} ms predicted before scaling")
    d = Path(profile_dir or default_profile_dir())
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps(hw.to_json(), indent=2))
    return hw, path
