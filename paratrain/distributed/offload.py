"""Activation offloading: the tensors a block saves for backward move to host memory during its forward and come
back for its backward (`memory.activation_offload`; which blocks: paratrain/memory.py).

Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) around each chosen block's forward: `pack` copies a
saved tensor into a host buffer and autograd keeps only that; `unpack` brings the block's tensors back when its
backward first needs one, and prefetches the block below it (the one whose backward comes next), so the copies of
one block overlap the backward of another. On CUDA the host buffers are pinned and the copies run on a side stream
(`record_stream` keeps a device tensor's memory until its copy is done); on a CPU the host is the device, and the
copies are plain copies on the same path.

Kept on the device, never copied: parameters and buffers (a matmul saves its weight; the rotary tables are views of
the model's buffers), autocast's low-precision copies of weights (the autocast cache holds them anyway), tensors below
`MIN_OFFLOAD_BYTES` (a copy costs more than it saves). A storage saved twice in one block (or two views of it) is
copied once.

With activation checkpointing inside the block (the checkpoint wrapper is applied first), what the checkpoint keeps
for its recomputation goes through the hooks: full checkpointing offloads the block's inputs; selective
checkpointing's cached matmul outputs live in torch's checkpoint cache, not in saved tensors, and stay on the device.
"""

from __future__ import annotations

import weakref

from torch import nn
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from paratrain.memory import MIN_OFFLOAD_BYTES


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding t's data: a DTensor's local shard, the result of an asynchronous collective (sequence
    parallelism's all-gathers), or t."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _is_weight_copy(t: torch.Tensor) -> bool:
    """Autocast's cast of a parameter (a ToCopy of a leaf that requires grad)."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


class _Copy:
    """One offloaded storage: its host copy, later its copy back on the device. Every saved view of the storage is
    rebuilt from it (a block saves the same tensor several times, and views of one: q/k/v each save their own view of
    the normed input), so each storage crosses the bus once each way."""

    __slots__ = ("host", "back", "device", "group", "version", "uses", "__weakref__")

    def __init__(self, host, device, group, version):
        self.host, self.back, self.device, self.group, self.version = host, None, device, group, version
        self.uses = 0  # saved views not yet unpacked


class _View:
    """What autograd keeps of one saved tensor: its storage's copy and where in it the tensor lies."""

    __slots__ = ("copy", "offset", "shape", "stride", "spec")

    def __init__(self, copy, local, spec):
        self.copy, self.offset, self.shape, self.stride, self.spec = (copy, local.storage_offset(), local.shape,
                                                                      local.stride(), spec)


class _Group:
    """One offloaded forward of one block: its copies (weakly: autograd owns them) and what it must keep."""

    def __init__(self, block: int, kept: set[int]):
        self.block, self.kept = block, kept
        self.copies: list[weakref.ref] = []
        self.by_storage = WeakIdKeyDictionary()  # storage -> {dtype: _Copy}
        self.fetched = False


class ActivationOffloader:
    """The hooks of one model (or pipeline stage) and the order its offloaded blocks ran forward in. `stride`: the
    block index difference between consecutive offloaded blocks (1, or every_k), to find the block to prefetch."""

    def __init__(self, root: nn.Module, device: torch.device, stride: int = 1):
        self.root, self.device, self.stride = root, device, stride
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.groups: list[_Group] = []  # offloaded forwards not yet fetched back, in forward order
        self.current: _Group | None = None

    # -- forward -------------------------------------------------------------------------------
    def begin(self, block: int, module: nn.Module) -> None:
        """A block's forward starts: what it may save without copying is its own (unsharded) parameters and the
        model's buffers."""
        self.groups = [g for g in self.groups if not g.fetched and any(c() is not None for c in g.copies)]
        kept = {_local(t).untyped_storage().data_ptr() for t in (*module.parameters(), *self.root.buffers())}
        self.current = _Group(block, kept)
        self.groups.append(self.current)

    def end(self) -> None:
        self.current = None

    def pack(self, t: torch.Tensor):
        group, local = self.current, _local(t)
        if (group is None or isinstance(t, nn.Parameter) or local.device.type != self.device.type
                or local.numel() * local.element_size() < MIN_OFFLOAD_BYTES
                or local.untyped_storage().data_ptr() in group.kept or _is_weight_copy(t)):
            return t
        storage = local.untyped_storage()
        copies = group.by_storage.setdefault(storage, {})
        copy = copies.get(local.dtype)
        if copy is None or copy.version != local._version:  # (changed in place since: copied again)
            whole = torch.empty(0, dtype=local.dtype, device=local.device).set_(storage)
            copy = copies[local.dtype] = _Copy(self._to_host(whole), local.device, group, local._version)
            group.copies.append(weakref.ref(copy))
        copy.uses += 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if hasattr(t, "device_mesh") else None  # DTensor
        return _View(copy, local, spec)

    def _to_host(self, whole: torch.Tensor) -> torch.Tensor:
        host = torch.empty(whole.shape, dtype=whole.dtype, device="cpu", pin_memory=self.cuda)
        if not self.cuda:
            return host.copy_(whole)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is computed
        with torch.cuda.stream(self.stream):
            host.copy_(whole, non_blocking=True)
        whole.record_stream(self.stream)  # its memory is reused only after the copy
        return host

    # -- backward ------------------------------------------------------------------------------
    def unpack(self, packed):
        if not isinstance(packed, _View):
            return packed
        copy = packed.copy
        if copy.back is None:
            self._fetch(copy.group)
            below = self._below(copy.group)
            if below is not None:
                self._fetch(below)  # its backward comes next: its copies overlap this block's backward
        base = copy.back
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            base.record_stream(torch.cuda.current_stream(self.device))
        copy.uses -= 1
        if copy.uses == 0:
            copy.back = None  # the device copy lives as long as the backward that reads it
        local = base.as_strided(packed.shape, packed.stride, packed.offset)
        if packed.spec is None:
            return local

        mesh, placements, shape, stride = packed.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _below(self, group: _Group) -> _Group | None:
        """The offloaded forward just before `group`'s in the same pass (the block `stride` below it)."""
        if group not in self.groups:
            return None
        index = self.groups.index(group)
        before = self.groups[index - 1] if index > 0 else None
        return before if before is not None and before.block == group.block - self.stride else None

    def _fetch(self, group: _Group) -> None:
        if group.fetched:
            return
        group.fetched = True
        for ref in group.copies:
            copy = ref()
            if copy is None or copy.host is None:
                continue
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    copy.back = copy.host.to(copy.device, non_blocking=True)
            else:
                copy.back = torch.empty_like(copy.host, device=copy.device).copy_(copy.host)
            copy.host = None


class OffloadedBlock(ActivationWrapper):
    """A block whose forward runs under its model's offloading hooks. (torch's ActivationWrapper: its wrapped module's
    parameter names lose the wrapper's prefix in state dicts, as under activation checkpointing.)"""

    def __init__(self, module: nn.Module, offloader: ActivationOffloader, index: int):
        super().__init__(module)
        self._offloader, self._index = offloader, index

    def forward(self, *args, **kwargs):
        off = self._offloader
        off.begin(self._index, self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
                return self._checkpoint_wrapped_module(*args, **kwargs)
        finally:
            off.end()


def apply_activation_offload(model: nn.Module, blocks: list[int], device: torch.device, stride: int) -> None:
    """Wrap the blocks of `model` (a model or a pipeline stage) whose index is in `blocks`."""
    if not blocks:
        return
    offloader = ActivationOffloader(model, device, stride)
    for key, block in list(model.layers.items()):
        if int(key) in blocks:
            model.layers[key] = OffloadedBlock(block, offloader, int(key))
