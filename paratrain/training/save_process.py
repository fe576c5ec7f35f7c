"""The writer process of background checkpoints: one per rank, started at the rank's first background save and kept
for the run, which writes the checkpoint's shard files from the shared-memory staging buffers.

Why a process: DCP writes one `torch.save` per tensor, ~130 ms of Python per save of the default model. On a thread
of the training process that Python takes the GIL in turns with the training step (bench/checkpoint_async.py: the
steps overlapping a save 1.5x slower on a quiet machine); a process has its own interpreter and runs on a core the
training rank leaves idle. DCP's plan, its collectives, the `.metadata` file, the hashing and the commit stay on the
rank's background thread (training/checkpoint.py): this process only turns each planned write item into bytes in
files, the part that costs the CPU.

What it is sent: each shared-memory staging storage once (its file descriptor, over a Unix socket), then per save
the write items and, for each tensor, where it lies in those storages; a storage the stager no longer uses is dropped
on both sides. What it sends back: DCP's write results, or the exception that stopped the write. Until it has started
(its imports: a second or more on a busy host), saves are written on the rank's background thread as before.

It dies with its rank: the kernel SIGKILLs it when the rank ends by any means (`die_with_parent`: the rank's
thread that started it, the one calling `CheckpointWriter.save`, is the training loop's). It runs in a process group
of its own and ignores SIGINT and SIGTERM, which a terminal or a launcher sends to the rank's process group, so the
rank decides when a save in flight ends (Ctrl-C waits for it); `close()` ends it at the end of the run.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.planner import WriteItemType

from paratrain.faults import FaultInjector

STOP, READY = "stop", "ready"
FDS_PER_MESSAGE = 200  # file descriptors passed in one message (the kernel's limit: 253)
CLOSE_WAIT_S = 5.0  # at close: how long the writer may take to leave on its own before it is killed


class WriterProcess:
    """The rank's side: starts the process, sends it a save's files and waits for their write results."""

    def __init__(self):
        self.conn, theirs = (Connection(s.detach()) for s in socket.socketpair())  # pickled messages
        self.fds, their_fds = socket.socketpair()  # the staging storages' file descriptors (SCM_RIGHTS)
        # (a plain interpreter, not multiprocessing's spawn: that would run the caller's main script again in it.
        # Before its imports, which take seconds: the stop signals ignored, and tied to this process, torch-free, so
        # a rank that dies while it starts leaves nothing.)
        code = ("import signal, sys; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
                f"sys.path[:0] = {[p for p in sys.path if p]!r}; "
                f"from paratrain.distributed.orphans import die_with_parent; die_with_parent({os.getpid()}); "
                f"from paratrain.training.save_process import serve; serve({theirs.fileno()}, {their_fds.fileno()})")
        # its own process group (Python 3.11+): a terminal's Ctrl-C and a launcher's signals to the rank's group
        # never reach it; the rank decides when a save in flight ends
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(), their_fds.fileno()),
                                        stdin=subprocess.DEVNULL, **group)
        theirs.close()  # ours closed: a read on the connection fails at once if the writer dies
        their_fds.close()
        self.sent: dict[int, torch.UntypedStorage] = {}  # storages it holds, by address (kept alive here: an
        # address is never reused while its storage is held)
        self.started = False  # it has said it is ready (its imports done: a second or more on a busy host)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ready(self, wait: bool = False) -> bool:
        """Whether it is ready to write (until then saves are written on the rank's thread); `wait`: until it is (or
        has died)."""
        try:
            if not self.started and self.conn.poll(None if wait else 0):
                self.started = self.conn.recv() == READY
        except (EOFError, OSError):  # it died starting: the next save starts another
            return False
        return self.started

    def write(self, files: list[tuple[str, str, list]], sync_files: bool) -> list:
        """files: (path, storage key, [(write item, bytes or tensor)]) -> DCP's write results of every item; the
        tensors must be views of shared-memory storages (the staging buffers)."""
        used, new, jobs = {}, [], []
        for path, key, items in files:
            entries = []
            for item, data in items:
                if isinstance(data, torch.Tensor):
                    data = self._describe(data, used, new)
                entries.append((item, data))
            jobs.append((path, key, entries))
        dropped = [k for k in self.sent if k not in used]
        for k in dropped:
            del self.sent[k]
        self.conn.send(([(key, size) for key, _, size in new], dropped, jobs, sync_files))
        for start in range(0, len(new), FDS_PER_MESSAGE):
            socket.send_fds(self.fds, [b"f"], [fd for _, fd, _ in new[start:start + FDS_PER_MESSAGE]])
        try:
            answer = self.conn.recv()  # (blocks in a read: the GIL is free for the training thread)
        except (EOFError, OSError):
            raise RuntimeError(f"the checkpoint writer process ended during the write (exit code "
                               f"{self.process.wait()})") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _describe(self, tensor: torch.Tensor, used: dict, new: list) -> tuple:
        storage = tensor.untyped_storage()
        fd, size = storage._share_fd_cpu_()  # (the stager's buffers are shared memory already: their descriptor)
        key = storage.data_ptr()
        used[key] = storage
        if key not in self.sent:
            self.sent[key] = storage
            new.append((key, fd, size))
        return key, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype

    def close(self) -> None:
        """Stop the writer (after the save in flight was waited for) and reap it; killed if it does not go (at once
        while it is still starting: it holds nothing yet)."""
        if self.alive and self.started:
            try:
                self.conn.send(STOP)
                self.process.wait(CLOSE_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive:
            self.process.kill()
        self.process.wait()
        self.conn.close()
        self.fds.close()
        self.sent.clear()


class StagedFileWriter(FileSystemWriter):
    """DCP's file writer with two additions: the fault injector's hooks around this rank's shards (tests: a write
    that is slow, or killed midway; on the thread that runs DCP's save), and, given a `WriterProcess`, the shard files
    written by it instead of on this thread."""

    def __init__(self, path, step: int, faults: FaultInjector | None = None, child: WriterProcess | None = None):
        super().__init__(str(path))
        self.step, self.faults, self.child = step, faults, child

    def write_data(self, plan, planner):
        if self.faults:
            self.faults.in_save_write(self.step, written=False)
        future = super().write_data(plan, planner)
        future.wait()
        if self.faults:
            self.faults.in_save_write(self.step, written=True)
        return future

    def _write_data(self, planner, file_queue):
        # (under injected faults the write waits for the process: what a test exercises never depends on how long
        # the process took to start)
        if self.child is None or not self.child.ready(wait=bool(self.faults)):
            return super()._write_data(planner, file_queue)
        files = []
        while not file_queue.empty():
            path, key, items = file_queue.get_nowait()
            # (DCP's order in a file: the byte items, then the tensors; the byte items are pickled here, small)
            ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            files.append((str(path), key, [(item, _resolved(planner, item)) for item in ordered]))
        done: Future = Future()
        done.set_result(self.child.write(files, self.sync_files))
        return done


def _resolved(planner, item):
    data = planner.resolve_data(item)
    return data.getvalue() if item.type == WriteItemType.BYTE_IO else data.detach()


# -- the writer process -------------------------------------------------------------------------

def serve(conn_fd: int, fds_fd: int) -> None:
    """The writer process's loop (started by WriterProcess, tied to it by `die_with_parent` first)."""
    conn, fds = Connection(conn_fd), socket.socket(fileno=fds_fd)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # the CPU the training rank leaves (a busy or shared host)
    except OSError:
        pass
    torch.set_num_threads(1)
    conn.send(READY)
    storages: dict[int, torch.UntypedStorage] = {}
    transforms = _StorageWriterTransforms(None)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the rank is gone
            message = STOP
        if message == STOP:  # (no interpreter teardown: seconds with torch loaded on a busy host, nothing to flush)
            os._exit(0)
        new, dropped, jobs, sync_files = message
        for key in dropped:
            storages.pop(key, None)
        for start in range(0, len(new), FDS_PER_MESSAGE):
            batch = new[start:start + FDS_PER_MESSAGE]
            _, received, _, _ = socket.recv_fds(fds, 1, len(batch))
            for (key, size), fd in zip(batch, received):
                storages[key] = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
                os.close(fd)  # (the storage holds its own mapping)
        try:
            answer = [result for job in jobs for result in _write_file(*job, storages, transforms, sync_files)]
        except Exception as e:  # noqa: BLE001 - sent to the rank, whose save raises it
            answer = e
        try:
            conn.send(answer)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            conn.send(RuntimeError(f"{type(answer).__name__}: {answer}"))


def _write_file(path: str, key: str, entries: list, storages: dict, transforms, sync_files: bool) -> list:
    """One shard file as DCP's FileSystemWriter writes it (the same bytes: DCP's own `_write_item`)."""
    results = []
    with open(path, "wb") as stream:
        for item, data in entries:
            data = io.BytesIO(data) if isinstance(data, bytes) else _tensor(storages, *data)
            results.append(_write_item(transforms, stream, data, item, key, SerializationFormat.TORCH_SAVE))
        if sync_files:
            os.fsync(stream.fileno())
    return results


def _tensor(storages: dict, key: int, offset: int, shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype).set_(storages[key], offset, shape, stride)
    if tensor.untyped_storage().size() != tensor.nbytes:  # (torch.save writes a view's whole storage: DCP's copy)
        tensor = tensor.clone()
    return tensor
