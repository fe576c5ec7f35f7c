"""The offloading memory tiers' shared sizes, torch-free (docs/memory-tiers.md): for the trainer, the estimator and the
planner alike.

The memory tiers themselves are capabilities (paratrain/capabilities): the chunked loss (`ChunkedLoss`), activation
offload (`ActivationOffload`) and CPU offload (`CpuOffload`); a layout's name switches them on, and their keys, checks,
rules and terms live in their modules.
"""

from __future__ import annotations

MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors stay on the device (a copy costs more than it saves; torchtune's)
HOST_HEADROOM = 0.2  # of a node's host memory kept for the OS, the data loaders and the ranks' own processes
