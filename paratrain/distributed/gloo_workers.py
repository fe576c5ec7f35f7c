"""Gloo process groups with one worker thread: a workaround for a heap corruption in torch's ProcessGroupGloo.

torch (2.13) runs each gloo group's collectives on `_threads` worker threads (2 unless told), and each worker, after
finishing a collective (`ProcessGroupGloo::runLoop`, after `AsyncWork::execute` has already woken the waiting
rank), writes the group's status without a lock: `pgStatus_->lastCompletedWorkName = opTypeToString(opType)`. Two
workers of one group finishing back to back assign the same std::string at once. DTensor's gathers (functional
collectives: `all_gather_into_tensor` runs gloo's `allgather_into_tensor_coalesced`) are named
"ALLGATHER_COALESCED", longer than the string's inline buffer, so each assignment frees and allocates heap memory:
two at once free one buffer twice or write into a freed one, and glibc aborts a later allocation ("malloc():
unaligned tcache chunk detected"), in whatever collective comes next. Tensor parallelism issues many small such
gathers in a row (a forward's sequence-parallel gathers, the loss-parallel logits, the final weights' gather), so a
loaded CPU run of tp2 hit it (issue 52, item 5). (Read in torch 2.13's libtorch_cpu.so: `gdb -batch -ex "disassemble
'c10d::ProcessGroupGloo::runLoop(int)'"` shows pthread_mutex_unlock, AsyncWork::execute, opTypeToString, the
string's pointer swapped in and the old buffer's operator delete, and only then pthread_mutex_lock.)

With one worker per group only one thread ever writes a group's status. A second worker only overlaps two of one
group's collectives, which paratrain's CPU runs (tests, checks; GPUs use NCCL) do not need, with one exception: torch's
PowerSGD hook waits for an all-reduce inside the completion callback of the previous one, which runs on the worker
that completed it; with one worker it would wait on itself. A run with PowerSGD keeps two (`threads=2`; its
collectives, ALLREDUCE and ALLGATHER, have names short enough to live inside the string: no heap, no double free).
"""

from __future__ import annotations

import os

from torch.distributed import distributed_c10d

GLOO_WORKERS = 1
_threads = [GLOO_WORKERS]  # the worker threads of the gloo groups made from now on (`one_worker_gloo`)


def one_worker_gloo(threads: int = GLOO_WORKERS) -> None:
    """Make every gloo group this process creates from now on (the default group, the mesh's sub-groups, new_group)
    run `threads` worker threads (1 but for PowerSGD's runs). Call it before the first group starts."""
    _threads[0] = threads
    base = distributed_c10d.ProcessGroupGloo
    if getattr(base, "_paratrain_workers", None) is not None:
        return

    class OneWorkerGloo(base):
        """torch's ProcessGroupGloo built the way `_new_process_group_helper` asks (store, rank, size, timeout) but
        with GLOO_WORKERS worker threads; still an instance of ProcessGroupGloo for torch's isinstance checks."""

        _paratrain_workers = GLOO_WORKERS

        def __init__(self, store, rank, size, timeout=distributed_c10d.default_pg_timeout):
            options = base._Options()
            options._timeout = timeout
            options._threads = _threads[0]
            # the devices torch's own constructor picks: GLOO_SOCKET_IFNAME's interfaces, else the hostname's
            interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            options._devices = ([base.create_device(interface=i) for i in interfaces] if interfaces
                                else [base.create_default_device()])
            super().__init__(store, rank, size, options)

    OneWorkerGloo.__name__ = OneWorkerGloo.__qualname__ = "ProcessGroupGloo"
    distributed_c10d.ProcessGroupGloo = OneWorkerGloo
