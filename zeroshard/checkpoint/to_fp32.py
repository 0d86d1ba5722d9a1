"""Consolidation: full fp32 weights from a sharded checkpoint, on CPU, without a process group.

Tensors are assembled one at a time, in chunks of parameters (`chunk_bytes` of output): for
each chunk the rank files it needs are memory-mapped, the fragments copied out and the maps
dropped, so the pages read stay bounded by one chunk. Peak memory is therefore about one copy
of the output for an in-memory state dict, and about one chunk when streaming to a
safetensors file (`convert_zero_checkpoint_to_fp32_state_dict(..., safetensors=True)`).
Trainable parameters come from the fp32 master fragments (exact), frozen parameters and
buffers from the model file (cast to fp32 when floating point).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor, nn

from zeroshard.checkpoint.ds_files import is_deepspeed_dir, resolve_ds
from zeroshard.checkpoint.ds_import import DeepSpeedReader, read_layout
from zeroshard.checkpoint.files import MANIFEST, write_atomic
from zeroshard.checkpoint.load import CheckpointReader, ExpertReader
from zeroshard.checkpoint.manifest import read_manifest, resolve
from zeroshard.checkpoint.pipe_checkpointer import open_pipeline
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter
from zeroshard.checkpoint_format import Manifest, TensorInfo
from zeroshard.errors import CheckpointError
from zeroshard.progress import Progress as _Progress

logger = logging.getLogger("zeroshard")

CHUNK_BYTES = 64 * 2**20
"""Output bytes assembled per pass over the rank files (bounds the memory-mapped pages)."""


def Progress(total_bytes: int, enabled: bool, stream: TextIO | None = None) -> _Progress:  # noqa: N802  called like the class it stands in for
    """to-fp32's bar over the output bytes (zeroshard/progress.py: tqdm on a terminal)."""
    return _Progress(total_bytes, "to-fp32", enabled, unit="B", stream=stream)


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    info: TensorInfo
    source: str  # "master" | "weights" | "buffer"

    @property
    def out_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.info.dtype)
        return torch.float32 if dtype.is_floating_point else dtype

    @property
    def nbytes(self) -> int:
        return self.info.numel * torch.empty((), dtype=self.out_dtype).element_size()


def _open_checkpoint(checkpoint_dir: str | os.PathLike[str],
                     tag: str | None) -> tuple[Path, Manifest, Callable[[], CheckpointReader]]:
    """The tag directory, its manifest, and how to open a reader on it (zeroshard's format, or
    DeepSpeed's read in place through the same reader interface: checkpoint/ds_import.py)."""
    root = Path(checkpoint_dir)
    pipe = open_pipeline(root, tag)  # a pipeline's, zeroshard's or DeepSpeed's (checkpoint/pipe_checkpointer.py)
    if pipe is not None:
        return pipe
    ds = root if tag is None and is_deepspeed_dir(root) else resolve_ds(root, tag)
    if ds is not None:
        layout = read_layout(ds, None)
        return ds, layout.manifest, lambda: DeepSpeedReader(layout)
    if tag is None and (root / MANIFEST).is_file():  # given the tag directory itself
        ckpt, manifest = root, read_manifest(root)
    else:
        resolved = resolve(root, tag)
        if resolved is None:
            raise CheckpointError(f"{root}: no 'latest' file; pass the tag (--tag) of the checkpoint to convert")
        ckpt, manifest = resolved
    if any(ep > 1 for ep in (manifest.expert_parallel or {}).values()):
        # Each rank saved its own experts under local names: read them under global expert ids,
        # the names the model has at ep_size 1 (checkpoint/expert_layout.py).
        return ckpt, ExpertReader(ckpt, manifest).manifest, lambda: ExpertReader(ckpt, manifest)
    return ckpt, manifest, lambda: CheckpointReader(ckpt, manifest)


def _plan(m: Manifest) -> list[_Entry]:
    entries = []
    skipped = []
    for p in m.params:
        if p.trainable and m.has_optimizer_states:
            entries.append(_Entry(p.name, p, "master"))
        elif p.trainable or m.frozen_saved:
            entries.append(_Entry(p.name, p, "weights"))
        else:
            skipped.append(p.name)
    if skipped:
        logger.warning(f"{len(skipped)} frozen parameters were not saved (exclude_frozen_parameters) and are "
                       f"not in the output: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
    if not m.has_optimizer_states:
        logger.warning("saved without optimizer states: trainable parameters come from the "
                       f"{m.params[0].dtype if m.params else ''} weights, not from fp32 masters")
    entries += [_Entry(b.name, b, "buffer") for b in m.buffers]
    return entries


def _chunks(entries: list[_Entry], chunk_bytes: int) -> Iterator[list[_Entry]]:
    chunk: list[_Entry] = []
    size = 0
    for e in entries:
        if chunk and size + e.nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(e)
        size += e.nbytes
    if chunk:
        yield chunk


def iter_fp32_tensors(ckpt: Path, manifest: Manifest, *, chunk_bytes: int = CHUNK_BYTES,
                      progress: Progress | None = None,
                      open_reader: Callable[[], CheckpointReader] | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, fp32 tensor) for every saved parameter and buffer, assembled chunk by chunk."""
    entries = _plan(manifest)
    for chunk in _chunks(entries, chunk_bytes):
        # A fresh reader per chunk: maps dropped after it.
        reader = open_reader() if open_reader is not None else CheckpointReader(ckpt, manifest)
        index = reader.master_index()
        for e in chunk:
            info = e.info
            if e.source == "master":
                flat, _ = reader.masters(index, e.name, 0, info.numel, with_state=False)
                flat = flat.to(e.out_dtype)
            elif e.source == "weights":
                flat = reader.weights(e.name, 0, info.numel, e.out_dtype)
            else:
                module = reader.module()
                if e.name not in module:
                    raise CheckpointError(f"{ckpt}: buffer {e.name!r} listed in the manifest is not saved")
                flat = module[e.name].reshape(-1).to(e.out_dtype, copy=True)
            if progress is not None:
                progress.advance(e.nbytes, e.name)
            yield e.name, flat.view(info.shape)
        reader.close()
        del reader, index


def _output_names(manifest: Manifest, names: list[str]) -> dict[str, str]:
    """Output key -> source name: every saved tensor, plus tied aliases of saved parameters."""
    out = {n: n for n in names}
    for alias, canonical in manifest.aliases.items():
        if canonical in out:
            out[alias] = canonical
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *,
                                             progress: bool = False) -> dict[str, Tensor]:
    """The checkpoint's full fp32 state dict, on CPU, like DeepSpeed's function of that name.

    Args:
        checkpoint_dir: the directory given to `save_checkpoint` (with `latest`), or a tag
            directory itself.
        tag: which checkpoint; default: the one `latest` names.
        progress: print a progress bar on stderr.

    Returns:
        name -> fp32 tensor for every saved parameter (tied names share one tensor) and buffer
        (floating buffers cast to fp32).

    Raises:
        CheckpointError: missing tag, missing / truncated / foreign file.

    Example::

        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))
    """
    ckpt, manifest, open_reader = _open_checkpoint(checkpoint_dir, tag)
    bar = Progress(sum(e.nbytes for e in _plan(manifest)), progress)
    tensors = dict(iter_fp32_tensors(ckpt, manifest, progress=bar, open_reader=open_reader))
    bar.close()
    return {key: tensors[src] for key, src in _output_names(manifest, list(tensors)).items()}


@torch.no_grad()
def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None, *, progress: bool = False) -> nn.Module:
    """Copy the checkpoint's fp32 weights into `model` (on CPU, any dtype), tensor by tensor,
    so memory stays near the model itself. Returns `model`.

    Raises:
        CheckpointError: a file problem, or the model's names / shapes differ from the
            checkpoint's (checked before anything is copied).
    """
    ckpt, manifest, open_reader = _open_checkpoint(checkpoint_dir, tag)
    targets = dict(model.state_dict(keep_vars=True))
    entries = _plan(manifest)
    missing = [e.name for e in entries if e.name not in targets]
    shapes = [f"{e.name}: checkpoint {list(e.info.shape)}, model {list(targets[e.name].shape)}"
              for e in entries if e.name in targets and tuple(targets[e.name].shape) != e.info.shape]
    saved = {e.name for e in entries}
    absent = [k for k in targets if k not in saved and manifest.aliases.get(k) not in saved
              and k not in {p.name for p in manifest.params if not p.trainable}]
    if missing or shapes or absent:
        raise CheckpointError(f"{ckpt}: does not match the model: in the checkpoint only {missing[:5]}, "
                              f"shapes {shapes[:3]}, in the model only {absent[:5]}")
    bar = Progress(sum(e.nbytes for e in entries), progress)
    for name, tensor in iter_fp32_tensors(ckpt, manifest, progress=bar, open_reader=open_reader):
        targets[name].data.copy_(tensor)
    bar.close()
    return model


@dataclass(frozen=True, slots=True)
class ConversionStats:
    tensors: int
    output_bytes: int
    seconds: float


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_file: str | os.PathLike[str], tag: str | None = None, *,
                                               safetensors: bool = False, progress: bool = True,
                                               chunk_bytes: int = CHUNK_BYTES) -> ConversionStats:
    """Write the fp32 state dict to `output_file` (torch.save, or safetensors streamed).

    The file appears atomically (temporary name, fsync, rename). With `safetensors`, tied
    aliases are written as separate copies (the format has no shared tensors).
    """
    start = time.perf_counter()
    ckpt, manifest, open_reader = _open_checkpoint(checkpoint_dir, tag)
    entries = _plan(manifest)
    bar = Progress(sum(e.nbytes for e in entries), progress)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    if safetensors:
        by_name = {e.name: e for e in entries}
        keys = _output_names(manifest, [e.name for e in entries])
        # Aliases stream after their parameter: emit each canonical tensor once per key.
        aliases: dict[str, list[str]] = {}
        for key, src in keys.items():
            if key != src:
                aliases.setdefault(src, []).append(key)
        order = [(k, by_name[n].info.shape, by_name[n].out_dtype) for n in by_name for k in [n, *aliases.get(n, [])]]
        with SafetensorsWriter(out, order, {"zeroshard_tag": manifest.tag}) as writer:
            tensors_in_order = iter_fp32_tensors(ckpt, manifest, chunk_bytes=chunk_bytes, progress=bar,
                                                 open_reader=open_reader)
            for name, tensor in tensors_in_order:
                for key in [name, *aliases.get(name, [])]:
                    writer.write(key, tensor)
        count = len(order)
    else:
        tensors = dict(iter_fp32_tensors(ckpt, manifest, chunk_bytes=chunk_bytes, progress=bar,
                                         open_reader=open_reader))
        sd = {key: tensors[src] for key, src in _output_names(manifest, list(tensors)).items()}
        # Scripts (and DeepSpeed's tests) call this on every rank with the same output path.
        write_atomic(out, lambda f: torch.save(sd, f), per_process_tmp=True)
        count = len(sd)
    bar.close()
    return ConversionStats(tensors=count, output_bytes=out.stat().st_size, seconds=time.perf_counter() - start)


def export_pretrained(model: Any, checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                      tag: str | None = None) -> Path:
    """A transformers `save_pretrained` directory (safetensors) with the checkpoint's fp32 weights.

    Args:
        model: a transformers `PreTrainedModel` of the checkpoint's architecture (for example
            `AutoModelForCausalLM.from_config(config)`); its weights are overwritten.

    Raises:
        CheckpointError: transformers is not installed or `model` has no `save_pretrained`.
    """
    try:
        import transformers  # noqa: F401  (optional dependency: the [hf] extra)
    except ImportError as e:
        raise CheckpointError("export_pretrained needs transformers: pip install 'zeroshard[hf]'") from e
    if not hasattr(model, "save_pretrained"):
        raise CheckpointError(f"{type(model).__name__} has no save_pretrained; pass a transformers model")
    load_state_dict_from_zero_checkpoint(model.float(), checkpoint_dir, tag)
    # transformers 4.x takes safe_serialization (default True); 5.x always writes safetensors.
    accepts = inspect.signature(model.save_pretrained).parameters
    extra = {"safe_serialization": True} if "safe_serialization" in accepts else {}
    model.save_pretrained(str(output_dir), **extra)
    return Path(output_dir)
