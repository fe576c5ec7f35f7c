"""Hardware profiles for the planner: a device (memory, peak, achievable matmul rate, memory bandwidth, per-op
overhead) and the links between devices (bandwidth, latency), either from datasheet tables or measured on this
machine by `paratrain plan --calibrate` and saved as JSON.

Memory sizes come from `paratrain.estimate.gpus` and dense bf16 peaks from `paratrain.observe.flops` (one table
each); this module only adds what the cost model needs on top: HBM bandwidth, the achievable fraction of peak, and
links. The `Hardware` and `Link` types live in `planner/profile.py` (the cost model reads them; calibration here
runs the cost model).
"""

from __future__ import annotations

import json
import os
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
# Large bf16 GEMMs reach about this fraction of the dense datasheet peak (cuBLAS on H100 ~ 0.7-0.8); a GEMM
# of GEMM_HALF_FLOP reaches half of that (small matmuls cannot fill the device).
GPU_GEMM_FRACTION = 0.75
GPU_GEMM_HALF_FLOP = 2 * 1024**3
GPU_OP_OVERHEAD_S = 1.5e-6  # exposed launch cost per kernel (mostly hidden by asynchronous launches)


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
    half = GPU_GEMM_HALF_FLOP
    f = GPU_GEMM_FRACTION * peak
    curve = [(x, f * x / (x + half)) for x in (half / 64, half / 8, half, 8 * half, 64 * half, 512 * half)]
    return Hardware(canonical, memory, peak, curve, bw, GPU_OP_OVERHEAD_S, link(intra or default_intra, canonical),
                    link(inter or "ib400", canonical), GPU_OVERLAP, "cuda", "bf16", "datasheet")


def load_profile(name: str, profile_dir: str | Path | None = None) -> Hardware | None:
    path = Path(profile_dir or default_profile_dir()) / f"{name}.json"
    if not path.is_file():
        return None
    try:
        return Hardware.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"profile {path} is not a valid planner profile ({e}); recalibrate it") from None


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


def _calibrate_worker(sizes: list[int], msg_sizes: list[int], seconds: float) -> dict:
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
        """Local work: as many iterations as fit in min_s (each rank on its own, all at the same time)."""
        fn()
        sync()
        dist.barrier()
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            sync()
            el = time.perf_counter() - t0
            if el >= min_s and n >= 3:
                return el / n

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

    out = {"gemm": [], "allreduce": [], "allgather": []}
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
        from paratrain.models.llama import Transformer

        ref_args = reference_args()
        torch.manual_seed(0)
        model = Transformer(ref_args).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, ref_args.vocab_size, (REF_BATCH, REF_SEQ + 1), device=device)

        def train_step():
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["reference_step_s"] = timed(train_step, 2 * seconds)
        world = dist.get_world_size()
        for nbytes in msg_sizes:
            v = torch.ones(nbytes // 4, device=device)
            iters = 20 if nbytes <= 2**18 else 6
            out["allreduce"].append((nbytes, timed_collective(lambda: dist.all_reduce(v), iters)))
            part = torch.ones(nbytes // 4 // world, device=device)
            res = torch.empty(part.numel() * world, device=device)
            out["allgather"].append((nbytes, timed_collective(lambda: dist.all_gather_into_tensor(res, part), iters)))
        # every rank's numbers: the slowest rank decides
        vec = torch.tensor([r for _, r in out["gemm"]] + [out["mem_bandwidth"]], dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN)
        out["gemm"] = [(f, float(r)) for (f, _), r in zip(out["gemm"], vec[:-1].tolist())]
        out["mem_bandwidth"] = float(vec[-1])
        times = torch.tensor([t for _, t in out["allreduce"] + out["allgather"]]
                             + [out["reference_step_s"], out["op_overhead_s"]], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        k = len(msg_sizes)
        tl = times.tolist()
        out["allreduce"] = [(n, tl[i]) for i, n in enumerate(msg_sizes)]
        out["allgather"] = [(n, tl[k + i]) for i, n in enumerate(msg_sizes)]
        out["op_overhead_s"] = tl[-1]
        out["reference_step_s"] = tl[-2]
        out["world"], out["cuda"] = world, cuda
        if cuda:
            out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
            out["device_name"] = torch.cuda.get_device_name(device)
        return out
    finally:
        dist.destroy_process_group()


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


def calibrate(name: str, nproc: int, profile_dir: str | Path | None = None, seconds: float = 0.25) -> tuple[Hardware, Path]:
    """Measure this machine with `nproc` local ranks and save the profile as NAME.json."""
    import torch

    from paratrain.distributed.launch import launch

    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    if not name or "/" in name:
        raise UserError(f"profile name '{name}' must be a plain name (it becomes NAME.json)")
    cuda = torch.cuda.is_available()
    sizes = [256, 1024, 4096, 8192] if cuda else [32, 64, 128, 256, 512]
    msgs = [2**12, 2**16, 2**20, 2**24] if cuda else [2**12, 2**15, 2**18, 2**20, 2**22]
    r = launch(_calibrate_worker, (sizes, msgs, seconds), nproc)
    n = r["world"]
    # ring all-reduce: 2(n-1) steps moving 2(n-1)/n of the buffer; all-gather: (n-1) steps, (n-1)/n
    if n > 1:
        a_ar, bw_ar = fit_alpha_beta(r["allreduce"], 2 * (n - 1), 2 * (n - 1) / n)
        a_ag, bw_ag = fit_alpha_beta(r["allgather"], n - 1, (n - 1) / n)
        intra = Link("measured", (bw_ar + bw_ag) / 2, (a_ar + a_ag) / 2)
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
                  [f"all-reduce points {r['allreduce']}", f"all-gather points {r['allgather']}"])
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
