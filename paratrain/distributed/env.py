"""Process-group set-up from the launcher's environment (torchrun / elastic agent), or a single process."""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import distributed_c10d
import torch.distributed as dist

from paratrain.distributed.attempts import attempt
from paratrain.distributed.gloo_workers import one_worker_gloo
from paratrain.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args, all_ranks: bool = False) -> None:
        """Rank 0 prints; other ranks print (with a rank prefix) only when asked."""
        if self.rank == 0 and self.world_size == 1:
            print(*args, flush=True)
        elif self.rank == 0 or all_ranks:
            print(f"[rank {self.rank}]", *args, flush=True)


def world_from_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("training.device=cuda but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def quiet_torch_logs() -> None:
    """DTensor warns on every multi-axis redistribute (e.g. the 2-D gradient norm); one line per step per rank
    buries the training log, and the advice does not apply to reductions we do once per step."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # On gloo DTensor's all-to-all is an all-gather and a slice (a capability's optimizer redistributing sharded
    # updates to whole matrices, paratrain/capabilities): said once per rank, known
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)


HISTORY_ENV = "TORCH_FR_BUFFER_SIZE"  # torch's flight recorder: collectives kept per process (0: off)
COLLECTIVE_HISTORY = 2000  # paratrain's default, read back on a hang (paratrain/observe/hang.py)


def init_process_group(device: torch.device, timeout_s: float, host_collectives: bool = False,
                       gloo_threads: int = 1) -> None:
    """Join the launcher's process group (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment) for `device`:
    NCCL bound to a CUDA device (made the current one), gloo on CPU. The one place paratrain starts a group:
    the trainer (`init_distributed`), `paratrain doctor`'s all-reduce test and `paratrain plan --calibrate`.
    torch's flight recorder keeps the last COLLECTIVE_HISTORY collectives (unless TORCH_FR_BUFFER_SIZE is set).
    host_collectives: on CUDA also gloo for tensors in host memory (CPU offload: the gradient norm and the fp16
    scaler's overflow flag are reduced where the gradients are)."""
    os.environ.setdefault(HISTORY_ENV, str(COLLECTIVE_HISTORY))
    # torch's two gloo workers per group race on the group's status: heap corruption (gloo_workers.py); PowerSGD's
    # runs keep two (`gloo_threads`)
    one_worker_gloo(gloo_threads)
    # Groups made later (the mesh's sub-groups, new_group) take torch's default timeout (30 min on gloo, 10 on NCCL),
    # not this group's: make it the run's, so a stuck rank ends the run whichever group it blocks.
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    timeout = timedelta(seconds=timeout_s)
    store = restart_store(timeout)
    where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": int(os.environ["WORLD_SIZE"])}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
        dist.init_process_group(backend, timeout=timeout, device_id=device, **where)
    else:
        dist.init_process_group("gloo", timeout=timeout, **where)


def restart_store(timeout: timedelta):
    """Under torchrun's `--max-restarts`, a restarted rank's store: torch elastic's agents keep one store for all the
    workers' attempts, and the names `new_group` gives the mesh's groups repeat, so without a prefix of its own a
    restarted rank reads the dead attempt's gloo addresses (connectFullMesh: connection refused). The prefix is the
    attempt every rank of the job agrees on (`launch.attempt`: on every node, also those whose ranks did not fail).
    None on a first attempt, or when the ranks do not share the agents' store (paratrain's launcher starts a fresh
    one per attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or (restart := attempt()) == 0:
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"paratrain/restart_{restart}", agent)


def init_distributed(device_preference: str = "auto", timeout_s: float = 600.0,
                     host_collectives: bool = False, gloo_threads: int = 1) -> DistEnv:
    rank, world, local_rank = world_from_env()
    quiet_torch_logs()
    device = pick_device(device_preference, local_rank)
    if world > 1 and not dist.is_initialized():
        # NCCL on GPUs, gloo on CPU: the same training code runs on both
        init_process_group(device, timeout_s, host_collectives, gloo_threads)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistEnv(rank, world, local_rank, device)


def default_store():
    """The process group's key-value store (under a launcher, the launcher's: it outlives any rank)."""
    return distributed_c10d._get_default_store()


def register_process() -> None:
    """Publish host and pid in the rendezvous store so a rank that finds the group broken can stop its peers."""
    if dist.is_initialized():
        default_store().set(f"paratrain/pid/{dist.get_rank()}", f"{socket.gethostname()}:{os.getpid()}")


def local_peer_pids(timeout_s: float = 5) -> dict[int, int]:
    """{rank: pid} of the other ranks on this host, as they published them at start ({} without a group or store)."""
    if not dist.is_initialized():
        return {}
    peers, me, host = {}, dist.get_rank(), socket.gethostname()
    try:
        store = default_store()
        store.set_timeout(timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - the store may be gone too; the launcher will clean up
        return {}
    for rank in range(dist.get_world_size()):
        if rank == me:
            continue
        try:
            peer_host, pid = store.get(f"paratrain/pid/{rank}").decode().rsplit(":", 1)
        except Exception:  # noqa: BLE001 - as above
            continue
        if peer_host == host:
            peers[rank] = int(pid)
    return peers


def kill_local_peers_after_exit(code: int) -> None:
    """End this process with exit code `code`, then SIGKILL the other ranks on this host (after a collective timeout
    the group cannot recover, and a frozen rank would hold the launcher for its 30 s shutdown grace). The kill comes
    from a forked child once this process is gone, so the launcher sees this rank's exit code before its peers die
    (it reports the first failure it sees: a peer killed first would read as a crash)."""
    import sys
    import time

    pids = list(local_peer_pids().values())
    sys.stdout.flush()
    sys.stderr.flush()
    if pids and os.fork() == 0:  # the child: only waits, kills and exits (nothing else is safe after a fork)
        parent = os.getppid()
        deadline = time.monotonic() + 10
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # the launcher polls its ranks every 0.1 s
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)
    os._exit(code)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
