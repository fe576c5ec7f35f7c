"""Which launch attempt this rank belongs to: 0 for the first launch, 1.. for restarts, for paratrain's launcher and
torchrun's agents alike (the resume decision, the restart store's prefix, the fault injector, the metrics).
Torch-free at import."""

from __future__ import annotations

import functools
import os
from datetime import timedelta

ATTEMPT_ENV = "PARATRAIN_ATTEMPT"  # set by paratrain's launcher for the ranks: 0 for the first launch, 1.. for restarts


def attempt() -> int:
    """This rank's launch attempt: 0 for the first launch, 1.. after restarts. paratrain's launcher counts them in
    ATTEMPT_ENV; under torchrun's agents the agents' store does (`agent_attempt`), because an agent's own count
    (TORCHELASTIC_RESTART_COUNT) is only its node's: when a rank fails on one node, the other nodes' agents restart
    their healthy ranks as a membership change, with a count of 0. Without the agents' store (torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), TORCHELASTIC_RESTART_COUNT is what is known."""
    if ATTEMPT_ENV in os.environ:
        return int(os.environ[ATTEMPT_ENV] or 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return agent_attempt(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]))
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


AGENT_LAUNCHES = "paratrain/launches"  # in the agents' store: how many ranks of the job have started, all attempts


@functools.cache
def agent_attempt(host: str, port: int, world_size: int) -> int:
    """The attempt number every rank of a torchrun job agrees on, from one counter in the agents' store (it lives as
    long as the job): each rank adds 1 when it first asks, so the ranks of attempt k read k*world + 1 ..
    (k+1)*world. Torch elastic starts a new attempt's ranks only after every rank of the last one has stopped, and a
    rank asks at start (before any step), so the counts of two attempts never interleave. Assumes a fixed world size
    (`--nnodes N`, not a range)."""
    # lazy: this module is imported by the command line before torch (the launcher's checks answer without it)
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=60))
    return (store.add(AGENT_LAUNCHES, 1) - 1) // world_size
