"""A checkpoint as a DeepSpeed universal checkpoint, for DeepSpeed 0.19 to resume from.

`zeroshard to-deepspeed CKPT OUT` reads any checkpoint zeroshard loads (its own at any layout,
a pipeline's, DeepSpeed's native files) offline, without a process group, and writes
`OUT/<tag>/` in the layout DeepSpeed's `ds_to_universal` produces, plus `OUT/latest_universal`.
DeepSpeed 0.19.8 resumes from it at any world size and ZeRO stage 1-3 with
`"checkpoint": {"load_universal": true}` (zeroshard loads it too: checkpoint/ds_universal.py).

Per trainable parameter `zero/<name>/`: `fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` as
`{"param": tensor}` in the parameter's shape (what both DeepSpeed's ZeRO-1/2 and ZeRO-3
universal loaders read) and `step.pt`; frozen parameters get `fp32.pt` only, as DeepSpeed's
converter writes them. `zero/optimizer_state.pt` holds the parameter groups' hyperparameters
and the step in the two places DeepSpeed's loaders look (`param_groups`;
`optimizer_state_dict.state[0].step`). The model file `mp_rank_00_model_states.pt` holds the
weights, the scheduler's state, the step counters and the client state at the top level, as
DeepSpeed's save does; `zero_pp_rank_0_mp_rank_00_model_states.pt` (the name DeepSpeed's ZeRO-3
engine opens) the same without the weights. Not carried: an fp16 loss scaler's state (DeepSpeed
unpickles its own class there; its engine keeps its fresh scaler) and random generator states
(DeepSpeed saves none).

The scheduler and client state are unpickled (they were pickled by the run that saved, as
`load_checkpoint` does): convert only checkpoints you trust. Memory: one parameter's states at
a time. Imports checkpoint/to_fp32.py, files.py, checkpoint_format, errors and torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.files import MODEL_FILE, fsync_dir, save_torch, write_text_atomic
from zeroshard.checkpoint.to_fp32 import _open_checkpoint
from zeroshard.checkpoint_format import unpickle_bytes
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

DS_FORMAT_VERSION = "0.19.8"
"""The DeepSpeed release whose universal layout is written (DeepSpeed checks `ds_version`)."""
_DS_MODEL = "mp_rank_00_model_states.pt"
_DS_ZERO3_MODEL = "zero_pp_rank_0_mp_rank_00_model_states.pt"


@dataclass(frozen=True, slots=True)
class UniversalStats:
    path: Path
    trainable: int
    frozen: int
    bytes: int
    seconds: float


def _save(path: Path, obj: Any) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_torch(path, obj)


def _run_state(run: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    sched = run.get("lr_scheduler")
    client = run.get("client_state")
    return (unpickle_bytes(sched) if isinstance(sched, bytes) else sched,
            unpickle_bytes(client) if isinstance(client, bytes) else dict(client or {}))


def convert_to_universal(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                         tag: str | None = None) -> UniversalStats:
    """Write checkpoint `checkpoint_dir` (`tag`; default: the one `latest` names) as a DeepSpeed
    universal checkpoint `output_dir/<tag>` and point `output_dir/latest_universal` at it.

    Raises:
        CheckpointError: no checkpoint there, saved without optimizer states, a file missing or
            damaged, or `output_dir/<tag>` exists already (nothing is overwritten).
    """
    start = time.perf_counter()
    ckpt, manifest, open_reader = _open_checkpoint(checkpoint_dir, tag)
    if not manifest.has_optimizer_states:
        raise CheckpointError(f"{ckpt}: saved without optimizer states (save_optimizer_states=False); a universal "
                              "checkpoint is a resumable optimizer state. Save with optimizer states, or export the "
                              "weights with zeroshard to-fp32")
    out_root = Path(output_dir)
    final = out_root / ckpt.name
    if final.exists():
        raise CheckpointError(f"{final}: exists; pick another output directory or remove it (nothing is overwritten)")
    staging = out_root / f".{ckpt.name}.converting"
    shutil.rmtree(staging, ignore_errors=True)
    zero = staging / "zero"
    reader = open_reader()
    total = trainable = frozen = 0
    try:
        run = reader.file(MODEL_FILE)
        index = reader.master_index()
        steps: list[Any] = []
        module: dict[str, torch.Tensor] = {}
        for p in manifest.params:
            if p.trainable:
                master, state = reader.masters(index, p.name, 0, p.numel)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        total += _save(zero / p.name / f"{key}.pt", {"param": state[key].view(p.shape).float()})
                step = state.get("step")
                if step is not None:
                    steps.append(step)
                    total += _save(zero / p.name / "step.pt", torch.as_tensor(step, dtype=torch.float32).clone())
                trainable += 1
            elif manifest.frozen_saved:
                master = reader.weights(p.name, 0, p.numel, torch.float32)
                frozen += 1
            else:
                continue
            total += _save(zero / p.name / "fp32.pt", {"param": master.view(p.shape).float()})
            module[p.name] = master.view(p.shape).to(getattr(torch, p.dtype))
        saved_module = reader.module()
        buffers = {b.name: saved_module[b.name] for b in manifest.buffers if b.name in saved_module}
        groups = [{**g, "params": [k]} for k, g in enumerate(reader.optim(0)["param_groups"])]
    finally:
        reader.close()
    step = steps[0] if steps else 0
    total += _save(zero / "optimizer_state.pt", {
        "ds_version": DS_FORMAT_VERSION, "zero_stage": manifest.zero_stage, "param_groups": groups,
        "optimizer_state_dict": {"state": {0: {"step": torch.as_tensor(step, dtype=torch.float32).clone()}},
                                 "param_groups": groups}})
    sched, client = _run_state(run)
    trained = [p for p in manifest.params if p.trainable]
    common = {
        **client,
        "buffer_names": list(buffers),
        "param_shapes": [{p.name: torch.Size(p.shape) for p in trained}],
        "frozen_param_shapes": {p.name: torch.Size(p.shape) for p in manifest.params if not p.trainable},
        "shared_params": dict(manifest.aliases),
        "frozen_param_fragments": {},
        "lr_scheduler": sched, "data_sampler": None, "random_ltd": None, "optimizer": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(run.get("skipped_steps") or 0),
        "global_steps": int(run.get("global_steps") or 0),
        "global_samples": int(run.get("global_samples") or 0),
        "dp_world_size": manifest.world_size, "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": manifest.zero_stage}},
        "ds_version": DS_FORMAT_VERSION,
        "universal_checkpoint_info": {},
        "zeroshard_converted_from": str(ckpt),
    }
    total += _save(staging / _DS_MODEL, {**common, "module": {**module, **buffers}})
    total += _save(staging / _DS_ZERO3_MODEL, {**common, "module": dict(buffers)})
    fsync_dir(staging)
    os.replace(staging, final)
    write_text_atomic(out_root / "latest_universal", ckpt.name)
    fsync_dir(out_root)
    seconds = time.perf_counter() - start
    logger.info(f"wrote DeepSpeed universal checkpoint {final}: {trainable} trained and {frozen} frozen parameters, "
                f"{total / 2**20:,.1f} MiB in {seconds:.1f} s")
    return UniversalStats(final, trainable, frozen, total, seconds)
