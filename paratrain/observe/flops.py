"""Peak throughput by device name, for MFU. Dense (no sparsity) bf16 tensor-core figures from vendor datasheets.

`peak_flops` is the denominator of the trainer's MFU; it reads the one table of device peaks
(`paratrain.estimate.gpus.GPU_PEAK_BF16`, beside the GPUs' memory), which the planner's GPU profiles read too.
Without a datasheet entry (a CPU) the peak is a short matmul measurement, which is no peak: `is_datasheet_peak` says so, and the trainer then reports no MFU (throughput against a measured
matmul rate can exceed 100%).
"""

from __future__ import annotations

import time

from paratrain.estimate.gpus import gpu_peak_flops


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


def peak_flops(device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number came from)."""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch

    if configured_tflops > 0:
        return configured_tflops * 1e12, CONFIGURED
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak, f"{DATASHEET} ({name})"
        return measure_matmul_flops(device, 4096, torch.bfloat16), f"measured ({name} not in table)"
    return measure_matmul_flops(device), "measured CPU matmul"
