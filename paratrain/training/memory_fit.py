"""Before the model is built: does this run fit the memory of this machine?

A model that does not fit would otherwise allocate until a traceback (`DefaultCPUAllocator: can't allocate memory`)
or the kernel's OOM killer, minutes later and with nothing said about why. The memory estimator (paratrain/estimate)
already knows each rank's peak, so every rank compares it with what its device has before anything is allocated:
on a GPU, the device's memory (the same verdict as the FITS / DOES NOT FIT of the start-up table); on a CPU, the
host memory available now, shared by every rank of the node. Over it is one line with both numbers and the
estimator's cheapest change that fits; `resilience.memory_check=false` (`paratrain train --force`) tries anyway.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from paratrain.errors import UserError
from paratrain.estimate import estimate_for_run
from paratrain.estimate.gpus import fmt_bytes
from paratrain.spec import provisional

CGROUP_V2 = Path("/sys/fs/cgroup")


def host_memory_available() -> int:
    """Bytes of host memory a new allocation can have now: the OS's available memory, within a container's
    memory limit (cgroup v2) when it has one."""
    available = psutil.virtual_memory().available
    try:
        limit = (CGROUP_V2 / "memory.max").read_text().strip()
        if limit != "max":
            used = int((CGROUP_V2 / "memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to respect (another OS, or cgroup v1)
    return max(0, available)


def check_host_memory(parts, nproc: int) -> None:
    """Before the data is prepared and the ranks start (torch-free): a CPU run whose `nproc` ranks cannot fit the
    host's memory even with the smallest vocabulary is refused at once, nothing written. The ranks check again with
    the real vocabulary (`check_memory_fits`); a GPU's memory is only known there."""
    # lazy: loaded by the launcher's checks already (training/checkpoint.py); this module's importers need not
    import torch

    device = parts.cfg.training.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if parts.cfg.resilience.memory_check and on_cpu:
        verdict = _verdict(provisional(parts), "cpu", host_memory_available(), nproc)
        if verdict:
            raise UserError(verdict)


def check_memory_fits(spec, device, local_ranks: int) -> None:
    """Refuse (UserError, the same on every rank) a run whose estimated peak does not fit this machine's memory.
    Every rank measures before any of them allocates (they meet in one all-gather)."""
    # lazy: the check before launch (check_host_memory) answers without torch
    import torch
    # lazy: the check before launch (check_host_memory) answers without torch
    import torch.distributed as dist

    if not spec.cfg.resilience.memory_check:
        return
    if device.type == "cuda":
        verdict = _verdict(spec, "cuda", torch.cuda.get_device_properties(device).total_memory, 1)
    else:
        verdict = _verdict(spec, "cpu", host_memory_available(), local_ranks)
    if dist.is_initialized():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
        verdict = next((v for v in verdicts if v), None)
    if verdict:
        raise UserError(verdict)


def _verdict(spec, device: str, have: int, shared: int) -> str | None:
    """The refusal, or None: whether `shared` ranks of `spec` fit `have` bytes of `device` memory."""
    shared = max(1, shared)
    try:  # the estimator's verdict for one rank's share, with its cheapest change that fits when it does not
        est = estimate_for_run(spec, device=device, gpu_bytes=have // shared)
    except UserError:
        return None  # a run the estimator does not model (the start-up table says so): nothing to check against
    return None if est.fits is not False else _refusal(est, device, have, shared)


def _refusal(est, device: str, have: int, shared: int) -> str:
    need = est.total_bytes * shared
    where = (f"{fmt_bytes(have)} of GPU memory" if device == "cuda"
             else f"{fmt_bytes(have)} of host memory available" + (f" for its {shared} ranks" if shared > 1 else ""))
    per_rank = f" ({fmt_bytes(est.total_bytes)} per rank x {shared})" if shared > 1 else ""
    suggested = est.suggestion and est.suggestion["change"]
    if suggested and device == "cpu":  # the planner speaks of GPUs; a CPU run's ranks would be more machines
        suggested = suggested.replace(" GPUs)", " ranks, on more machines)")
    change = (f"would fit: {suggested}" if suggested
              else "nothing the estimator tried fits: a smaller model, or more devices")
    usable = f" (usable: {fmt_bytes(est.usable_bytes * shared)})" if est.usable_bytes * shared < have else ""
    return (f"this run needs about {fmt_bytes(need)}{per_rank} at its peak (memory estimate) and this machine has "
            f"{where}{usable}; {change}; --force (resilience.memory_check=false) tries anyway")
