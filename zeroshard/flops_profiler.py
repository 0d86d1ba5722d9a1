"""DeepSpeed's flops-profiler API (`deepspeed.profiling.flops_profiler`: `get_model_profile`,
`FlopsProfiler`) on torch's own operator counter.

Scripts call it to size a model before training (LLaMA-Factory's scripts/stat_utils/cal_flops.py:
`get_model_profile(model, kwargs=inputs)` -> FLOPs, MACs, parameters). zeroshard does not patch
`torch.nn.functional` as DeepSpeed does: it counts under `torch.utils.flop_counter.FlopCounterMode`,
which sees every matrix product the forward dispatches (linear layers, `matmul`/`bmm`, convolutions,
scaled-dot-product attention), per module. What that means against DeepSpeed's numbers:
- the matrix products agree (2 FLOPs per multiply-accumulate, MACs = half the FLOPs);
- element-wise work (activations, norms, softmax outside SDPA, residual adds) is not counted;
  DeepSpeed adds it to FLOPs (not to MACs), a few percent of a transformer's total.
The config section `flops_profiler` (profiling at a training step from the engine) is not built and
stays refused by name at config load. Imports nothing of ours.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """`1234567` -> "1.23 M" (DeepSpeed's format: value, space, SI prefix)."""
    scale = dict((u, m) for m, u in _UNITS).get(units or "", None)
    if scale is None:
        scale, units = next(((m, u) for m, u in _UNITS if num >= m), (1.0, ""))
    return f"{round(num / scale, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """Parameters with "B" for billions, as DeepSpeed prints them ("6.74 B")."""
    return number_to_string(params, units.replace("B", "G") if units else None, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, precision: int = 2) -> str:
    return f"{seconds * 1e3:.{precision}f} ms" if seconds < 1 else f"{seconds:.{precision}f} s"


class FlopsProfiler:
    """Counts the FLOPs of `model`'s forward passes between `start_profile()` and
    `stop_profile()`, per module (DeepSpeed's class and method names).

    Args:
        model: the module to profile (a zeroshard engine's `module`, or any nn.Module).
        ds_engine: accepted for DeepSpeed's signature; not used.
        recompute_fwd_factor: accepted for DeepSpeed's signature (it scales only DeepSpeed's
            printed training-step estimate); not used.

    Example::

        prof = FlopsProfiler(model)
        prof.start_profile()
        model(batch)
        prof.stop_profile()
        flops, macs = prof.get_total_flops(), prof.get_total_macs()
        prof.end_profile()
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self._counter: FlopCounterMode | None = None
        self._ignored: tuple[type, ...] = ()
        self._by_module: dict[str, int] = {}
        self._started = 0.0
        self._duration = 0.0

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting. `ignore_list`: module classes whose FLOPs are left out."""
        self.reset_profile()
        self._ignored = tuple(ignore_list or ())
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self._started = time.perf_counter()

    def stop_profile(self) -> None:
        """Stop counting; the totals stay readable until `end_profile()`."""
        if self._counter is None:
            return
        self._duration += time.perf_counter() - self._started
        self._counter.__exit__(None, None, None)
        self._by_module = {name: sum(ops.values()) for name, ops in self._counter.get_flop_counts().items()}
        self._counter = None

    def reset_profile(self) -> None:
        self._by_module, self._duration = {}, 0.0

    def end_profile(self) -> None:
        """Stop (if counting) and drop the counts."""
        self.stop_profile()
        self.reset_profile()

    def _module_flops(self, name: str, module: nn.Module) -> int:
        """FLOPs counted inside `module` (named `name` below the root, "" for the root). A container
        the forward never calls itself (a ModuleList) has its children's sum."""
        if not name:
            return self._by_module.get("Global", 0)
        counted = self._by_module.get(f"{self._root_name()}.{name}")
        if counted is not None:
            return counted
        return sum(self._module_flops(f"{name}.{child}", sub) for child, sub in module.named_children())

    def _root_name(self) -> str:
        return type(self.model).__name__

    def get_total_flops(self, as_string: bool = False) -> Any:
        total = self._module_flops("", self.model) - self._ignored_flops()
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> Any:
        macs = self.get_total_flops() // 2  # every counted op is a multiply-accumulate product
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> Any:
        return duration_to_string(self._duration) if as_string else self._duration

    def get_total_params(self, as_string: bool = False) -> Any:
        """The parameters this rank holds (DeepSpeed counts per rank too)."""
        total = sum(p.numel() for p in self.model.parameters())
        return params_to_string(total) if as_string else total

    def _ignored_flops(self) -> int:
        if not self._ignored:
            return 0
        ignored = {n: m for n, m in self.model.named_modules() if n and isinstance(m, self._ignored)}
        outermost = [n for n in ignored if not any(n.startswith(o + ".") for o in ignored if o != n)]
        return sum(self._module_flops(n, ignored[n]) for n in outermost)

    def module_rows(self, module_depth: int = -1) -> list[tuple[str, int, int]]:
        """(name, parameters, FLOPs) per module down to `module_depth` (-1: every depth)."""
        root, rows = self._root_name(), []
        for name, module in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            if module_depth >= 0 and depth > module_depth:
                continue
            rows.append((name or root, sum(p.numel() for p in module.parameters()), self._module_flops(name, module)))
        return rows

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """The totals, then (detailed) every module's parameters and FLOPs to `module_depth`."""
        out: TextIO = open(output_file, "w") if output_file else sys.stdout  # closed below
        try:
            flops = self.get_total_flops()
            print(f"-------------------------- zeroshard flops profiler (profile step {profile_step}) "
                  "--------------------------", file=out)
            print(f"params per rank:          {params_to_string(self.get_total_params())}", file=out)
            print(f"fwd MACs per rank:        {macs_to_string(flops // 2)}", file=out)
            print(f"fwd FLOPs per rank:       {number_to_string(flops)} (matrix products only)", file=out)
            print(f"fwd latency:              {duration_to_string(self._duration)}", file=out)
            if self._duration > 0:
                print(f"fwd FLOPS per rank:       {flops_to_string(flops / self._duration)}", file=out)
            self.print_model_aggregated_profile(module_depth, top_modules, file=out)
            if detailed:
                print("\nmodule, parameters, FLOPs, share of the total:", file=out)
                for name, params, module_flops in self.module_rows(module_depth):
                    share = f"{100 * module_flops / flops:.2f}%" if flops else "0%"
                    print(f"  {name}: {params_to_string(params)}, {number_to_string(module_flops)}FLOPS, {share}",
                          file=out)
        finally:
            if output_file:
                out.close()

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1,
                                       file: TextIO | None = None) -> None:
        """The `top_modules` modules with the most FLOPs at each depth up to `module_depth`."""
        out = file or sys.stdout
        by_depth: dict[int, list[tuple[str, int]]] = {}
        for name, _, flops in self.module_rows(module_depth):
            depth = 0 if name == self._root_name() else name.count(".") + 1
            by_depth.setdefault(depth, []).append((name, flops))
        print(f"top {top_modules} module(s) by FLOPs at each depth:", file=out)
        for depth in sorted(by_depth):
            top = sorted(by_depth[depth], key=lambda r: -r[1])[:top_modules]
            print(f"  depth {depth}: " + ", ".join(f"{n} {number_to_string(f)}FLOPS" for n, f in top), file=out)

    def is_expert_tensor_parallelism_enabled(self) -> bool:
        """zeroshard has no expert tensor parallelism (DeepSpeed's legacy MoE option is refused)."""
        return False


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None,
                      args: Sequence[Any] = [],  # DeepSpeed's literal default; never mutated
                      kwargs: dict[str, Any] = {},  # noqa: B006  DeepSpeed's literal default; never mutated
                      print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Iterable[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """FLOPs, MACs and parameters of one forward (or `generate`) of `model`, after `warm_up`
    unprofiled runs (DeepSpeed's signature and return; strings unless `as_string=False`).

    Args:
        input_shape: a shape for one tensor of ones in the model's dtype and device, the only
            positional argument; else `args` and/or `kwargs` are the inputs.
        mode: "forward" or "generate".

    Raises:
        ValueError: no inputs, or a `mode` other than the two.
    """
    if mode not in ("forward", "generate"):
        raise ValueError(f'get_model_profile: mode {mode!r}; use "forward" or "generate"')
    kwargs, args = dict(kwargs), tuple(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = (torch.ones(input_shape, dtype=dtype, device=device), *args)
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs (the model's inputs)")
    run = model.generate if mode == "generate" else model  # type: ignore[operator]
    prof = FlopsProfiler(model)
    model.eval()
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
