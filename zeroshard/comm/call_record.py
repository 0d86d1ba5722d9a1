"""One collective as this rank issued it: its fingerprint, its call site, and the dict a report
prints. Imports nothing of ours."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_PKG_DIR = os.path.dirname(_COMM_DIR)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@functools.lru_cache(maxsize=4096)
def signature(op: str, numel: int, dtype: torch.dtype | None) -> int:
    """A 62-bit fingerprint of one collective: what every rank must agree on (cached: a
    training step repeats the same few collectives)."""
    digest = hashlib.blake2b(f"{op}|{numel}|{dtype}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass(slots=True)
class CallRecord:
    """One collective as issued by this rank (formatted only when a report needs it)."""

    seq: int
    op: str
    numel: int
    dtype: torch.dtype | None
    site: tuple[str, int, str | None, int]
    """(file, line) of the first caller outside comm/, and of the first outside zeroshard/torch."""
    issued_at: float
    api: str = ""
    """The API the script called it through ("torch.distributed", "deepspeed.comm"); empty for
    zeroshard's own (Note: [script collectives] in user_collectives.py)."""

    @property
    def checked_op(self) -> str:
        """What the signature check compares besides size and dtype: the operation, and whether
        the script issued it, so that the script's collective never agrees with one of
        zeroshard's, however alike (Note: [script collectives] in user_collectives.py)."""
        return f"script:{self.op}" if self.api else self.op


def call_site() -> tuple[str, int, str | None, int]:
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_COMM_DIR):
        frame = frame.f_back
    inner_file, inner_line = frame.f_code.co_filename, frame.f_lineno
    outer: Any = frame
    while outer is not None and outer.f_code.co_filename.startswith((_PKG_DIR, _TORCH_DIR)):
        outer = outer.f_back
    if outer is None or outer is frame:
        return inner_file, inner_line, None, 0
    return inner_file, inner_line, outer.f_code.co_filename, outer.f_lineno


def record_dict(rec: CallRecord) -> dict[str, Any]:
    inner_file, inner_line, outer_file, outer_line = rec.site
    where = f"{os.path.basename(inner_file)}:{inner_line}"
    if outer_file is not None:
        where += f" via {os.path.basename(outer_file)}:{outer_line}"
    out: dict[str, Any] = {"seq": rec.seq, "op": f"{rec.api}.{rec.op}" if rec.api else rec.op,
                           "numel": rec.numel, "where": where,
                           "dtype": None if rec.dtype is None else str(rec.dtype).replace("torch.", "")}
    if rec.api:
        out["api"] = rec.api
    return out
