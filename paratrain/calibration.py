"""`paratrain plan --calibrate`: measure this machine (matmul and attention rates, memory bandwidth, per-op overhead,
collectives across local ranks, a reference model's training step) and save it as a hardware profile the cost model
reads (paratrain/estimate/hardware.py loads it by name).

It runs torch and launches ranks, so it sits above the torch-free cost model (paratrain/estimate/) and the launcher
(paratrain/distributed/): neither imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.capabilities import CAPABILITIES
from paratrain.errors import UserError
from paratrain.estimate.gpus import GPUS, gpu_from_device_name
from paratrain.estimate.hardware import add_host_side, default_profile_dir
from paratrain.estimate.profile import EXECUTION_MODES, GPU_OVERLAP, Hardware, Link
from paratrain.estimate.step_time import Context, all_gather_time, block_costs, planned_run, predict
from paratrain.distributed.env import init_process_group, world_from_env
from paratrain.distributed.launch import launch
from paratrain.layout import Layout
from paratrain.models import ModelArgs, build_model
from paratrain.models.presets import preset_args
from paratrain.modes import CheckpointMode

# The reference model whose training step calibrates `compute_scale` (what the GEMM/element-wise/operator terms
# miss: autograd, the loss, the optimizer, allocator). Deliberately not a preset the benchmark plans.
REF_BATCH, REF_SEQ = 4, 128


def reference_args():
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
    """GEMM, the capabilities' own GEMMs (fp8's), attention and one block forward+backward (per execution mode) at a
    model's shapes."""

    out = {"gemm": [], "attention": [], "block": {}, **{cap.gemm_math: [] for cap in CAPABILITIES if cap.gemm_math}}
    for m, k, n in job["gemms"]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out["gemm"].append((2.0 * m * k * n, 2.0 * m * k * n / timed(lambda: a @ b)))
        for cap in CAPABILITIES:
            seconds = cap.time_gemm(a, b, timed) if cap.gemm_math else None
            if seconds is not None:
                out[cap.gemm_math].append((2.0 * m * k * n, 2.0 * m * k * n / seconds))
    for b, h, s, d in job["attention"]:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        fwd = 4.0 * b * s * s * h * d / 2  # causal: half the square (the cost model's count)
        out["attention"].append((fwd, 3 * fwd / timed(fwd_bwd)))


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
    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", world_from_env()[2]) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    init_process_group(device, timeout_s=120)
    clock = _Clock(device if cuda else None)
    try:
        out = _local_rates(sizes, seconds, device, dtype, clock)
        out["reference_step_s"] = clock.timed(_reference_step(device), 2 * seconds)
        if shapes is not None:
            out["shapes"] = _measure_model_shapes(shapes, modes, device, dtype, lambda fn: clock.timed(fn, seconds))
        out.update(_collective_times(msg_sizes, device, clock))
        _agree_on_the_slowest(out, msg_sizes, device)
        out["world"], out["cuda"] = dist.get_world_size(), cuda
        if cuda:
            out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
            out["device_name"] = torch.cuda.get_device_name(device)
        return out
    finally:
        dist.destroy_process_group()


class _Clock:
    """Median times of local work and of collectives on one rank (`device`: the CUDA device to synchronize, or
    None)."""

    def __init__(self, device):
        self.device = device

    def sync(self) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def timed(self, fn, min_s: float) -> float:
        """Local work: as many iterations as fit in min_s (each rank on its own, all at the same time); the median
        iteration (robust to the odd pause of a shared machine)."""
        fn()
        self.sync()
        dist.barrier()
        times, t0 = [], time.perf_counter()
        while True:
            t1 = time.perf_counter()
            fn()
            self.sync()
            t2 = time.perf_counter()
            times.append(t2 - t1)
            if t2 - t0 >= min_s and len(times) >= 3:
                return sorted(times)[len(times) // 2]

    def timed_collective(self, fn, iters: int) -> float:
        """Collectives: the same number of iterations on every rank; the median."""
        fn()
        self.sync()
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]


def _local_rates(sizes: list[int], seconds: float, device, dtype, clock: _Clock) -> dict:
    """This rank's matmul rate at each size, memory bandwidth and per-operator overhead."""
    out = {"gemm": []}
    for s in sizes:
        a = torch.randn(s, s, device=device, dtype=dtype)
        b = torch.randn(s, s, device=device, dtype=dtype)
        t = clock.timed(lambda: a @ b, seconds)
        out["gemm"].append((2.0 * s**3, 2.0 * s**3 / t))
    big = torch.empty(8 * 2**20, device=device)  # 32 MiB
    t = clock.timed(lambda: big.mul_(1.0001), seconds)
    out["mem_bandwidth"] = 2 * big.numel() * 4 / t
    x = torch.randn(16, 16, device=device, requires_grad=True)

    def ops():
        y = x
        for _ in range(20):
            y = y * 1.0001
        y.sum().backward()
    out["op_overhead_s"] = clock.timed(ops, seconds) / 42  # 20 mul + sum forward, as many backward
    return out


def _reference_step(device):
    """One training step of the reference model (not the one being planned): forward + backward + AdamW."""
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
    return train_step


def _collective_times(msg_sizes: list[int], device, clock: _Clock) -> dict:
    """All-reduce, all-gather and reduce-scatter seconds by message size: [(bytes, seconds)] each."""
    out = {"allreduce": [], "allgather": [], "reducescatter": []}
    world = dist.get_world_size()
    for nbytes in msg_sizes:
        v = torch.ones(nbytes // 4, device=device)
        iters = 20 if nbytes <= 2**18 else 6
        out["allreduce"].append((nbytes, clock.timed_collective(lambda: dist.all_reduce(v), iters)))
        part = torch.ones(nbytes // 4 // world, device=device)
        res = torch.empty(part.numel() * world, device=device)
        out["allgather"].append((nbytes, clock.timed_collective(lambda: dist.all_gather_into_tensor(res, part),
                                                                 iters)))
        out["reducescatter"].append((nbytes, clock.timed_collective(lambda: dist.reduce_scatter_tensor(part, v),
                                                                     iters)))
    return out


def _agree_on_the_slowest(out: dict, msg_sizes: list[int], device) -> None:
    """Every rank's numbers: the slowest rank decides (the least rates, the largest times)."""
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


def _apply_model_shapes(hw: Hardware, measured: dict, model, shapes: dict, tp: int) -> None:
    """Fold what was measured at a model's shapes into the profile (see `calibrate`)."""


    hw.gemm = sorted(set(hw.gemm) | {tuple(x) for x in measured["gemm"]})
    hw.attention = sorted(tuple(x) for x in measured["attention"])
    hw.fp8_gemm = sorted(tuple(x) for x in measured.get("fp8", []))
    block_args = dataclasses.replace(model, **{k: shapes["block"][k] for k in ("n_heads", "n_kv_heads", "ffn_hidden")},
                                     head_dim=model.head_dim)
    seq, mb = shapes["seq"], shapes["block_batch"]
    for mode, seconds in measured["block"].items():
        # the cost model's block at this shape, with and without its non-matmul part (mode factor 1 and 0)
        times = []
        for factor in (1.0, 0.0):
            probe = dataclasses.replace(hw, modes={"eager": factor}, compute_scale=1.0)
            ctx = Context(block_args, planned_run(probe, precision=hw.precision, seq_len=seq), mb, probe, 1,
                          "calibration")
            bc = block_costs(ctx, probe, 1, mb, 1, CheckpointMode.NONE)
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
    fp8 GEMMs where the GPU has FP8 tensor cores) join the GEMM curve, its attention gives the attention curve, and one of its
    blocks, timed forward + backward in each execution mode (`modes`; default eager and compile on CUDA, eager on a
    CPU), gives each mode's factor on the non-matmul time: (measured - the GEMMs and attention at the measured
    rates) / what the cost model counts for the rest."""


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

        ring = Link("measured", (bw_ar + bw_ag) / 2, (a_ar + a_ag) / 2)
        # the reduce-scatter against the ring formula with these alpha and beta (median over the sizes)
        ratios = sorted(t / all_gather_time(nbytes, n, ring) for nbytes, t in r["reducescatter"])
        intra = dataclasses.replace(ring, reduce_scatter_factor=max(1.0, ratios[len(ratios) // 2]))
    else:
        intra = Link("measured", 1e12, 0.0)
    gemm = [(f, rate) for f, rate in r["gemm"]]
    if cuda:
        memory = int(r["memory_bytes"])

        # the datasheet's peaks where the table has the GPU: MFU's denominator, and what scales the measured bf16
        # curves to an fp32 run's GEMMs (Hardware.speed)
        table = gpu_from_device_name(r["device_name"], memory)
        peaks = GPUS[table].peaks() if table else {}
        peak = peaks.get("bf16") or max(rate for _, rate in gemm)
    else:
        import psutil

        memory = psutil.virtual_memory().total // nproc
        peak, peaks = max(rate for _, rate in gemm), {}
    cores = os.cpu_count() or 1
    # On a CPU, gloo's collectives run on threads that compete with the compute of nproc ranks: with no spare core
    # nothing overlaps.
    overlap = GPU_OVERLAP if cuda else (0.5 if cores >= 2 * nproc else 0.0)
    hw = Hardware(name, memory, peak, gemm, r["mem_bandwidth"], r["op_overhead_s"], intra, None, overlap,
                  "cuda" if cuda else "cpu", "bf16" if cuda else "fp32", f"calibrated with {n} local ranks",
                  [f"all-reduce points {r['allreduce']}", f"all-gather points {r['allgather']}",
                   f"reduce-scatter points {r['reducescatter']} (x{intra.reduce_scatter_factor:.2f} the ring formula)"],
                  peaks=peaks)
    add_host_side(hw, max(1, cores // nproc))  # for the memory tiers
    if shapes is not None:
        _apply_model_shapes(hw, r["shapes"], model, shapes, tp)
    _scale_to_reference(hw, r["reference_step_s"])
    d = Path(profile_dir or default_profile_dir())
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps(hw.to_json(), indent=2))
    return hw, path


def _scale_to_reference(hw: Hardware, measured_s: float) -> None:
    """compute_scale: the reference step measured against what the cost model predicts for it on this profile."""
    ctx = Context(reference_args(), planned_run(hw, precision=hw.precision, seq_len=REF_SEQ), REF_BATCH, hw, 1,
                  "reference")
    ref = predict(ctx.candidate(Layout.resolve(1), micro_batch=REF_BATCH), ctx)
    hw.compute_scale = max(1.0, measured_s / (ref.compute_s + ref.optimizer_s))
    hw.notes.append(f"reference step {measured_s * 1e3:.2f} ms measured, "
                    f"{(ref.compute_s + ref.optimizer_s) * 1e3:.2f} ms predicted before scaling")
