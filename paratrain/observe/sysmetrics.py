"""Per-rank system numbers (memory) and the one collective that brings them to every rank; the step-time split.

What is measured, and how:
- CPU: the process's resident set size (`rss_bytes`, psutil) and its peak (`rss_peak_bytes`, getrusage: psutil has no
  portable peak).
- CUDA: `torch.cuda.memory_stats` of the rank's device: allocated, reserved and peak allocated bytes, the caching
  allocator's retries (a cudaMalloc failed, the cache was flushed and the allocation retried: a sign of memory
  pressure and fragmentation) and its OOM count; over the ranks, the worst rank's reserved - allocated gap
  (`mem_fragmentation_mib`) and all retries (`alloc_retries`), record fields on CUDA only.
- Every rank: the caching allocator's settings it started with (`allocator`, paratrain/allocator.py).

`gather_rank_stats` is a collective (one `all_gather_object`): every rank must call it at the same steps. The
trainer calls it on log steps only.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time

import psutil
import torch
import torch.distributed as dist

from paratrain import allocator


def node_index(rank: int | None = None) -> int:
    """This process's node: the launcher's GROUP_RANK, else rank // LOCAL_WORLD_SIZE."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    return psutil.Process().memory_info().rss


def rss_peak_bytes() -> int:
    """This process's peak resident set size so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def device_peak_bytes(device=None) -> int:
    """Peak bytes allocated on the trainer's device: torch.cuda.max_memory_allocated on CUDA (call
    torch.cuda.reset_peak_memory_stats() first to measure a window); on CPU the process's peak resident set size (an
    upper bound: it includes Python, torch and the data)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return rss_peak_bytes()


def local_memory(device: torch.device) -> dict:
    """This rank's memory numbers (bytes; counts for retries and OOMs)."""
    rss = rss_bytes()
    row = {"rss_bytes": rss, "rss_peak_bytes": max(rss, rss_peak_bytes())}
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        row.update({"cuda_allocated_bytes": s.get("allocated_bytes.all.current", 0),
                    "cuda_reserved_bytes": s.get("reserved_bytes.all.current", 0),
                    "cuda_peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
                    "cuda_alloc_retries": s.get("num_alloc_retries", 0),
                    "cuda_ooms": s.get("num_ooms", 0)})
    row["allocator"] = allocator.in_effect()[0]  # the caching allocator's settings this rank started with
    return row


def allocator_summary(rows: list[dict]) -> dict:
    """CUDA only (absent on a CPU, not zeros): the worst rank's fragmentation, memory the caching allocator holds
    but no tensor uses (reserved - allocated, MiB), and the allocator's retries over all ranks (a cudaMalloc failed,
    the cache was flushed and the allocation tried again: memory pressure, often fragmentation)."""
    cuda = [r for r in rows if "cuda_reserved_bytes" in r]
    if not cuda:
        return {}
    gap = max(r["cuda_reserved_bytes"] - r["cuda_allocated_bytes"] for r in cuda)
    return {"mem_fragmentation_mib": gap / 2**20, "alloc_retries": sum(r["cuda_alloc_retries"] for r in cuda)}


def gather_rank_stats(device: torch.device) -> dict:
    """Every rank's memory, on every rank. A collective when distributed: call it on every rank at the same steps.

    Returns record fields: `rank_memory` (one dict per rank, in rank order) and `stats_gather_s` (seconds spent in
    the gather: communication plus waiting for the slowest rank).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {"rank": rank, "node": node_index(rank), "host": socket.gethostname(), **local_memory(device)}
    t0 = time.perf_counter()
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    return {"rank_memory": rows, "stats_gather_s": time.perf_counter() - t0, **allocator_summary(rows)}


class PhaseTimer:
    """Splits a step's wall time into measured phases.

    `start()` at the top of a step (returns perf_counter and clears the totals); `with timer("data_time_s"):` around
    the batch fetch, `with timer("comm_time_s", device):` around an explicit collective (on CUDA two timing events on
    the current stream, so the interval is the collective and the wait for the slowest rank, not our own compute,
    and nothing waits for the device now); `take()` the step's phases, `split(step_seconds, phases)` (once the
    device has passed the events: on a log step) those totals plus `compute_time_s`, the rest of the step.
    Collectives that run inside forward/backward (FSDP all-gathers, gradient reduce-scatters, DDP all-reduces, TP)
    overlap compute and cannot be told apart without a profiler: they count as compute.
    """

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.events: list = []  # (phase, start event, end event) of device phases on CUDA

    def start(self) -> float:
        self.totals, self.events = {}, []
        return time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str, device: torch.device | None = None):
        if device is not None and device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((phase, begin, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t0

    def take(self) -> tuple[dict, list]:
        """This step's phases, to `split` later."""
        return dict(self.totals), list(self.events)

    def split(self, step_seconds: float, phases: tuple[dict, list] | None = None) -> dict:
        totals, events = phases if phases is not None else (self.totals, self.events)
        totals = dict(totals)
        for phase, begin, end in events:
            totals[phase] = totals.get(phase, 0.0) + begin.elapsed_time(end) / 1000
        out = {"data_time_s": totals.get("data_time_s", 0.0), "comm_time_s": totals.get("comm_time_s", 0.0)}
        out["compute_time_s"] = max(0.0, step_seconds - sum(totals.values()))
        return out
