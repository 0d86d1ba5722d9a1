"""Every rank raises together: the one primitive the checkpoint writer and readers and the pipeline's
failure vote share.

A step that can fail on some ranks only (a disk full on one node, a stage whose loss raised)
must not leave the others waiting in the next collective: each rank contributes its outcome
(None, or the first bytes of its error's message) and a small integer of its own (the pipeline's
input-shape fingerprint), one `all_gather` of fixed-size rows hands every rank all of them, and
each caller raises its own error type naming every failed rank and its cause, on every rank.

Imports comm.collectives (for types) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroshard.comm.collectives import Comm

MESSAGE_BYTES = 2000
"""A failing rank's message is cut to this many bytes (UTF-8) before it is gathered."""
_HEADER = 8  # byte 0: failed; bytes 1-7: the rank's key, little-endian


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer: its failure (None: it succeeded) and the key it contributed."""

    error: str | None
    key: int = 0


def exchange_outcomes(comm: Comm, error: str | None, key: int = 0) -> list[RankOutcome]:
    """Every rank's outcome, in rank order, on every rank (collective: one all_gather over `comm`).

    >>> from zeroshard.comm import Comm, init_distributed
    >>> exchange_outcomes(Comm(init_distributed()), "disk full", key=7)  # one rank, no process group
    [RankOutcome(error='disk full', key=7)]
    """
    if not 0 <= key < 1 << 56:
        raise ValueError(f"key {key} does not fit in 7 bytes")
    mine = torch.zeros(_HEADER + MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        text = error.encode("utf-8", "replace")[:MESSAGE_BYTES]
        mine[0] = 1
        mine[_HEADER:_HEADER + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    mine[1:_HEADER] = torch.tensor(list(key.to_bytes(7, "little")), dtype=torch.uint8)
    device = comm.groups.device
    everyone = torch.zeros(comm.world_size * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(everyone, mine.to(device))
    out = []
    for row in everyone.view(comm.world_size, -1).cpu():
        text = bytes(row[_HEADER:].tolist()).rstrip(b"\0").decode("utf-8", "replace") if row[0] else None
        out.append(RankOutcome(text, int.from_bytes(bytes(row[1:_HEADER].tolist()), "little")))
    return out


def failures(outcomes: list[RankOutcome]) -> list[tuple[int, str]]:
    """(rank, message) of every rank that failed."""
    return [(r, o.error) for r, o in enumerate(outcomes) if o.error is not None]


def raise_together(comm: Comm, error: str | None, what: str, error_type: type[Exception]) -> None:
    """Return on every rank when no rank failed `what`; otherwise raise `error_type` on every rank,
    naming each failed rank and its cause (rank 0's log, the one a multi-node user reads, included).
    """
    failed = failures(exchange_outcomes(comm, error))
    if not failed:
        return
    if failed == [(comm.rank, error)]:
        raise error_type(f"rank {comm.rank}: {what} failed: {error}")
    causes = "\n".join(f"  rank {r}: {message}" for r, message in failed)
    raise error_type(f"rank {comm.rank}: {what} failed on rank(s) {[r for r, _ in failed]}:\n{causes}")
