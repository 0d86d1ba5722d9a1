"""Writing a checkpoint: every rank's files into a staging directory, then one publish.

Order (Note: [save order]); a crash at any point leaves the previous checkpoint and `latest`
as they were:

    1. rank 0 clears `.TAG.partial/` (a leftover of an interrupted save) and creates it
    2. every rank writes its files there (temp name, fsync, rename), fsyncs the directory
    3. the ranks agree that every write succeeded and gather their layouts and file sizes
    4. rank 0 writes the manifest (temp, fsync, rename): the staging directory is complete
    5. rank 0 renames it to `TAG/` (an existing `TAG/` is first renamed to `.TAG.old/`,
       which the loader uses if the crash falls between these two renames), fsyncs the root
    6. rank 0 replaces `latest` (temp, fsync, rename), fsyncs the root, removes `.TAG.old/`

Note: [node-local storage] With `checkpoint.use_node_local_storage` (Hugging Face Trainer's
`save_on_each_node`), `save_dir` may be a disk of each node's own. Then the first rank of each
node does rank 0's part (steps 1, 4, 5, 6 and the model file) in its node's directory, and every
rank writes its own files into its node's directory. Each node's directory is a complete
checkpoint for that node's ranks: its manifest lists the whole job's layout plus the ranks whose
files it holds (`node_ranks`), so a load that needs another node's files says so by name. Rank
0 prepares first and leaves a token in the staging directory; a node's first rank that finds
that token sees the same file system as rank 0 and leaves the work to it (no two writers race
on one directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint.agreed import agree
from zeroshard.checkpoint.files import (
    LATEST,
    MANIFEST,
    MODEL_FILE,
    WRITER_TOKEN,
    begin_save,
    fault_point,
    format_checksum,
    fsync_dir,
    optim_file,
    pieces_file,
    retired_dir,
    rng_file,
    save_torch_checked,
    staging_dir,
    write_text_atomic,
)
from zeroshard.checkpoint.manifest import to_json
from zeroshard.checkpoint_format import FORMAT_VERSION, EngineState, Range, pickle_bytes
from zeroshard.errors import CheckpointError
from zeroshard.progress import PROGRESS_MIN_BYTES, Progress

if TYPE_CHECKING:
    from zeroshard.comm import Comm


_TARGET_BYTES = 1024
"""A rank's (save_dir, tag) is compared in full; this many bytes of it are shown in the error."""


def check_same_target(comm: "Comm", save_dir: str | os.PathLike[str], tag: str,
                      node_leader: int | None = None) -> None:
    """Refuse, on every rank and before anything is written, a save whose `save_dir` or `tag`
    differs across ranks (e.g. a directory named from each rank's clock): one checkpoint is one
    directory all ranks write into. With node-local storage (`node_leader` given) each node
    writes its own directory, so `save_dir` must agree within a node and the tag everywhere.
    One all_gather of a fixed-size row: digests of the directory and of the tag, the node,
    then the value's first bytes for the message. Independent of checkpoint.tag_validation
    (docs/deepspeed-differences.md)."""
    directory = os.path.normpath(os.fspath(save_dir))
    value = json.dumps([directory, tag]).encode("utf-8", "replace")
    shown = value[:_TARGET_BYTES]
    node = 0 if node_leader is None else node_leader + 1
    head = hashlib.sha256(directory.encode("utf-8", "replace")).digest()
    head += hashlib.sha256(tag.encode("utf-8", "replace")).digest()
    head += node.to_bytes(8, "little") + len(shown).to_bytes(8, "little")
    row = torch.zeros(len(head) + _TARGET_BYTES, dtype=torch.uint8)
    row[: len(head) + len(shown)] = torch.frombuffer(bytearray(head + shown), dtype=torch.uint8)
    device = comm.groups.device
    out = torch.zeros(comm.world_size * row.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(out, row.to(device))
    rows = out.cpu().view(comm.world_size, -1)
    nodes = [int.from_bytes(bytes(rows[r, 64:72].tolist()), "little") for r in range(comm.world_size)]
    same_tag = all(torch.equal(rows[r, 32:64], rows[0, 32:64]) for r in range(comm.world_size))
    same_dir = all(torch.equal(rows[r, :32], rows[q, :32]) for r in range(comm.world_size)
                   for q in range(comm.world_size) if nodes[r] == nodes[q])
    if same_tag and same_dir:
        return
    values = []
    for r in range(comm.world_size):
        n = int.from_bytes(bytes(rows[r, 72:80].tolist()), "little")
        text = bytes(rows[r, 80 : 80 + n].tolist()).decode("utf-8", "replace")
        try:
            values.append(tuple(json.loads(text)))
        except ValueError:
            values.append((text, "?"))
    what = [w for w, same in (("save_dir", same_dir), ("tag", same_tag)) if not same]
    per_rank = "; ".join(f"rank {r}: save_dir={d!r}, tag={t!r}" for r, (d, t) in enumerate(values))
    scope = " within a node" if node_leader is not None and not same_dir else ""
    raise CheckpointError(f"rank {comm.rank}: save_checkpoint got a different {' and '.join(what)} on different ranks"
                          f"{scope} ({per_rank}); nothing was written. Every rank must pass the same save_dir and tag "
                          "(name the directory on one rank and broadcast it, e.g. with "
                          "torch.distributed.broadcast_object_list, or derive it from the global step rather than each "
                          "rank's clock)")


def gather_rows(comm: "Comm", row: list[int]) -> list[list[int]]:
    """Every rank's list of ints, on every rank (lengths may differ)."""
    device = comm.groups.device
    n = torch.tensor([len(row)], dtype=torch.int64, device=device)
    lengths = torch.zeros(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(lengths, n)
    width = max(int(lengths.max()), 1)
    mine = torch.zeros(width, dtype=torch.int64, device=device)
    mine[: len(row)] = torch.tensor(row, dtype=torch.int64)
    out = torch.zeros(width * comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(out, mine)
    rows = out.view(comm.world_size, width).tolist()
    return [r[: int(k)] for r, k in zip(rows, lengths.tolist())]


def _flatten(ranges: list[Range]) -> list[int]:
    return [x for r in ranges for x in r]


def _unflatten(values: list[int]) -> list[Range]:
    return [(values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3)]


def _optim_payload(state: EngineState) -> dict[str, Any]:
    m = state.manifest
    return {
        "zeroshard_format_version": FORMAT_VERSION, "rank": state.rank, "world_size": m.world_size,
        "fragments": [list(r) for r in m.fragments[state.rank]],
        "master": [_own(t) for t in state.masters],
        "state": [{k: _own(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for s in state.optimizer_states],
        "elementwise": state.elementwise_keys,
        "param_groups": state.param_groups,
    }


def _own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes a view's whole storage: a fragment viewing the model's flat buffer
    # would drag the full model into every rank's file. Copy views, save owners as they are.
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
    return t.detach() if whole else t.detach().clone()


def _model_payload(state: EngineState, client_state: Mapping[str, Any] | bytes | None) -> dict[str, Any]:
    """`client_state` as given, or already pickled (an asynchronous save pickles it at the call)."""
    m = state.manifest
    if client_state is not None and not isinstance(client_state, bytes):
        client_state = pickle_bytes(dict(client_state))
    return {
        "module": state.module,
        "buffer_names": [b.name for b in m.buffers],
        "param_shapes": {p.name: list(p.shape) for p in m.params},
        "frozen_param_names": [p.name for p in m.params if not p.trainable],
        "zeroshard_format_version": FORMAT_VERSION,
        "dp_world_size": m.world_size,
        "zero_stage": m.zero_stage,
        **state.run_state,
        "client_state": client_state,
    }


def _state_bytes(state: EngineState) -> int:
    """Roughly what rank 0 writes: masters, their optimizer state, weight pieces, whole tensors."""
    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    return (sum(map(nbytes, state.masters)) + sum(nbytes(v) for s in state.optimizer_states for v in s.values())
            + sum(map(nbytes, state.weight_pieces)) + sum(map(nbytes, state.module.values())))


def _write_rank_files(state: EngineState, staging: Path, client_state: Mapping[str, Any] | bytes | None,
                      save_optimizer_states: bool, bar: Progress, writer: bool) -> list[int]:
    """This rank's files; returns [optim, rng, pieces, model] sizes (0: not written), then their
    crc32 checksums (computed while writing; Note: [checkpoint checksums] in verify.py)."""
    rank = state.rank
    sizes, crcs = [0, 0, 0, 0], [0, 0, 0, 0]

    def put(i: int, path: Path, obj: Any) -> None:
        sizes[i], checksum = save_torch_checked(path, obj)
        crcs[i] = int(checksum.partition(":")[2], 16)

    if save_optimizer_states:
        put(0, staging / optim_file(rank), _optim_payload(state))
        bar.advance(1, f"{optim_file(rank)} ({sizes[0] / 2**20:,.0f} MiB)")
    put(1, staging / rng_file(rank), state.rng)
    if state.manifest.weight_pieces is not None:
        put(2, staging / pieces_file(rank), {"pieces": [_own(t) for t in state.weight_pieces]})
        bar.advance(1, f"{pieces_file(rank)} ({sizes[2] / 2**20:,.0f} MiB)")
    if writer:
        put(3, staging / MODEL_FILE, _model_payload(state, client_state))
        bar.advance(1, f"{MODEL_FILE} ({sizes[3] / 2**20:,.0f} MiB)")
    fsync_dir(staging)
    return sizes + crcs


def _publish(root: Path, staging: Path, tag: str, save_latest: bool) -> None:
    final, old = root / tag, retired_dir(root, tag)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        fault_point("rename old")
    os.replace(staging, final)
    fault_point("rename staging")
    fsync_dir(root)
    if save_latest:
        write_text_atomic(root / LATEST, tag)
        fsync_dir(root)
    if old.exists():
        shutil.rmtree(old)
        fault_point("remove old")


def _prepare(root: Path, tag: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, tag)
    if staging.exists():
        shutil.rmtree(staging)
    if (root / tag).exists() and retired_dir(root, tag).exists():
        shutil.rmtree(retired_dir(root, tag))
    staging.mkdir()
    fault_point("mkdir")
    return staging


def save_state(state: EngineState, comm: "Comm", save_dir: str | os.PathLike[str], tag: str,
               client_state: Mapping[str, Any] | None, save_latest: bool,
               save_optimizer_states: bool = True, *, node_leader: int | None = None) -> bool:
    """Write `state` as checkpoint `tag` under `save_dir`; collective. See Note: [save order].

    `node_leader`: for node-local storage (Note: [node-local storage]), the first rank of this
    rank's node; None: one directory every rank shares, written by rank 0.

    Returns:
        Whether this rank published a directory (rank 0; with node-local storage, also the
        first rank of each node whose disk rank 0 does not share).
    """
    target = begin_save_state(state, comm, save_dir, tag, node_leader)
    steps = int(save_optimizer_states) + int(state.manifest.weight_pieces is not None) + int(target.writer) + 1
    bar = Progress(steps, f"save {tag} (rank 0's files)",
                   state.rank == 0 and _state_bytes(state) >= PROGRESS_MIN_BYTES, unit="stage", expected_updates=steps)
    sizes, error = write_rank_files(target, state, client_state, save_optimizer_states, bar)
    end_save_state(target, state, comm, sizes, error, save_latest, save_optimizer_states)
    bar.advance(1, f"published {target.root / tag}")
    bar.close()
    return target.writer


@dataclass(frozen=True)
class SaveTarget:
    """A save whose staging directories exist (steps 1 of Note: [save order]): where this rank
    writes, and which rank publishes each rank's directory."""

    root: Path
    tag: str
    staging: Path
    writers: list[int]
    """For every rank, the rank that publishes the directory its files go to."""
    rank: int

    @property
    def writer(self) -> bool:
        """Whether this rank publishes a directory (writes the model file and the manifest)."""
        return self.writers[self.rank] == self.rank


def begin_save_state(state: EngineState, comm: "Comm", save_dir: str | os.PathLike[str], tag: str,
                     node_leader: int | None) -> SaveTarget:
    """Step 1 of Note: [save order]: check the target on every rank, prepare the staging
    directories. Collective."""
    check_same_target(comm, save_dir, tag, node_leader)  # first: the checks below then fail alike everywhere
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"tag {tag!r}: use a plain directory name (no '/', not starting with '.', "
                              f"not {LATEST!r})")
    root, rank = Path(save_dir), state.rank
    begin_save(rank)
    staging = staging_dir(root, tag)
    writers = _prepare_writers(comm, root, tag, staging, rank, node_leader)
    return SaveTarget(root=root, tag=tag, staging=staging, writers=writers, rank=rank)


def write_rank_files(target: SaveTarget, state: EngineState, client_state: Mapping[str, Any] | bytes | None,
                     save_optimizer_states: bool, bar: Progress | None = None) -> tuple[list[int], str | None]:
    """Step 2: this rank's files, durable (fsync). Not collective: the asynchronous writer runs
    it on its own thread. Returns the sizes and checksums, and the error (None: written)."""
    bar = bar if bar is not None else Progress(1, enabled=False)
    try:
        return _write_rank_files(state, target.staging, client_state, save_optimizer_states, bar, target.writer), None
    except (OSError, RuntimeError) as e:
        return [0] * 8, f"writing to {target.staging}: {e}"


def end_save_state(target: SaveTarget, state: EngineState, comm: "Comm", sizes: list[int], error: str | None,
                   save_latest: bool, save_optimizer_states: bool, what: str = "writing checkpoint files") -> None:
    """Steps 3-6: agree that every rank's files are durable, gather the layouts, and publish
    (manifest, rename, `latest`). Collective; every rank raises if any rank failed, and then
    nothing is published (the previous checkpoint and `latest` stay)."""
    agree(comm, error, what)
    m, rank = state.manifest, target.rank
    mine = m.fragments[rank]
    pieces = m.weight_pieces[rank] if m.weight_pieces is not None else []
    rows = gather_rows(comm, [*sizes, len(mine), len(pieces), *_flatten(mine), *_flatten(pieces)])
    error = None
    if target.writer:
        present = [r for r in range(comm.world_size) if target.writers[r] == rank]
        try:
            _finish(state, rows, target.root, target.staging, target.tag, save_latest, save_optimizer_states,
                    node_ranks=None if len(present) == comm.world_size else present, model_file=(sizes[3], sizes[7]))
        except OSError as e:
            error = f"publishing {target.root / target.tag}: {e}"
    agree(comm, error, "publishing the checkpoint")


def _prepare_writers(comm: "Comm", root: Path, tag: str, staging: Path, rank: int,
                     node_leader: int | None) -> list[int]:
    """Create the staging directories; returns, for every rank, the rank that publishes the
    directory its files go to (Note: [node-local storage])."""
    error = None
    token = ""
    if node_leader is not None:
        t = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1 if rank == 0 else 0],
                         dtype=torch.int64, device=comm.groups.device)
        comm.broadcast(t, src=0)
        token = f"{int(t.item())}"
    if rank == 0:
        try:
            _prepare(root, tag)
            if token:
                write_text_atomic(staging / WRITER_TOKEN, token)
        except OSError as e:
            error = f"{staging}: {e}"
    agree(comm, error, "preparing the checkpoint directory")
    if node_leader is None:
        return [0] * comm.world_size
    prepared = 0
    if rank == node_leader and rank != 0:
        try:
            token_file = staging / WRITER_TOKEN
            if not (token_file.is_file() and token_file.read_text() == token):  # a disk rank 0 does not see
                _prepare(root, tag)
                prepared = 1
        except OSError as e:
            error = f"{staging}: {e}"
    agree(comm, error, "preparing this node's checkpoint directory")
    world = comm.world_size
    table = torch.zeros(2 * world, dtype=torch.int64, device=comm.groups.device)
    table[rank], table[world + rank] = node_leader, prepared
    comm.all_reduce(table)
    leaders, own = table[:world].tolist(), table[world:].tolist()
    return [leaders[r] if own[leaders[r]] else 0 for r in range(world)]


def _finish(state: EngineState, rows: list[list[int]], root: Path, staging: Path, tag: str,
            save_latest: bool, save_optimizer_states: bool, *, node_ranks: list[int] | None = None,
            model_file: tuple[int, int] = (0, 0)) -> None:
    m = state.manifest
    files: dict[str, int] = {}
    checksums: dict[str, str] = {}
    fragments, pieces = [], []
    for r, row in enumerate(rows):
        n_frag, n_piece = row[8:10]
        names = (optim_file(r), rng_file(r), pieces_file(r), MODEL_FILE)
        for name, size, crc in zip(names, row[:4], row[4:8]):
            if size:
                files[name], checksums[name] = size, format_checksum(crc)
        fragments.append(_unflatten(row[10 : 10 + 3 * n_frag]))
        pieces.append(_unflatten(row[10 + 3 * n_frag : 10 + 3 * (n_frag + n_piece)]))
    if node_ranks is not None:  # this directory's own model file (each node's writer wrote one)
        files[MODEL_FILE], checksums[MODEL_FILE] = model_file[0], format_checksum(model_file[1])
    m.fragments, m.files, m.tag, m.node_ranks = fragments, files, tag, node_ranks
    m.checksums = checksums
    m.has_optimizer_states = save_optimizer_states
    (staging / WRITER_TOKEN).unlink(missing_ok=True)
    if m.weight_pieces is not None:
        m.weight_pieces = pieces
    write_text_atomic(staging / MANIFEST, to_json(m))
    fsync_dir(staging)
    _publish(root, staging, tag, save_latest)
