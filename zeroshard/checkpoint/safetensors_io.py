"""A streaming writer (and a small reader) for the safetensors format, no dependency needed.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw little-endian bytes. Knowing every shape up front (from the
manifest), the writer emits the header first and then each tensor as soon as it is assembled,
so consolidating a checkpoint never holds more than one tensor of the output in memory. The
files load with `safetensors.torch.load_file` and with transformers' `from_pretrained`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor

from zeroshard.errors import CheckpointError

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {v: k for k, v in _CODES.items()}


class SafetensorsWriter:
    """Write tensors in the declared order: `writer.write(name, tensor)` for each `entries`.

    Written to `path.tmp` and renamed on `close()`; an exception leaves no file at `path`.
    """

    def __init__(self, path: str | os.PathLike[str], entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        self._path = Path(path)
        self._tmp = self._path.with_name(self._path.name + ".tmp")
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        self._order: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        for name, shape, dtype in entries:
            if dtype not in _CODES:
                raise CheckpointError(f"safetensors cannot hold {dtype} ({name})")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, tuple(shape), dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data start
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: Tensor) -> None:
        want, shape, dtype, nbytes = self._order[self._next]
        if name != want or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise AssertionError(f"expected {want} {shape} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise AssertionError(f"expected {nbytes} bytes for {name}, got {data.nbytes}")
        self._f.write(data.data)  # the array's buffer: no copy
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._f.close()
            self._tmp.unlink(missing_ok=True)
            raise AssertionError(f"expected {len(self._order)} tensors, {self._next} written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self._path)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()
            self._tmp.unlink(missing_ok=True)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a safetensors file (for tests and small files; not streaming)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        body = f.read()
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        start, end = spec["data_offsets"]
        dtype = _DTYPES[spec["dtype"]]
        buf = bytearray(body[start:end])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(spec["shape"]).clone()
    return out
