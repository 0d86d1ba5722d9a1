"""`Accelerator`: DeepSpeed's accelerator methods over one torch device type, without vendor code.

Every method goes through `torch.accelerator` or the device module torch gives for the type
(`torch.get_device_module("cuda")` is `torch.cuda`, likewise `torch.xpu`, `torch.mps`, `torch.cpu`,
a PrivateUse1 backend's module), so a device torch supports is supported here. The CPU has no
allocator statistics: memory functions then measure the process's heap (see `memory_allocated`).
Imports torch only; zeroshard.comm lazily, for `communication_backend_name`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

_ENV = "DS_ACCELERATOR"


def detect() -> "Accelerator":
    """The accelerator named by `DS_ACCELERATOR`, else the one torch detects, else the CPU."""
    wanted = os.environ.get(_ENV, "").strip().lower()
    if wanted:
        try:
            module = torch.get_device_module(wanted)
        except (RuntimeError, ValueError, AttributeError) as e:
            raise ValueError(f"{_ENV}={wanted!r}: torch knows no such device type ({e}). Use one of "
                             f"cpu, cuda, xpu, mps, or the name of a registered backend, or unset it.") from e
        if wanted != "cpu" and not module.is_available():
            raise ValueError(f"{_ENV}={wanted!r}: torch reports no {wanted} device in this process. "
                             f"Set {_ENV}=cpu or unset it.")
        return Accelerator(wanted)
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return Accelerator(current.type if current is not None else "cpu")


class _Heap:
    """The CPU's stand-in for allocator statistics: bytes malloc has handed out and not freed
    (glibc `mallinfo2`: small blocks + mmapped blocks), where CPU tensors live, with a peak
    sampled at each query since the last reset. Falls back to the resident set size."""

    def __init__(self) -> None:
        self._mallinfo = self._load_mallinfo2()
        self.peak = 0

    @staticmethod
    def _load_mallinfo2() -> Callable[[], Any] | None:
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                "fordblks", "keepcost")]

        try:
            fn = ctypes.CDLL(None).mallinfo2
        except (OSError, AttributeError):
            return None
        fn.restype = MallInfo2
        return fn

    @property
    def measures(self) -> str:
        return ("heap bytes in use (glibc mallinfo2: tensors plus Python objects)" if self._mallinfo
                else "resident set size of the process")

    def in_use(self) -> int:
        if self._mallinfo is not None:
            info = self._mallinfo()
            now = int(info.uordblks + info.hblkhd)
        else:
            now = rss_bytes()
        self.peak = max(self.peak, now)
        return now

    def reset_peak(self) -> None:
        self.peak = 0
        self.in_use()


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Accelerator:
    """DeepSpeed's accelerator interface (`deepspeed.accelerator.get_accelerator()`) for one device type.

    Device indices default to the current device. On the CPU, as in DeepSpeed, `device_name()`
    is "cpu" whatever the index, `current_device()` is the local rank, streams and events are
    torch.cpu's no-op ones, and `pin_memory` returns its argument (there is no device to pin for).
    Memory functions on the CPU measure `memory_measures` (no allocator statistics exist there).

    Args:
        device_type: a torch device type ("cuda", "cpu", "xpu", "mps", ...).
    """

    def __init__(self, device_type: str) -> None:
        self._name = device_type
        self._module: ModuleType = torch.get_device_module(device_type)
        self._heap = _Heap() if device_type == "cpu" else None
        self._ranges: list[contextlib.AbstractContextManager[Any]] = []
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    @property
    def _is_cpu(self) -> bool:
        return self._name == "cpu"

    # -- device ---------------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        """True when work runs synchronously with the host (the CPU)."""
        return self._is_cpu

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        """"cuda" or "cuda:1" (with an index); always "cpu" on the CPU."""
        if device_index is None or self._is_cpu:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """The device module's `device(i)` context manager; None where it has none (CPU)."""
        ctx = getattr(self._module, "device", None)
        return None if self._is_cpu or ctx is None else ctx(device_index)

    def set_device(self, device_index: int) -> None:
        if not self._is_cpu:
            torch.accelerator.set_device_index(device_index)

    def current_device(self) -> int:
        """The current device index; on the CPU the local rank, as DeepSpeed's CPU accelerator."""
        if self._is_cpu:
            return int(os.environ.get("LOCAL_RANK", 0))
        return torch.accelerator.current_device_index()

    def current_device_name(self) -> str:
        return self._name if self._is_cpu else f"{self._name}:{self.current_device()}"

    def device_count(self) -> int:
        """Devices of this type; on the CPU `LOCAL_SIZE` / `LOCAL_WORLD_SIZE` if set, else 1."""
        if self._is_cpu:
            return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
        return int(self._module.device_count())

    def is_available(self) -> bool:
        return True if self._is_cpu else bool(self._module.is_available())

    def synchronize(self, device_index: int | None = None) -> None:
        if not self._is_cpu:
            torch.accelerator.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """torch.distributed's default backend for this device type ("nccl", "gloo", "xccl", ...)."""
        from zeroshard.comm.groups import default_backend_name

        return default_backend_name(self._name)

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        lazy = getattr(self._module, "_lazy_call", None)
        return lazy(callback) if lazy is not None and not self._is_cpu else callback()

    # -- random numbers -------------------------------------------------------------------

    def random(self) -> ModuleType:
        return torch.random

    def _rng_module(self) -> ModuleType:
        # torch.cpu has no RNG functions: the CPU generator is torch's default one.
        return torch if self._is_cpu or not hasattr(self._module, "manual_seed") else self._module

    def get_rng_state(self, device_index: int | None = None) -> Tensor:
        if self._is_cpu:
            return torch.get_rng_state()
        return self._module.get_rng_state(self.device_name(device_index) if device_index is not None else self._name)

    def set_rng_state(self, new_state: Tensor, device_index: int | None = None) -> None:
        if self._is_cpu:
            torch.set_rng_state(new_state)
        else:
            self._module.set_rng_state(new_state, self.device_name(device_index) if device_index is not None
                                       else self._name)

    def manual_seed(self, seed: int) -> Any:
        """Seed this device's generator (on the CPU: torch's default generator, as DeepSpeed)."""
        return self._rng_module().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        mod = self._rng_module()
        return getattr(mod, "manual_seed_all", mod.manual_seed)(seed)

    def initial_seed(self) -> int:
        return int(self._rng_module().initial_seed())

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        if self._is_cpu:
            return torch.default_generator
        gens = self._module.default_generators
        return gens[self.current_device() if device_index is None else device_index]

    # -- streams and events ---------------------------------------------------------------

    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return getattr(self._module, "Stream", torch.Stream)

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return getattr(self._module, "Event", torch.Event)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making `stream` current (a no-op for None or on the CPU)."""
        if stream is None or self._is_cpu:
            return contextlib.nullcontext()
        return self._module.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.accelerator.current_stream(device_index) if not self._is_cpu else self._module.current_stream()

    def default_stream(self, device_index: int | None = None) -> Any:
        fn = getattr(self._module, "default_stream", None)
        return fn(device_index) if fn is not None else self.current_stream(device_index)

    def is_current_stream_capturing(self) -> bool:
        fn = getattr(self._module, "is_current_stream_capturing", None)
        return bool(fn()) if fn is not None else False

    # -- memory ---------------------------------------------------------------------------

    @property
    def memory_measures(self) -> str:
        """What the memory functions report on this device."""
        if self._heap is not None:
            return self._heap.measures
        return f"{self._name} caching allocator statistics (torch.accelerator.memory_*)"

    def empty_cache(self) -> None:
        if not self._is_cpu:
            torch.accelerator.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors on the device; on the CPU the process's heap in use (`memory_measures`)."""
        if self._heap is not None:
            return self._heap.in_use()
        return int(torch.accelerator.memory_allocated(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of `memory_allocated` since the last reset; on the CPU the peak of the values seen
        by calls to the memory functions (the heap has no peak counter)."""
        if self._heap is not None:
            self._heap.in_use()
            return self._heap.peak
        return int(torch.accelerator.max_memory_allocated(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._heap is not None:
            self._heap.reset_peak()
        else:
            torch.accelerator.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes the allocator holds; on the CPU the process's resident set size."""
        if self._heap is not None:
            return rss_bytes()
        return int(torch.accelerator.memory_reserved(device_index))

    memory_cached = memory_reserved

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak reserved bytes; on the CPU the process's peak resident set size (never reset)."""
        if self._heap is not None:
            import resource

            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
            return max(peak, rss_bytes())  # the kernel's peak may lag the current value
        return int(torch.accelerator.max_memory_reserved(device_index))

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._heap is not None:
            return {"allocated_bytes.all.current": self.memory_allocated(),
                    "allocated_bytes.all.peak": self.max_memory_allocated(),
                    "reserved_bytes.all.current": self.memory_reserved(),
                    "reserved_bytes.all.peak": self.max_memory_reserved()}
        return dict(torch.accelerator.memory_stats(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        """Device memory; on the CPU the machine's physical memory."""
        if self._is_cpu:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(torch.accelerator.get_memory_info(device_index)[1])

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory; on the CPU the machine's available physical memory."""
        if self._is_cpu:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return int(torch.accelerator.get_memory_info(device_index)[0])

    # -- pinned host memory ---------------------------------------------------------------

    def pin_memory(self, tensor: Tensor, align_bytes: int = 1, **_: Any) -> Tensor:
        """`tensor` in page-locked memory for fast copies to the device; unchanged on the CPU."""
        return tensor if self._is_cpu or tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: Tensor) -> bool:
        return False if self._is_cpu else bool(tensor.is_pinned())

    def on_accelerator(self, tensor: Tensor) -> bool:
        """True when `tensor` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # -- data types -----------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        if self._is_cpu:
            return True
        fn = getattr(self._module, "is_bf16_supported", None)
        return bool(fn()) if fn is not None else True

    def is_fp16_supported(self) -> bool:
        """On the CPU, whether oneDNN has fp16 kernels for this processor (DeepSpeed's test)."""
        if self._is_cpu:
            try:
                return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except (AttributeError, RuntimeError):
                return False
        return True

    def is_fp64_supported(self) -> bool:
        return self._name != "mps"

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def amp(self) -> ModuleType | None:
        """The device module's `amp` (torch.cuda.amp, torch.cpu.amp)."""
        return getattr(self._module, "amp", None)

    def _tensor_factory(self, dtype: torch.dtype) -> Callable[..., Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._tensor_factory(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor_factory(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor_factory(torch.float64))
    FloatTensor = property(lambda self: self._tensor_factory(torch.float32))
    HalfTensor = property(lambda self: self._tensor_factory(torch.float16))
    IntTensor = property(lambda self: self._tensor_factory(torch.int32))
    LongTensor = property(lambda self: self._tensor_factory(torch.int64))

    # -- profiling ranges, graphs, compile ------------------------------------------------

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """Open a named profiler range (torch.profiler.record_function, any device)."""
        ctx = torch.profiler.record_function(msg)
        ctx.__enter__()
        self._ranges.append(ctx)

    def range_pop(self, domain: Any = None) -> None:
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def create_graph(self) -> Any:
        return None if self._is_cpu else torch.accelerator.Graph()

    def capture_to_graph(self, graph: Any, pool: Any = None,
                         stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        if graph is None:
            return contextlib.nullcontext()
        return self._module.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        if graph is not None:
            graph.replay()

    def is_triton_supported(self) -> bool:
        return self._name in ("cuda", "xpu") and importlib.util.find_spec("triton") is not None

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    # -- launcher environment -------------------------------------------------------------

    def visible_devices_envs(self) -> list[str]:
        """Environment variables restricting the visible devices (CUDA_VISIBLE_DEVICES, ...)."""
        return {"cuda": ["CUDA_VISIBLE_DEVICES"], "xpu": ["ZE_AFFINITY_MASK"],
                "hpu": ["HABANA_VISIBLE_MODULES"], "npu": ["ASCEND_RT_VISIBLE_DEVICES"]}.get(
                    self._name, ["CUDA_VISIBLE_DEVICES"])

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    # -- DeepSpeed's op builders ----------------------------------------------------------

    def op_builder_dir(self) -> str:
        raise NotImplementedError("zeroshard has no DeepSpeed op builders: its kernels are torch's own")

    def create_op_builder(self, op_name: str) -> None:
        """None: zeroshard builds no DeepSpeed C++/CUDA ops (callers treat None as unavailable)."""
        return None

    def get_op_builder(self, class_name: str) -> None:
        return None

