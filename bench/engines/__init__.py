"""The benchmark's engines (table rows): name -> how to build one around the shared model.

Each builder imports its library lazily, so a missing DeepSpeed only affects its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.common import RunSpec, Stepper


@dataclass(frozen=True)
class EngineSpec:
    name: str
    family: str
    """"zeroshard", "deepspeed" or "torch"."""
    stage: int | None
    """ZeRO stage for zeroshard / DeepSpeed rows (pairs them up for the ratio column)."""
    offload: bool | str
    label: str
    """Row label in results.md."""
    build: Callable[[RunSpec], Stepper]


def _zs(stage: int, offload: bool | str) -> Callable[[RunSpec], Stepper]:
    def build(spec: RunSpec) -> Stepper:
        from engines import zeroshard_engine

        return zeroshard_engine.build(spec, stage, offload)

    return build


def _ds(stage: int, offload: bool | str) -> Callable[[RunSpec], Stepper]:
    def build(spec: RunSpec) -> Stepper:
        from engines import deepspeed_engine

        return deepspeed_engine.build(spec, stage, offload)

    return build


def _zs_check_off(stage: int) -> Callable[[RunSpec], Stepper]:
    """zeroshard with the collective signature check off (ZEROSHARD_COMM_VERIFY=0), to measure
    what the check costs against the ordinary zs<stage> row of the same run."""
    def build(spec: RunSpec) -> Stepper:
        import os

        os.environ["ZEROSHARD_COMM_VERIFY"] = "0"  # read when the engine's Comm is built
        return _zs(stage, False)(spec)

    return build


def _zs_gloo(stage: int) -> Callable[[RunSpec], Stepper]:
    """zeroshard with the shared-memory collectives off (ZEROSHARD_COMM_SHM=0): every collective
    over gloo's sockets, DDP's transport (Note: [shared-memory collectives] in comm/shm.py)."""
    def build(spec: RunSpec) -> Stepper:
        import os

        os.environ["ZEROSHARD_COMM_SHM"] = "0"  # read when the group's board is built
        return _zs(stage, False)(spec)

    return build


def _torch(kind: str) -> Callable[[RunSpec], Stepper]:
    def build(spec: RunSpec) -> Stepper:
        from engines import torch_engines

        return torch_engines.build(spec, kind)

    return build


def _rows() -> list[EngineSpec]:
    rows = []
    for stage, offload, suffix, text in ((0, False, "0", "stage 0"), (1, False, "1", "stage 1"),
                                         (2, False, "2", "stage 2"),
                                         (2, True, "2_offload", "stage 2 + CPU offload"),
                                         (3, False, "3", "stage 3"),
                                         (3, "both", "3_offload", "stage 3 + CPU offload (params + optimizer)"),
                                         (3, True, "3_offload_opt", "stage 3 + CPU optimizer offload"),
                                         (2, "nvme", "2_nvme", "stage 2 + NVMe optimizer offload"),
                                         (3, "nvme", "3_nvme", "stage 3 + NVMe optimizer offload"),
                                         (3, "nvme_both", "3_nvme_both",
                                          "stage 3 + NVMe parameter and optimizer offload")):
        rows.append(EngineSpec(f"zs{suffix}", "zeroshard", stage, offload, f"zeroshard {text}", _zs(stage, offload)))
        if (stage, offload) != (2, "nvme"):  # DeepSpeed swaps optimizer states to NVMe at stage 3 only
            rows.append(EngineSpec(f"ds{suffix}", "deepspeed", stage, offload, f"DeepSpeed {text}",
                                   _ds(stage, offload)))
    for stage in (1, 2, 3):
        rows.append(EngineSpec(f"zs{stage}_check_off", "zeroshard", stage, False,
                               f"zeroshard stage {stage}, collective check off", _zs_check_off(stage)))
        rows.append(EngineSpec(f"zs{stage}_gloo", "zeroshard", stage, False,
                               f"zeroshard stage {stage}, collectives over gloo (no shared memory)",
                               _zs_gloo(stage)))
    rows.append(EngineSpec("ddp", "torch", None, False, "torch DDP", _torch("ddp")))
    rows.append(EngineSpec("ddp_zero", "torch", None, False, "torch DDP + ZeroRedundancyOptimizer",
                           _torch("ddp_zero")))
    rows.append(EngineSpec("fsdp2", "torch", None, False, "torch FSDP2 (reshard_after_forward=False)",
                           _torch("fsdp2")))
    rows.append(EngineSpec("fsdp2_full", "torch", None, False, "torch FSDP2 full sharding (reshard_after_forward=True)",
                           _torch("fsdp2_full")))
    return rows


ENGINES: dict[str, EngineSpec] = {e.name: e for e in _rows()}
"""In table order: zeroshard and DeepSpeed interleaved per stage, then the torch baselines."""

DEFAULT_ENGINES = [name for name in ENGINES
                   if "nvme" not in name and "offload_opt" not in name and "check_off" not in name
                   and "gloo" not in name]
"""What `bench/run.py` runs by default: the NVMe rows (they need a scratch disk) and the stage-3
optimizer-only CPU offload row they are compared with are run by name (bench/nvme.md)."""
