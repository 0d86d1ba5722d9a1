"""Every rank must train with the same resolved config: compare a digest at initialize().

One all-gather of a 32-byte digest when the configs agree (the usual case); when they do not,
the ranks exchange their resolved `key = value` listings so that every rank raises the same
error naming each differing key and which ranks hold which value. Imports config and comm only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.config.fields import show
from zeroshard.errors import ConfigError

_MAX_KEYS_SHOWN = 20
_RANK_LOCAL_KEYS = ("output_path", "nvme_path")
"""Keys that may rightly differ per rank or node: where a rank writes (monitors write on rank 0
only; a swap directory is node-local). They are left out of the comparison."""


def resolved_items(obj: Any, prefix: str = "") -> dict[str, str]:
    """Dotted key -> the resolved value as JSON spells it, for every key of a Config."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(obj):
        if not f.metadata.get("json_key", True):
            continue  # provenance, not a setting
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(resolved_items(value, f"{path}."))
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                out[f"{path}.{key}"] = show(value[key])
        else:
            out[path] = show(value)
    return out


def _all_gather_bytes(comm: Comm, payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order (two all-gathers: lengths, then padded bytes)."""
    world = comm.world_size
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = torch.empty(world, dtype=torch.int64)
    comm.all_gather(lengths, length)
    longest = int(lengths.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = torch.empty(world * longest, dtype=torch.uint8)
    comm.all_gather(every, mine)
    rows = every.view(world, longest)
    return [bytes(rows[r, : int(lengths[r])].tolist()) for r in range(world)]


_FIRST_LINE_KEYS = 3
"""Differing keys (with each rank's value) shown on the error's first line; all are listed below it."""


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def check_same_config(cfg: Config, comm: Comm) -> None:
    """Raise ConfigError on every rank when the ranks' resolved configs differ.

    Raises:
        ConfigError: naming each differing dotted key and the value each group of ranks has.
    """
    if comm.world_size == 1:
        return
    items = {k: v for k, v in resolved_items(cfg).items() if not k.endswith(_RANK_LOCAL_KEYS)}
    blob = json.dumps(items, sort_keys=True).encode()
    digest = hashlib.sha256(blob).digest()
    digests = _all_gather_bytes(comm, digest)
    if all(d == digests[0] for d in digests):
        return
    every = [json.loads(b) for b in _all_gather_bytes(comm, blob)]
    keys = sorted({k for items_r in every for k in items_r})
    lines = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for r, items_r in enumerate(every):
            by_value.setdefault(items_r.get(key, "(absent)"), []).append(r)
        if len(by_value) > 1:
            lines.append(f"  {key}: " + ", ".join(f"{_ranks(rs)} = {v}" for v, rs in by_value.items()))
    shown = lines[:_MAX_KEYS_SHOWN]
    if len(lines) > len(shown):
        shown.append(f"  ... and {len(lines) - len(shown)} more keys")
    groups: dict[bytes, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    # The keys go on the first line: torchrun's error summary shows only that one.
    head = [_cut(line.strip()) for line in lines[:_FIRST_LINE_KEYS]]
    more = f" (and {len(lines) - len(head)} more keys, below)" if len(lines) > len(head) else ""
    raise ConfigError(
        f"the ranks resolved different configs in {len(lines)} key(s): " + "; ".join(head) + more
        + " -- every rank must be given the same ds_config (the same file, or the same dict built the same way "
        "on every rank).\n" + f"{len(groups)} distinct configs: " + "; ".join(_ranks(rs) for rs in groups.values())
        + "; they differ in:\n" + "\n".join(shown))
