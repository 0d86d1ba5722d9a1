"""File names and crash-safe file operations of a checkpoint directory.

Every write goes to a temporary name, is flushed to disk (fsync) and renamed; directories are
fsynced after renames so the rename itself survives a power cut. `fault_point()` is called at
each of these operations: with ZEROSHARD_CHECKPOINT_FAULT_AT=k (optionally "k:rank") the
process SIGKILLs itself at the k-th one of a save, which is how tests/launch prove that a save
interrupted anywhere leaves the previous checkpoint loadable. Imports only errors.
"""

from __future__ import annotations

import os
import signal
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from zeroshard.errors import CheckpointError

LATEST = "latest"
MANIFEST = "zeroshard_manifest.json"
MODEL_FILE = "mp_rank_00_model_states.pt"
TMP_SUFFIX = ".tmp"
WRITER_TOKEN = ".writer"
"""In a staging directory: the token of the rank that prepared it (node-local storage tells a
shared file system from node-local disks by it; removed before the manifest is written)."""
FAULT_ENV = "ZEROSHARD_CHECKPOINT_FAULT_AT"


_TAG_SHOWN = 60
"""How many bytes of a bad `latest` file its error shows."""


def read_latest_tag(path: Path) -> str:
    """The tag `latest` file `path` names (DeepSpeed's and zeroshard's: the tag, UTF-8, one line).

    Raises:
        CheckpointError: the file does not hold a tag (garbage, binary, empty, a path), naming
            the file, what it holds (truncated, repr) and what a tag looks like.
    """
    raw = path.read_bytes()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if (tag is None or not tag or "/" in tag or tag in (".", "..") or len(tag) > 255
            or any(not c.isprintable() for c in tag)):
        shown = repr(raw[:_TAG_SHOWN]) + (f"... ({len(raw)} bytes)" if len(raw) > _TAG_SHOWN else "")
        raise CheckpointError(
            f"{path}: does not hold a tag name (it holds {shown}); `latest` must hold one checkpoint "
            f"directory name of {path.parent}, such as 'global_step1000', as save_checkpoint writes it. "
            "Write the tag to load into it, or pass tag= to load_checkpoint")
    return tag


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def pieces_file(rank: int) -> str:
    """Stage 3: this rank's low-precision parameter pieces (DeepSpeed's stage-3 model file)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pth"


def staging_dir(save_dir: Path, tag: str) -> Path:
    """Where a save of `tag` is written before it is published by one rename."""
    return save_dir / f".{tag}.partial"


def retired_dir(save_dir: Path, tag: str) -> Path:
    """Where the previous checkpoint of the same tag waits while the new one is renamed in."""
    return save_dir / f".{tag}.old"


# -- fault injection ------------------------------------------------------------------------

_events: list[str] = []
_rank = 0


def begin_save(rank: int) -> None:
    """Reset the event list; a save's events are numbered from 1."""
    global _rank
    _events.clear()
    _rank = rank


def events() -> list[str]:
    """The file events of the current (or last) save on this rank, in order ("write", ...)."""
    return list(_events)


def fault_point(what: str) -> None:
    _events.append(what)
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    at, _, rank = spec.partition(":")
    if (not rank or int(rank) == _rank) and int(at) == len(_events):
        os.kill(os.getpid(), signal.SIGKILL)


# -- writing --------------------------------------------------------------------------------


CHECKSUM = "crc32"
"""The checksum the manifest records per file (zlib.crc32: GB/s, computed while writing)."""

_CHUNK_BYTES = 1 << 22
"""Read size when a file's checksum is computed from disk (verify, or a writer that seeked)."""


def format_checksum(crc: int) -> str:
    return f"{CHECKSUM}:{crc & 0xFFFFFFFF:08x}"


def file_checksum(path: Path) -> str:
    """The checksum of the file at `path`, as the manifest records it (`crc32:<8 hex digits>`)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return format_checksum(crc)


class _CountingWriter:
    """A binary file whose every write is a fault point (torch.save writes record by record).

    It also keeps the crc32 of what was written, while the bytes are still in the CPU's cache:
    valid as long as the writes were sequential (`sequential`); a writer that seeks back is
    checksummed from the file instead (`write_atomic`)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.crc = 0
        self.sequential = True
        self._end = 0

    def write(self, data: Any) -> int:
        if self._f.tell() != self._end:
            self.sequential = False
        n = self._f.write(data)
        if self.sequential:
            self.crc = zlib.crc32(data, self.crc)
            self._end += n
        fault_point("write")
        return n

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, *args: Any) -> int:
        return self._f.seek(*args)

    def seekable(self) -> bool:
        return True


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fault_point("fsync dir")


def write_atomic(path: Path, write: Callable[[Any], None], *, per_process_tmp: bool = False) -> int:
    """`write(file)` to `path + .tmp`, fsync, rename to `path`; returns the size in bytes.
    The caller fsyncs the directory once after its renames. `per_process_tmp`: the temporary
    name carries the process id (`path.<pid>.tmp`), for files several ranks may write at once
    (each rename then publishes a whole file; the last one stays)."""
    return _write_atomic(path, write, per_process_tmp=per_process_tmp)[0]


def _write_atomic(path: Path, write: Callable[[Any], None], *, per_process_tmp: bool = False) -> tuple[int, str]:
    suffix = f".{os.getpid()}{TMP_SUFFIX}" if per_process_tmp else TMP_SUFFIX
    tmp = path.with_name(path.name + suffix)
    with open(tmp, "wb") as f:
        fault_point("open")
        writer = _CountingWriter(f)
        write(writer)
        f.flush()
        os.fsync(f.fileno())
        fault_point("fsync")
    size = tmp.stat().st_size
    checksum = (format_checksum(writer.crc) if writer.sequential and writer._end == size
                else file_checksum(tmp))
    os.replace(tmp, path)
    fault_point("rename")
    return size, checksum


def save_torch(path: Path, obj: Any) -> int:
    return write_atomic(path, lambda f: torch.save(obj, f))


def save_torch_checked(path: Path, obj: Any) -> tuple[int, str]:
    """`save_torch`, also returning the file's checksum (`crc32:<8 hex digits>`)."""
    return _write_atomic(path, lambda f: torch.save(obj, f))


def write_text_atomic(path: Path, text: str) -> int:
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


# -- reading --------------------------------------------------------------------------------


def load_torch(path: Path, *, expected_bytes: int | None, mmap: bool = True) -> Any:
    """torch.load with weights_only=True (no code runs), memory-mapped; every failure is a
    CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint's manifest lists it)")
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected_bytes}: the file is "
                              "truncated or was replaced after the save")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many types for a corrupt zip/pickle
        raise CheckpointError(f"{path}: not a readable zeroshard checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
