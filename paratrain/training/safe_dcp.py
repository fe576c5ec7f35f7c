"""Reading DCP checkpoints without running code from them.

A DCP checkpoint's `.metadata` is a pickle, and torch's `FileSystemReader` unpickles it with `pickle.load`: a
checkpoint folder from elsewhere could run any code the moment it is opened (a matching `CHECKSUMS` only proves the
file is unchanged since it was hashed, not that it is safe). Its non-tensor entries (the optimizer's param groups)
are pickles too, which torch's `DefaultLoadPlanner` reads with `torch.load(weights_only=False)`.

Here the metadata is read by an allow-list unpickler that resolves only the classes DCP's metadata is made of
(the dataclasses of `torch.distributed.checkpoint.metadata`, the file reader's `_StorageInfo`, `torch.Size`, torch
dtypes and layouts, paths) and refuses every other global, so no constructor or function of the file's choosing is
ever called; the result is then checked field by field (types, offsets, lengths, file names inside the folder).
Non-tensor entries are loaded with `torch.load(weights_only=True)`. Every paratrain path that opens a checkpoint
(resume, rollback, generate, export, checkpoint verify) goes through `reader` / `load` / `read_metadata` below.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath, PosixPath, WindowsPath

import torch
from torch.distributed.checkpoint import filesystem, metadata as dcp_metadata
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from paratrain.errors import translated

METADATA_FILE = ".metadata"
_MAX_METADATA_BYTES = 1 << 30  # a real one is a few hundred bytes per tensor

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
}
_PATHS = {("pathlib", c.__name__): c for c in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)}


def _layout_by_name(name):
    """torch.serialization._get_layout, restated: a lookup, nothing else."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layouts[name]


def _storage_info_class():
    return getattr(filesystem, "_StorageInfo")


class UnsafePickle(Exception):
    """The metadata asked for a global outside the allow-list."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _METADATA_CLASSES.get((module, name)) or _PATHS.get((module, name))
        if found is not None:
            return found
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _storage_info_class()
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise UnsafePickle(f"{module}.{name}")

    def persistent_load(self, pid):
        raise UnsafePickle("a persistent id")


class MetadataProblem(Exception):
    """Why a checkpoint's DCP metadata cannot be used: one line, naming the field."""


def _check_metadata(md, folder: Path) -> None:
    """Every field DCP will use: types, non-negative offsets and lengths, shard files inside the folder."""
    M = dcp_metadata
    if not isinstance(md, M.Metadata):
        raise MetadataProblem(f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise MetadataProblem("state_dict_metadata is not a mapping")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise MetadataProblem(f"state_dict_metadata has a key of type {type(key).__name__}")
        if isinstance(entry, M.BytesStorageMetadata):
            continue
        if not isinstance(entry, M.TensorStorageMetadata):
            raise MetadataProblem(f"entry {key} is a {type(entry).__name__}")
        if not isinstance(entry.properties, M.TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
            raise MetadataProblem(f"entry {key}: properties.dtype is not a torch dtype")
        size = entry.size
        if not isinstance(size, torch.Size) or any(not isinstance(s, int) or s < 0 for s in size):
            raise MetadataProblem(f"entry {key}: size {size!r} is not a shape")
        if not isinstance(entry.chunks, list):
            raise MetadataProblem(f"entry {key}: chunks is not a list")
        for chunk in entry.chunks:
            if not isinstance(chunk, M.ChunkStorageMetadata) or len(chunk.offsets) != len(size) \
                    or len(chunk.sizes) != len(size) \
                    or any(not isinstance(o, int) or not isinstance(n, int) or o < 0 or n < 0 or o + n > s
                           for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
                raise MetadataProblem(f"entry {key}: a chunk lies outside its shape {list(size)}")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise MetadataProblem("storage_data is not a mapping")
    info_class = _storage_info_class()
    for index, info in storage.items():
        if not isinstance(index, M.MetadataIndex) or not isinstance(info, info_class):
            raise MetadataProblem("storage_data holds an entry that is not a (MetadataIndex, _StorageInfo) pair")
        name = info.relative_path
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
                or "\0" in name or name == METADATA_FILE:
            raise MetadataProblem(f"storage_data names the file {name!r}, which is not a shard in the folder")
        for field in ("offset", "length"):
            value = getattr(info, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MetadataProblem(f"storage_data for {index.fqn}: {field} {value!r} is not a byte count")
        if info.transform_descriptors not in (None, [], ()):
            raise MetadataProblem(f"storage_data for {index.fqn}: transform_descriptors are not supported")


def read_metadata(folder: str | Path):
    """The checkpoint's DCP Metadata, unpickled with the allow-list and checked; MetadataProblem (one line) when it
    cannot be used, OSError when it cannot be read."""
    folder = Path(folder)
    path = folder / METADATA_FILE
    with open(path, "rb") as f:
        data = f.read(_MAX_METADATA_BYTES + 1)
    if len(data) > _MAX_METADATA_BYTES:
        raise MetadataProblem(f"{METADATA_FILE} is larger than {_MAX_METADATA_BYTES >> 20} MiB")
    try:
        md = _AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafePickle as e:
        raise MetadataProblem(f"{METADATA_FILE} asks to load {e}, which DCP metadata never holds (refused: "
                              "loading it could run code)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle
        raise MetadataProblem(f"{METADATA_FILE} is not readable DCP metadata ({type(e).__name__})") from None
    try:
        _check_metadata(md, folder)
    except MetadataProblem as e:
        text = str(e)
        raise MetadataProblem(f"{METADATA_FILE}{'' if text.startswith('holds') else ':'} {text}") from None
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = dcp_metadata.StorageMeta()
    return md


class SafeReader(dcp.FileSystemReader):
    """torch's FileSystemReader with the allow-list metadata reader (parsed once per reader)."""

    _metadata = None

    def read_metadata(self, *args, rank=None):  # no **kwargs: DCP then never falls back to a rank's own file
        if self._metadata is None:
            md = read_metadata(Path(self.path))
            md.storage_meta.load_id = self.load_id
            self._metadata = md
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise MetadataProblem(f"the entry {read_item.dest_index.fqn} is a pickle that is not plain data "
                                  f"(refused: loading it could run code; {str(e).splitlines()[0][:120]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def reader(folder: str | Path) -> SafeReader:
    return SafeReader(str(folder))


def load(state: dict, folder: str | Path, storage_reader: SafeReader | None = None, **kw) -> None:
    """dcp.load with the safe reader and planner. The metadata is read (and refused) here, before DCP: DCP logs a
    traceback for metadata it cannot read."""
    storage_reader = storage_reader or reader(folder)
    storage_reader.read_metadata()
    with translated(refused_entry):  # DCP's CheckpointException wraps what a rank raised: the refusal is the line
        dcp.load(state, storage_reader=storage_reader, planner=SafeLoadPlanner(), **kw)


def refused_entry(error: BaseException) -> MetadataProblem | None:
    """The MetadataProblem inside an error DCP raised (it wraps each rank's exception), or None."""
    if isinstance(error, MetadataProblem):
        return error
    for exc, _ in (getattr(error, "failures", None) or {}).values():
        if isinstance(exc, MetadataProblem):
            return exc
    return None


_MAX_BYTES_ENTRY = 16 << 20  # a non-tensor entry (an optimizer's param group value) is a few hundred bytes


def check_byte_entries(folder: str | Path, md=None) -> None:
    """Every non-tensor entry of the checkpoint loads as plain data (weights_only=True): a pickle in a shard that
    asks for anything else is refused here, before a run launches, as the metadata is."""
    folder = Path(folder)
    md = md or read_metadata(folder)
    wanted = {fqn for fqn, entry in md.state_dict_metadata.items()
              if isinstance(entry, dcp_metadata.BytesStorageMetadata)}
    for index, info in md.storage_data.items():
        if index.fqn not in wanted:
            continue
        if info.length > _MAX_BYTES_ENTRY:
            raise MetadataProblem(f"the entry {index.fqn} is {info.length} bytes, more than a non-tensor entry holds")
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise MetadataProblem(f"the entry {index.fqn} in {info.relative_path} is a pickle that is not plain data "
                                  f"(refused: loading it could run code; {str(e).splitlines()[0][:100]})") from None
        except Exception as e:  # noqa: BLE001 - garbled bytes
            raise MetadataProblem(f"the entry {index.fqn} in {info.relative_path} is unreadable "
                                  f"({type(e).__name__})") from None
