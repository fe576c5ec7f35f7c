"""Peak throughput by device name, for MFU: the dense (no sparsity) datasheet peak of the matmul rate the run uses
(paratrain.modes.matmul_math: bf16/fp16 the 16-bit tensor cores', fp32 TF32's or plain fp32's).

`peak_flops` is the denominator of the trainer's MFU; it reads the one table of devices (`paratrain.estimate.gpus.GPUS`:
memory, bandwidth and the peak of each rate), which the planner's GPU profiles read too. Without a datasheet entry
(a CPU) the peak is a short matmul measurement, which is no peak: `is_datasheet_peak` says so, and the trainer then
reports no MFU (throughput against a measured matmul rate can exceed 100%).
"""

from __future__ import annotations

import time

from paratrain.estimate.gpus import GPUS, gpu_from_device_name
from paratrain.modes import Precision


def measure_matmul_flops(device, size: int = 512, dtype=None, seconds: float = 0.3) -> float:
    """Achieved matmul FLOP/s on this device: the CPU 'peak' when no datasheet applies. (torch is imported here,
    not at module level: the planner reads the peak table without it.)"""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * size**3 * iters / (time.perf_counter() - start)


CONFIGURED, DATASHEET = "configured", "datasheet"  # the sources of a real peak (metrics.peak_tflops, the table)


def is_datasheet_peak(source: str) -> bool:
    """Whether `peak_flops`'s number is a device peak (a datasheet entry or metrics.peak_tflops), so that MFU
    against it means something; a measured matmul rate is not."""
    return source.split(" ")[0] in (CONFIGURED, DATASHEET)


def peak_flops(device, configured_tflops: float, precision: str, tf32: bool) -> tuple[float, str]:
    """(peak FLOP/s per device of the rate a run's matmuls go at (`precision`, with TF32 switched on or not:
    paratrain.modes.matmul_math), where the number came from)."""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch

    if configured_tflops > 0:
        return configured_tflops * 1e12, CONFIGURED
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = gpu_from_device_name(name, torch.cuda.get_device_properties(device).total_memory)
        if table is not None:
            gpu = GPUS[table]
            math = Precision(precision).matmul_math(tf32, gpu.tf32 is not None)
            return gpu.peak(math), f"{DATASHEET} ({name}, {math})"
        return measure_matmul_flops(device, 4096, torch.bfloat16), f"measured ({name} not in table)"
    return measure_matmul_flops(device), "measured CPU matmul"
