"""GPU tests: the CUDA / NCCL paths, run where a CUDA device exists, skipped with a reason elsewhere.

    python tests/run.py gpu                                    # world size 1 (one process)
    torchrun --standalone --nproc-per-node=$(nvidia-smi -L | wc -l) -m pytest tests/gpu -x -q

Every test here is marked `gpu`. Without CUDA each one is skipped with the reason printed
(`-rs`), so a CPU-only CI run says how many GPU tests it did not run and why. Under torchrun the
job shares one NCCL process group, as tests/dist shares one gloo group. NCCL refuses two ranks on
one device, so the largest world size is the number of visible GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
SKIP_REASON = ("no CUDA device: tests/gpu runs the NCCL, CUDA-stream and pinned-memory paths "
               "on a GPU machine (python tests/run.py gpu)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="package")
def groups() -> Iterator[object]:
    """The job's ProcessGroups on CUDA (NCCL under torchrun, none at world size 1)."""
    if not HAS_CUDA:  # never reached: every test is skipped first; kept for clarity
        pytest.skip(SKIP_REASON)
    # Deterministic kernels, so that two runs that should agree bitwise (stage N against stage
    # 0) are not separated by atomics in e.g. the embedding backward.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    from zeroshard.comm import destroy_distributed, init_distributed

    groups = init_distributed(timeout_s=120)
    if groups.device.type != "cuda":
        raise AssertionError(f"expected a cuda device from init_distributed, got {groups.device}")
    if groups.world_size > 1 and groups.backend != "nccl":
        raise AssertionError(f"expected nccl on CUDA, got {groups.backend}")
    yield groups
    destroy_distributed()
