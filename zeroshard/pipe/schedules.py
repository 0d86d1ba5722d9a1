"""The schedules (torch.distributed.pipelining) and the gradients they leave behind.

torch's `PipelineStage` runs each local stage; its schedules decide the order of forwards and
backwards. Two things of torch's do not fit ZeRO, and this module supplies them:

- Note: [pipeline gradient capture]. A ZeRO strategy folds each gradient into its buffers from a
  post-accumulate-grad hook, and reduces at the accumulation boundary. In a pipeline schedule the
  boundary is not a backward call (1F1B interleaves the last backwards with nothing; the
  zero-bubble schedules compute weight gradients with `autograd.grad` and add them into
  `param.grad` themselves, so no hook fires). So every micro-batch's gradient is kept in
  `param.grad`-like accumulators here (`GradCapture`), and after the schedule the engine hands the
  batch's gradient to the strategy in one boundary backward: one reduction per batch, after the
  last micro-batch, at every ZeRO stage and for every schedule.
- Note: [exact gradient handover]. Under bf16/fp16 the micro-batches' gradients are summed here
  in `data_types.grad_accum_dtype` (fp32 unless the config says otherwise), as the strategies
  sum them without a pipeline. The handover is a backward into the (bf16/fp16) parameters, which
  would round that sum to 8 (11) bits: instead it is split into three parameter-dtype parts,
  hi = round(g), mid = round(g - hi), lo = round(g - hi - mid), which together hold all 24 bits,
  and delivered as three micro-batches (lo, mid: accumulated; hi: the boundary, reduced), so the
  strategy's fp32 accumulator holds the fp32 sum (to the last bit barring underflow of `lo`).
  At ZeRO-3, which reduces every micro-batch, that is three reduce-scatters per batch.
- The loss: torch's `scale_grads` divides by the micro-batch count after the schedule; the engine
  divides the loss instead (DeepSpeed's gradient-accumulation scaling) and keeps the unscaled
  per-micro-batch losses for DeepSpeed's reported mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.errors import ConfigError
from zeroshard.pipe.failures import GuardedChunk, StageGuard, first_line, is_peer_lost, shape_key
from zeroshard.pipe.module import PipelineError

SINGLE_STAGE = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
MULTI_STAGE = {"interleaved_1f1b": "ScheduleInterleaved1F1B",
               "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}


class GradCapture:
    """Keeps each parameter's gradient out of the ZeRO strategy until the batch's schedule ends.

    Its hooks must be registered before the strategy's (hooks on a tensor run in registration
    order): it takes `param.grad` first and leaves None, which the strategies skip.
    See Note: [pipeline gradient capture].
    """

    def __init__(self, params: Sequence[nn.Parameter], accum_dtype: torch.dtype | None = None) -> None:
        self._params = list(params)
        self._accum_dtype = accum_dtype
        self._grads: dict[int, Tensor] = {}
        self.passing = False  # True while the boundary backward delivers to the strategy
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._take)

    def _take(self, param: Tensor) -> None:
        if self.passing or param.grad is None:
            return
        grad = param.grad if self._accum_dtype is None else param.grad.to(self._accum_dtype)
        held = self._grads.get(id(param))
        self._grads[id(param)] = grad if held is None else held.add_(grad)
        param.grad = None

    def collect(self) -> dict[int, Tensor]:
        """id(param) -> this batch's summed gradient (captured plus what torch added to .grad)."""
        out = self._grads
        self._grads = {}
        for p in self._params:
            if p.grad is not None:  # the zero-bubble weight pass writes .grad directly
                held = out.get(id(p))
                g = p.grad if self._accum_dtype is None else p.grad.to(self._accum_dtype)
                out[id(p)] = g if held is None else held.add_(g)
                p.grad = None
        return out

    def pieces(self, grads: dict[int, Tensor]) -> list[dict[int, Tensor]]:
        """The deliveries that hand `grads` over without rounding (Note: [exact gradient handover]):
        one when the gradients are in their parameters' dtype, else three in the parameter dtype
        (smallest first) whose sum, in the strategy's accumulation dtype, is the captured sum."""
        params = {id(p): p for p in self._params}
        if all(g.dtype == params[i].dtype for i, g in grads.items()):
            return [grads]
        hi, mid, lo = {}, {}, {}
        for i, g in grads.items():
            dtype = params[i].dtype
            hi[i] = g.to(dtype)
            rest = g - hi[i].to(g.dtype)
            mid[i] = rest.to(dtype)
            lo[i] = (rest - mid[i].to(g.dtype)).to(dtype)
        return [lo, mid, hi]

    def deliver(self, grads: dict[int, Tensor]) -> None:
        """One backward that accumulates `grads` into the parameters, firing the strategy's hooks."""
        params = [p for p in self._params if id(p) in grads]
        if not params:
            return
        self.passing = True
        try:
            torch.autograd.backward(params, [grads[id(p)].to(p.dtype) for p in params])
        finally:
            self.passing = False


def build_schedule(name: str, chunks: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int,
                   device: torch.device, group: Any, n_microbatches: int,
                   loss_fn: Callable[[Any, Tensor], Tensor], guard: StageGuard | None = None) -> Any:
    """torch's PipelineStages for this rank's chunks and the schedule `name` running them.

    Raises:
        ConfigError: torch refuses the micro-batch count for the schedule (config/pipeline.py
            refused a one-stage-per-rank schedule with several stages per rank at initialize).
    """
    from torch.distributed import pipelining

    if guard is not None:
        chunks = [GuardedChunk(chunk, s, guard) for chunk, s in zip(chunks, stage_ids)]
    stages = [pipelining.PipelineStage(chunk, stage_index=s, num_stages=num_stages, device=device, group=group)
              for chunk, s in zip(chunks, stage_ids)]
    try:
        if name in SINGLE_STAGE:  # one stage per rank: config/pipeline.py checked it at initialize
            cls = getattr(pipelining, SINGLE_STAGE[name])
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        cls = getattr(pipelining, MULTI_STAGE[name])
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f'pipeline.schedule: "{name}" with {len(stages)} stage(s) per rank and '
                          f"{n_microbatches} micro-batches (gradient_accumulation_steps) is refused by "
                          f"torch: {e}") from e


def last_outputs(schedule: Any) -> list[Any]:
    """The last stage's per-micro-batch outputs of the schedule's latest step (empty elsewhere)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        if stage.is_last:
            return list(stage.output_chunks)
    return []


class StageRunner:
    """This rank's stages under torch's schedule, every failure named on every rank
    (Note: [pipeline failure vote]); with `dynamic` one schedule per input shape."""

    def __init__(self, build: Callable[[StageGuard], Any], guard: StageGuard, *, first_rank: int, is_first: bool,
                 micro_batches: int, dynamic: bool, group: Any) -> None:
        self._build, self.guard = build, guard
        self._first_rank, self._is_first = first_rank, is_first
        self._micro_batches, self._dynamic, self._group = micro_batches, dynamic, group
        self._schedules: dict[int, Any] = {}
        self._key = 0
        self.schedule = build(guard)
        self.failed = False
        """Whether the latest batch raised (its gradients are to be dropped)."""

    def run(self, what: str, inputs: tuple[Tensor, ...] | None, labels: Tensor | None, error: str | None, *,
            train: bool) -> None:
        """One batch through the schedule (`train`: forward and backward, else forward only).

        Raises:
            PipelineError: on every rank, when any rank could not draw its batch, a stage raised,
                an activation changed shape or dtype, or a stage's process is gone.
        """
        self.failed = True
        mine = shape_key(inputs, self._micro_batches) if self._is_first else 0
        key = self.guard.agree(what, error, mine)[self._first_rank]
        if self._key == 0:
            self._key = key
            self._schedules[key] = self.schedule
        elif key != self._key:
            if not self._dynamic:
                detail = f" (this batch: {describe_inputs(inputs)})" if self._is_first else ""
                raise PipelineError(
                    f"pipeline {what}: the batch's input shapes or dtypes changed since the first batch on the "
                    f"pipeline whose stage 0 is rank {self._first_rank}{detail}, and every stage was set up for "
                    "the first batch's activations: build the PipelineModule with dynamic_shape=True, or give "
                    "every batch the same shapes (pad, or drop the last partial batch)")
            if key not in self._schedules:
                self._schedules[key] = self._build(self.guard)
            self._key, self.schedule = key, self._schedules[key]
        self.guard.key = key
        args = inputs if self._is_first else ()
        try:
            if train:
                self.schedule.step(*(args or ()), target=labels, return_outputs=False)
            else:
                self.schedule.eval(*(args or ()), target=labels)
        except PipelineError:
            raise
        except Exception as e:
            if is_peer_lost(e):
                raise PipelineError(self.guard.lost(what, e)) from e
            _abort(self._group)  # outside the guarded forward (e.g. a backward): release the peers
            rank, stage = self.guard.world.rank, self.guard.stage_of_rank(self.guard.world.rank)
            raise PipelineError(f"pipeline {what} failed on rank {rank} (stage {stage}): {type(e).__name__}: "
                                f"{first_line(e)} (its pipeline group was aborted so that the other stages "
                                "stop waiting for it)") from e
        self.guard.settle(what)
        self.failed = False


def describe_inputs(inputs: tuple[Tensor, ...] | None) -> str:
    return ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs or ())


def _abort(group: Any) -> None:
    try:
        group.abort()
    except Exception:
        pass
