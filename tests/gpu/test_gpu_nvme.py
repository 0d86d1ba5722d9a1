"""Optimizer offload to NVMe on a CUDA job reproduces CPU offload on the same job bitwise.

The GPU twin of tests/dist/test_nvme.py: both runs step the optimizer on the CPU with the same
fused kernel, so the model on the GPU must see the same bits after every step. What this adds
over the CPU twin is the device boundary: the fragments the NVMe step writes live on the GPU
while the gradient shard and the swap pool live in host memory (the first GPU run found this
path refusing to attach a CPU gradient to a CUDA fragment).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import global_batches, init_engine, make_model, precision_config, train_on_device

STEPS = 6


def config(stage: int, precision: str, nvme_path: Path | None) -> dict[str, Any]:
    cfg = precision_config(stage, precision, "optimizer", sub_group_size=640)
    if nvme_path is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path),
                                                         "pin_memory": True}
        cfg["aio"] = {"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 2}
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_matches_cpu_offload_bitwise_on_cuda(groups, tmp_path: Path, stage: int, precision: str) -> None:
    batches = global_batches(STEPS, 2 * 2 * groups.world_size)
    cpu = init_engine(make_model(), config(stage, precision, None))
    want_losses, want = train_on_device(cpu, batches, groups.rank, groups.world_size)
    root = tmp_path if groups.world_size == 1 else Path("/tmp/zs_gpu_nvme")
    root.mkdir(exist_ok=True)
    nvme = init_engine(make_model(), config(stage, precision, root))
    assert nvme.device.type == "cuda"
    losses, got = train_on_device(nvme, batches, groups.rank, groups.world_size)
    assert len(nvme.optimizer.swap._groups()) > 1, "the test must walk several sub-groups"
    assert losses == want_losses
    for step in range(STEPS):
        for i, (g, w) in enumerate(zip(got[step], want[step])):
            assert torch.equal(g, w), f"stage {stage} {precision} step {step}: param {i} not bitwise equal"
    assert not torch.equal(got[-1][0], got[0][0]), "the parameters must move"
    nvme.optimizer.close()
