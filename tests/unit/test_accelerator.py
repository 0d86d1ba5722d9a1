"""zeroshard.accelerator: DeepSpeed's accelerator interface on this machine's device (CPU in CI)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zeroshard
from zeroshard.accelerator import device as device_mod
from zeroshard.accelerator import get_accelerator, set_accelerator

DEEPSPEED_METHODS = (
    "device_name current_device current_device_name set_device device_count is_available synchronize "
    "manual_seed manual_seed_all initial_seed random get_rng_state set_rng_state default_generator "
    "is_bf16_supported is_fp16_supported is_fp64_supported supported_dtypes communication_backend_name "
    "memory_allocated max_memory_allocated reset_peak_memory_stats reset_max_memory_allocated "
    "memory_reserved max_memory_reserved memory_cached max_memory_cached reset_max_memory_cached "
    "memory_stats total_memory available_memory empty_cache pin_memory is_pinned Stream Event stream "
    "current_stream default_stream amp on_accelerator is_synchronized_device use_host_timers "
    "resolves_data_dependency handles_memory_backpressure device lazy_call range_push range_pop "
    "create_graph capture_to_graph replay_graph is_triton_supported get_compile_backend set_compile_backend "
    "visible_devices_envs set_visible_devices_envs export_envs BFloat16Tensor ByteTensor DoubleTensor "
    "FloatTensor HalfTensor IntTensor LongTensor create_op_builder get_op_builder").split()


def test_every_deepspeed_method_exists() -> None:
    acc = get_accelerator()
    missing = [m for m in DEEPSPEED_METHODS if not hasattr(acc, m)]
    assert not missing


def test_reachable_as_attribute_and_import_is_light() -> None:
    assert zeroshard.accelerator.get_accelerator() is get_accelerator()
    code = "import sys, zeroshard.accelerator; print('zeroshard.runtime' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_cpu_behaves_as_deepspeeds_cpu_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    acc = device_mod.Accelerator("cpu")
    assert acc.device_name() == "cpu" and acc.device_name(3) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.current_device() == 1 and acc.is_available() and acc.is_synchronized_device()
    assert acc.communication_backend_name() == "gloo"
    assert acc.on_accelerator(torch.ones(1)) and acc.is_bf16_supported()
    assert acc.amp() is torch.cpu.amp and acc.random() is torch.random
    t = torch.ones(3)
    assert acc.pin_memory(t) is t
    with acc.stream(acc.Stream()):
        pass
    acc.manual_seed(3)
    a = torch.rand(4)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(4)), "manual_seed seeds torch's CPU generator, as DeepSpeed's CPU one"
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    assert acc.FloatTensor([1, 2]).dtype == torch.float32


def test_cpu_memory_measures_the_heap() -> None:
    acc = device_mod.Accelerator("cpu")
    assert "heap" in acc.memory_measures or "resident" in acc.memory_measures
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    big = torch.empty(16 * 2**20, dtype=torch.uint8)  # 16 MiB
    during = acc.memory_allocated()
    del big
    after = acc.memory_allocated()
    assert during - before >= 15 * 2**20 and during - after >= 15 * 2**20
    assert acc.max_memory_allocated() >= during
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < during
    assert acc.memory_reserved() > 0 and acc.max_memory_reserved() >= acc.memory_reserved() - 2**20
    assert set(acc.memory_stats()) >= {"allocated_bytes.all.current", "allocated_bytes.all.peak"}


def test_ds_accelerator_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert device_mod.detect().device_name() == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "warp_drive")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='warp_drive'"):
        device_mod.detect()
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
        with pytest.raises(ValueError, match="no cuda device"):
            device_mod.detect()


def test_set_accelerator_replaces_it() -> None:
    old = get_accelerator()
    try:
        mine = device_mod.Accelerator("cpu")
        set_accelerator(mine)
        assert get_accelerator() is mine
    finally:
        set_accelerator(old)
