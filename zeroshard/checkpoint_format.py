"""The checkpoint format: `Manifest`, `TensorInfo`, `FORMAT_VERSION`, and the per-rank state
records the engine and the checkpointer exchange (`EngineState`, `LoadedState`), and where a
tensor-parallel piece's elements sit in the whole parameter (`global_segments`: the TP checkpointer
saves by it, checkpoint/ds_autotp.py reads DeepSpeed's AutoTP pieces by it).

One home that the runtime (which fills them), `checkpoint/` (which writes and reads them) and
the offline tools (`to-fp32`, resharding) all import without pulling in the runtime, and the
`Checkpointer` protocol every checkpointer (checkpoint/, tensor_parallel/checkpoint.py) implements and the
engine saves through. Imports
only torch; see docs/checkpoints.md for the files on disk and Note: [checkpoint fragments] in
runtime/checkpoint_state.py for what a fragment is.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

FORMAT_VERSION = 1
"""Version of the on-disk format (docs/checkpoints.md); bumped on incompatible changes."""

Range = tuple[int, int, int]
"""(param index into Manifest.params, offset in the flattened parameter, numel)."""

Segment = tuple[int, int, int]
"""(offset in the global flattened parameter, numel, offset from the start of the local range)."""


def global_segments(dim: int, shape: tuple[int, ...], tp: int, rank: int, offset: int, numel: int) -> list[Segment]:
    """The global ranges holding elements [offset, offset + numel) of rank `rank`'s piece of a
    parameter of global `shape` split along `dim` over `tp` ranks.

    >>> global_segments(1, (2, 4), 2, 1, 0, 4)  # rank 1's columns 2-3 of a 2 x 4 weight
    [(2, 2, 0), (6, 2, 2)]
    """
    if dim == 0:
        local_numel = shape[0] // tp
        for s in shape[1:]:
            local_numel *= s
        return [(rank * local_numel + offset, numel, 0)]
    if dim != 1 or len(shape) != 2:
        raise AssertionError(f"expected a column split or a row split of a matrix, got dim {dim} of {shape}")
    width, local = shape[1], shape[1] // tp
    out, k, end = [], offset, offset + numel
    while k < end:
        row, col = divmod(k, local)
        n = min(local - col, end - k)
        out.append((row * width + rank * local + col, n, k - offset))
        k += n
    return out


BANKS = ":banks"
"""Suffix of a manifest `expert_parallel` key naming Hugging Face expert banks (AutoEP,
moe/hf_experts.py) rather than DeepSpeed MoE layers (a bank's experts are rows of one tensor:
`Manifest.expert_banks` names them)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Name, shape and dtype of a parameter or buffer; `trainable`: requires_grad."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype without the "torch." prefix ("float32", "bfloat16")."""
    trainable: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Manifest:
    """The layout of one checkpoint: which parameter fragments each rank owns, and more.

    `collect_state` fills the entries of its own rank; the checkpointer gathers every rank's
    before writing (`fragments[r]`, `weight_pieces[r]`).
    """

    world_size: int
    zero_stage: int
    precision: str
    params: list[TensorInfo]
    """Every parameter of the module (tied parameters once), in `named_parameters()` order."""
    aliases: dict[str, str]
    """Other state_dict names of tied parameters -> the name in `params`."""
    buffers: list[TensorInfo]
    optimizer: str | None
    param_groups: int
    fragments: list[list[Range]]
    """Per rank: the master fragments it owns (Note: [checkpoint fragments])."""
    weight_pieces: list[list[Range]] | None
    """Per rank: the low-precision parameter pieces it holds (stage 3); None: every rank holds
    whole parameters and rank 0 saves them in the model file."""
    frozen_saved: bool = False
    has_optimizer_states: bool = True
    global_steps: int = 0
    format_version: int = FORMAT_VERSION
    tag: str = ""
    files: dict[str, int] = field(default_factory=dict)
    """File name -> size in bytes, for every file of the checkpoint but the manifest."""
    node_ranks: list[int] | None = None
    """Saved with node-local storage: the ranks whose files this directory holds (the other
    ranks' files, listed in `files`, are on their nodes' disks). None: every file is here."""
    checksums: dict[str, str] | None = None
    """File name -> "crc32:<8 hex digits>" of its bytes, computed by the rank that wrote it while
    writing (checkpoint/verify.py checks it). None: saved before checksums were recorded (sizes only)."""
    train_batch_size: int | None = None
    """Samples per optimizer step over all ranks when saved; auto-resume keeps it at another
    data-parallel size (runtime/auto_resume.py). None: saved before it was recorded."""
    expert_parallel: dict[str, int] | None = None
    """MoE expert group name ("ep_size_<E>") -> its expert-parallel size, for a model with MoE
    layers: each rank's files hold its own experts under local names, so such a checkpoint loads
    only at the same world size and sizes (check_compatible). None: no experts."""
    expert_banks: dict[str, int] | None = None
    """Hugging Face expert-bank parameters (AutoEP, moe/hf_experts.py) -> the bank's experts in
    all: each rank saved its own experts, rows `(r % E) * L ..` of the whole tensor, under the
    parameter's name (checkpoint/expert_layout.py reads them as one tensor). None: no banks."""

    def param_index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.params)}


@dataclass
class EngineState:
    """One rank's state for a checkpoint: views of live tensors (copy before changing them)."""

    rank: int
    manifest: Manifest
    masters: list[Tensor]
    """fp32 masters of this rank's fragments (1-D), aligned with `manifest.fragments[rank]`."""
    optimizer_states: list[dict[str, Any]]
    """Optimizer state of each fragment; element-wise tensors flattened to 1-D."""
    elementwise_keys: list[list[str]]
    """Per fragment: the state keys with one value per element (exp_avg, exp_avg_sq)."""
    param_groups: list[dict[str, Any]]
    """The optimizer's hyper-parameters per group (lr, betas, ...), without "params"."""
    module: dict[str, Tensor]
    """Whole tensors for the model file (rank 0): parameters unless sharded, buffers."""
    weight_pieces: list[Tensor]
    """Aligned with `manifest.weight_pieces[rank]` (stage 3), else empty."""
    run_state: dict[str, Any]
    """Step counters, scheduler, loss scaler and data loader states (plain Python types)."""
    rng: dict[str, Any]


@dataclass
class LoadedState:
    """What a checkpointer read for this rank, aligned with the target `EngineState`."""

    path: str
    module: dict[str, Tensor]
    """Whole tensors to copy into the module (parameters not sharded, buffers)."""
    weight_pieces: list[Tensor | None] | None
    """Aligned with the strategy's `param_pieces()` (None: keep that piece's values)."""
    masters: list[Tensor] | None
    optimizer_states: list[dict[str, Any]] | None
    param_groups: list[dict[str, Any]] | None
    run_state: dict[str, Any] | None
    rng: dict[str, Any] | None
    client_state: dict[str, Any] | None


def pickle_bytes(obj: Any) -> bytes:
    """`torch.save` into bytes (run state that is not tensors: scheduler, data loader)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpickle_bytes(data: bytes) -> Any:
    # Written by this run's own save; unpickled only by engine.load_checkpoint (never by to-fp32).
    return torch.load(io.BytesIO(data), weights_only=False)


# -- the protocol the engine saves and loads through ---------------------------------------


class Checkpointer(Protocol):
    """Moves engine state to and from a directory. `zeroshard.checkpoint.ShardedCheckpointer`."""

    def save(self, state: EngineState, save_dir: str, tag: str, client_state: Mapping[str, Any] | None,
             save_latest: bool, save_optimizer_states: bool) -> str:
        """Write `state` (every rank calls it) and return the checkpoint's directory."""
        ...

    def load(self, target: EngineState, load_dir: str, tag: str | None, *, load_optimizer_states: bool,
             load_module_only: bool, strict: bool = True) -> LoadedState | None:
        """Read what `target` needs from a checkpoint; None when `load_dir` has no `latest`.
        `strict=False` tolerates parameter names missing on either side."""
        ...


@runtime_checkable
class AsyncCheckpointer(Protocol):
    """A checkpointer whose saves may finish in the background (`checkpoint.async_save`)."""

    def wait(self) -> str | None:
        """Publish the save in flight once every rank's files are durable (collective); its
        directory, or None when none was in flight. Raises on every rank if any writer failed."""
        ...
