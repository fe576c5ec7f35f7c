"""Reading a Hugging Face folder's safetensors without loading it: the index and the file headers name every
tensor with its file, shape and dtype, and `Reader.read` returns just the rows and columns asked for
(`safe_open(...).get_slice`), so a rank reads only its shard of each parameter."""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple
    dtype: str  # safetensors' name: F32, BF16, ...


# Every dtype a safetensors header may name, with its size in bytes (safetensors' own list).
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, every entry checked: its dtype, its shape, and its data_offsets against
    the shape, the file's size and the other entries; a one-line UserError naming the file and the tensor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"truncated shard {path} ({size} bytes, not a safetensors file)")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            raise UserError(f"truncated shard {path} ({size} bytes; its header alone needs {8 + n})")
        if n > MAX_HEADER_BYTES:
            raise UserError(f"{path}: a header of {n} bytes is larger than safetensors allows ({MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{path} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a safetensors file (unreadable header)")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise UserError(f"{where}: an entry has dtype, shape and data_offsets only")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise UserError(f"{where} has dtype {dtype!r}, not a safetensors dtype")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise UserError(f"{where}: shape {shape!r} is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
                or offsets[0] > offsets[1]:
            raise UserError(f"{where}: data_offsets {offsets!r} is not [start, end] with start <= end")
        need = ITEMSIZE[dtype]
        for d in shape:
            need *= d
        if offsets[1] - offsets[0] != need:
            raise UserError(f"{where}: shape {shape} of {dtype} needs {need} bytes, data_offsets {offsets} hold "
                            f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise UserError(f"{path}: the data of tensors {a} and {b} overlap (bytes {b0} to {min(a1, b1)})")
    end = spans[-1][1] if spans else 0
    if 8 + n + end > size:
        raise UserError(f"truncated shard {path} ({size} of {8 + n + end} bytes)")
    return header


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class HFWeights:
    """The tensors of a Hugging Face model folder, from `model.safetensors.index.json` (or every
    `*.safetensors` file when there is no index), checked against the file headers."""

    def __init__(self, folder: str | Path):
        self.folder = folder = Path(folder)
        index = folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                bad = next((n for n in weight_map.values() if not isinstance(n, str) or "/" in n or "\\" in n
                            or n in (".", "..")), None) if isinstance(weight_map, dict) else None
                if bad is not None:
                    raise UserError(f"{index}: weight_map names {bad!r}, which is not a file of the folder")
                files = sorted({folder / name for name in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError):
                raise UserError(f"{index} is not a valid safetensors index (no weight_map)") from None
            for f in files:
                if not f.is_file():
                    raise UserError(f"{index} names {f.name}, which is missing")
        else:
            weight_map = None
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"{folder} has no *.safetensors weights (only safetensors are read; convert "
                                ".bin/.pt weights first)")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise UserError(f"tensor {name} appears in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = TensorInfo(f, tuple(info["shape"]), info["dtype"])
        if weight_map is not None:
            for name, file in weight_map.items():
                found = self.tensors.get(name)
                if found is None or found.file.name != Path(file).name:
                    raise UserError(f"{index} places {name} in {file}, but that file does not hold it")

    def check(self, expected: dict[str, tuple], ignore: tuple = (), optional: tuple = ()) -> None:
        """Every expected tensor present with its shape and a float dtype, nothing else (but names ending in
        `ignore`, and the `optional` ones); else a one-line UserError naming the first problem."""
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is None:
                raise UserError(f"{self.folder}: tensor {name} is missing")
            if info.shape != tuple(shape):
                raise UserError(f"{self.folder}: {name} has shape {list(info.shape)} in {info.file.name}, but "
                                f"config.json implies {list(shape)}")
            if info.dtype not in DTYPES:
                raise UserError(f"{self.folder}: {name} is stored as {info.dtype}; only float weights "
                                f"({', '.join(DTYPES)}) are supported")
        extra = [n for n in self.tensors if n not in expected and not n.endswith(ignore) and n not in optional]
        if extra:
            raise UserError(f"{self.folder}: unexpected tensor {extra[0]}"
                            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                            + ": the weights describe an architecture paratrain cannot represent")

    @contextlib.contextmanager
    def reader(self):
        with contextlib.ExitStack() as stack:
            yield Reader(self, stack)


class Reader:
    """Open files, read parts of tensors."""

    def __init__(self, weights: HFWeights, stack: contextlib.ExitStack):
        self.weights, self.stack, self.handles = weights, stack, {}

    def _handle(self, file: Path):
        if file not in self.handles:
            from safetensors import safe_open

            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return self.handles[file]

    def read(self, name: str, index: list[torch.Tensor]) -> torch.Tensor:
        """tensor[index[0], index[1], ...] (one sorted index tensor per dimension), reading only the block
        that covers those indices."""
        info = self.weights.tensors[name]
        piece = self._handle(info.file).get_slice(name)
        lo = [int(i[0]) for i in index]
        block = piece[tuple(slice(a, int(i[-1]) + 1) for a, i in zip(lo, index))]
        for d, (a, i) in enumerate(zip(lo, index)):
            if block.shape[d] != len(i):  # not one contiguous run: keep the rows asked for
                block = block.index_select(d, i - a)
        return block
