"""The pipeline engine: `train_batch` / `eval_batch` over a PipelineModule, ZeRO inside each stage.

DeepSpeed's `PipelineEngine` API on torch's schedules (pipe/schedules.py). ZeRO partitions over
the data-parallel group of each stage, exactly as without a pipeline: the engine's strategy is
built on the stage's parameters and `MeshGroups.axis("dp")`. What the pipeline adds is here:
the batch's gradients handed to the strategy once (Note: [pipeline gradient capture]) and tied
weights summed over the stages that hold them. The gradient norm over all stages is the strategy's
(its norm group spans the stages: Note: [norm groups] in zero/strategy.py).
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.activation_checkpointing import checkpoint, non_reentrant_checkpoint
from zeroshard.comm import Comm
from zeroshard.comm.groups import subgroup
from zeroshard.errors import NotSupportedError
from zeroshard.pipe.failures import StageGuard, first_line
from zeroshard.pipe.grid import PipelineParallelGrid
from zeroshard.pipe.module import PipelineError, PipelineModule
from zeroshard.pipe.schedules import GradCapture, StageRunner, build_schedule, last_outputs
from zeroshard.runtime.engine import ZeroEngine
from zeroshard.zero.build import DTYPES

if TYPE_CHECKING:
    from zeroshard.comm.topology import MeshGroups
    from zeroshard.config import Config

logger = logging.getLogger("zeroshard")


class PipeParts:
    """What initialize() prepares for a pipeline before the strategy exists (the capture hooks
    must come first), handed to the PipelineEngine."""

    def __init__(self, module: PipelineModule, cfg: Config, mesh: MeshGroups) -> None:
        self.module, self.mesh = module, mesh
        self.pp_comm = Comm(mesh.axis("pp"), label="pp")
        self.world_comm = Comm(mesh.world, label="world")
        self.tied = self._tie_comms(module, mesh)
        for key, comm in self.tied.items():  # equal at start: the first stage's values
            for p in module.tied_parameters(key):
                with torch.no_grad():
                    comm.broadcast(p.data, src=0)
        pipe = cfg.pipeline
        if pipe.activation_checkpoint_interval > 0:
            module.activation_checkpoint_interval = pipe.activation_checkpoint_interval
        if module.activation_checkpoint_func is checkpoint and (not pipe.use_reentrant or module.num_stages > 1):
            # Note: [reentrant recompute in a pipeline]. torch's PipelineStage computes a stage's
            # input gradients with autograd.grad(inputs=...), which reentrant checkpointing refuses;
            # with more than one stage the recompute runs in torch's non-reentrant form instead:
            # the same regions recomputed from the same saved inputs and RNG states, the same numbers.
            module.activation_checkpoint_func = non_reentrant_checkpoint
        params = [p for p in module.parameters() if p.requires_grad]
        named = cfg.accumulation_dtype  # decided once, in config/, for the strategies too
        self.capture = GradCapture(params, accum_dtype=DTYPES[named] if named is not None else None)

    @staticmethod
    def _tie_comms(module: PipelineModule, mesh: MeshGroups) -> dict[str, Comm]:
        """key -> a Comm over the ranks holding `key` at this rank's (dp, tp) coordinate; built on
        every rank for every key in the same order (group creation is collective)."""
        topo, out = mesh.topology, {}
        for key, stages in module.tied_stage_ranks().items():
            lists, used = [], set()
            for dp in range(topo.dp):
                for tp in range(topo.tp):
                    ranks = [topo.rank_at(pp=s, dp=dp, tp=tp) for s in stages]
                    lists.append(ranks)
                    used.update(ranks)
            lists += [[r] for r in range(topo.world_size) if r not in used]
            groups = subgroup(mesh.world, lists)
            if mesh.coord["pp"] in stages:
                out[key] = Comm(groups, label=f"tie:{key}")
        return out


class LoaderPass:
    """A pass over the engine's own data loader (`set_dataloader`), distinguishable from an iterator
    the script set, so that a load that restores the loader's position can start a new pass there."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self) -> "LoaderPass":
        return self

    def __next__(self) -> Any:
        return next(self._it)


class PipelineEngine(ZeroEngine):
    """Trains a PipelineModule: `loss = engine.train_batch(data_iter)`, as DeepSpeed's.

    `forward`, `backward` and `step` are not for scripts (PipelineError, as DeepSpeed): a batch is
    `gradient_accumulation_steps` micro-batches run by the schedule, then one optimizer step.
    """

    pipeline_parallelism = True

    def __init__(self, *, pipe: PipeParts, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pipe = pipe
        module = pipe.module
        self.data_iterator: Iterator[Any] | None = None
        self._micro_losses: list[Tensor] = []
        self.agg_train_loss: Tensor | None = None
        self._runner = self._stage_runner(pipe) if self.num_stages > 1 else None
        if self.training_dataloader is not None:
            self.set_dataloader(self.training_dataloader)
        if self.global_rank_is_zero():
            logger.info(f"pipeline: {self.num_stages} stages x dp {self.world_size} x tp {pipe.mesh.topology.tp}, "
                        f"schedule {self._config.pipeline.schedule}, {self.micro_batches} micro-batches\n"
                        + module.describe_partition())

    def _stage_runner(self, pipe: PipeParts) -> StageRunner:
        """torch's schedule over this rank's stages, guarded (Note: [pipeline failure vote])."""
        module, topo = pipe.module, pipe.mesh.topology
        pp = pipe.mesh.axis("pp")
        guard = StageGuard(pipe.world_comm, lambda r: topo.coord(r)["pp"], len(module.parts) - 1)

        def build(guard: StageGuard) -> Any:
            return build_schedule(self._config.pipeline.schedule, module.chunks(), module.local_chunks,
                                  len(module.parts) - 1, self.device, pp.dp_group, self.micro_batches,
                                  self._loss_for_backward, guard)

        coord = pipe.mesh.coord
        return StageRunner(build, guard, first_rank=topo.rank_at(pp=0, dp=coord["dp"], tp=coord["tp"]),
                           is_first=self.is_first_stage(), micro_batches=self.micro_batches,
                           dynamic=module.dynamic_shape, group=pp.dp_group)

    @property
    def num_stages(self) -> int:
        """The pipeline's stages (DeepSpeed's `engine.num_stages`)."""
        return self._pipe.module.num_stages

    @property
    def stage_id(self) -> int:
        """This rank's stage (DeepSpeed's `engine.stage_id`)."""
        return self._pipe.module.stage_id

    @property
    def micro_batches(self) -> int:
        """Micro-batches per `train_batch`: the config's gradient_accumulation_steps."""
        return self._config.gradient_accumulation_steps

    @property
    def _schedule(self) -> Any:
        """torch's schedule object of the current run (a failed batch rebuilds it), None on one stage."""
        return self._runner.schedule if self._runner is not None else None

    @property
    def grid(self) -> PipelineParallelGrid:
        """DeepSpeed's `engine.grid`: stage, pipeline and tensor slice of this rank, and their groups
        (the engine's own; scripts shard their data with `grid.get_data_parallel_rank()`)."""
        return self._pipe.module._grid

    @property
    def mpu(self) -> PipelineParallelGrid:
        """DeepSpeed's pipeline engine takes the module's grid as its `mpu`."""
        return self.grid

    def global_rank_is_zero(self) -> bool:
        return self._pipe.mesh.world.rank == 0

    # -- DeepSpeed's queries ----------------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def schedule_parts(self) -> tuple[Any, list[Any]]:
        """torch's schedule object and this rank's PipelineStages (None, [] on a single stage),
        for profiling (bench/pipeline.py times their ops)."""
        if self._schedule is None:
            return None, []
        return self._schedule, list(getattr(self._schedule, "_stages", None) or [self._schedule._stage])

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator `train_batch()` draws micro-batches `(inputs, labels)` from."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = LoaderPass(loader)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # -- checkpoints ----------------------------------------------------------------------
    #
    # initialize() gives a pipeline engine checkpoint/pipe_files.py's PipelineCheckpointer: each
    # stage's ZeRO checkpoint in its own directory, DeepSpeed's layer files, a pipeline.json, all
    # keyed by global parameter names, so a load reshards over another pipeline degree, data-parallel
    # degree or ZeRO stage (Note: [pipeline checkpoint layout] there).

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: Mapping[str, Any] | None = {},
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, *,
                        save_optimizer_states: bool = True) -> str:
        """Save every stage's state (every rank calls it); see Note: [pipeline checkpoint layout]."""
        return ZeroEngine.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                          save_optimizer_states=save_optimizer_states)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable[..., Any] | None = None, *,
                        load_rng_state: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Load a pipeline checkpoint saved with any stage count, data-parallel degree and ZeRO stage,
        a checkpoint of the same layers saved without a pipeline, or DeepSpeed 0.19's pipeline
        checkpoint (ZeRO-0/1); every rank calls it. Optimizer state included.

        Raises:
            CheckpointError: the checkpoint holds other layers, or misses a parameter of this stage.
            NotSupportedError: custom_load_fn with a pipeline.
        """
        if custom_load_fn is not None:
            raise NotSupportedError("load_checkpoint(custom_load_fn=...) with a pipeline is not supported yet")
        loaded = ZeroEngine.load_checkpoint(
            self, load_dir, tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            load_rng_state=load_rng_state)
        if load_rng_state and isinstance(self.data_iterator, LoaderPass):
            # The built-in loader's position was restored; the pass begun at construction still starts
            # at the old one, so train_batch() draws from a fresh pass at the saved position.
            self.data_iterator = LoaderPass(self.data_iterator.loader)
        return loaded

    # -- whole-model export -------------------------------------------------------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Tensor] | None:
        """Every stage's whole weights (tensor-parallel pieces joined, ZeRO-3 shards gathered) in one
        state_dict on world rank 0, None elsewhere; every rank calls it. Keys are the PipelineModule's
        own (global layer index, `tied_modules.<key>` once), so `save_16bit_model` writes one file of
        the whole model, where each stage's first rank would otherwise write its own stage over the
        same path. Each stage's dict goes to the first stage one stage at a time over the pp axis."""
        mine = ZeroEngine._zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters)
        pp = self._pipe.pp_comm
        if pp.world_size == 1:
            return mine
        out = dict(mine) if mine is not None and pp.rank == 0 else None
        for stage in range(1, pp.world_size):
            payload = _serialize(mine) if pp.rank == stage and mine is not None else torch.empty(0, dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            pp.broadcast(size, src=stage)
            if int(size) == 0:  # this (dp, tp) coordinate's stages hold no whole copy
                continue
            buf = payload if pp.rank == stage else torch.empty(int(size), dtype=torch.uint8)
            pp.broadcast(buf, src=stage)
            if out is not None:
                out.update(torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True))
        return out

    # -- training ---------------------------------------------------------------------------

    def _loss_for_backward(self, output: Any, target: Any) -> Tensor:
        if self._runner is None:
            loss = self._pipe.module.loss_fn(output, target)
        else:
            loss = self._runner.guard.loss(self._pipe.module.loss_fn, len(self._pipe.module.parts) - 2,
                                           output, target)
        self._micro_losses.append(loss.detach())
        scale = self.get_loss_scale() / self.micro_batches  # DeepSpeed divides by the micro-batch count
        return loss.float() * scale

    def _next_batches(self, count: int) -> tuple[tuple[Tensor, ...] | None, Any]:
        """`count` micro-batches from the iterator, joined along dim 0 (torch splits them back
        into the same micro-batches): the first stage's inputs, the last stage's labels."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if self.data_iterator is None:
            raise PipelineError("train_batch() needs data: pass data_iter=, call set_dataiterator(), or give "
                                "initialize() training_data=")
        batches = [next(self.data_iterator) for _ in range(count)]
        for b in batches:
            if not (isinstance(b, (tuple, list)) and len(b) == 2):
                raise PipelineError(f"each micro-batch must be a pair (inputs, labels), got {type(b).__name__}")
        inputs = [b[0] if isinstance(b[0], (tuple, list)) else (b[0],) for b in batches]
        joined = tuple(torch.cat([x[i] for x in inputs]).to(self.device) for i in range(len(inputs[0])))
        labels = torch.cat([b[1] for b in batches]).to(self.device) if torch.is_tensor(batches[0][1]) else None
        if labels is None and self.is_last_stage():
            raise PipelineError("the labels of a micro-batch must be one tensor (batch dimension first)")
        return joined, labels

    def _draw(self) -> tuple[tuple[Tensor, ...] | None, Any, str | None]:
        """The batch's micro-batches, or with several stages the error drawing them raised (every
        rank raises it after the runner's vote, Note: [pipeline failure vote])."""
        if self._runner is None:
            return (*self._next_batches(self.micro_batches), None)
        try:
            return (*self._next_batches(self.micro_batches), None)
        except Exception as e:
            return None, None, f"drawing the batch raised {type(e).__name__}: {first_line(e)}"

    def _run_local(self, inputs: tuple[Tensor, ...], labels: Tensor, train: bool) -> list[Any]:
        """One stage: the micro-batches one after another (no schedule needed)."""
        outs = []
        for x, y in zip(zip(*(t.chunk(self.micro_batches) for t in inputs)), labels.chunk(self.micro_batches)):
            out = self._pipe.module(x[0] if len(x) == 1 else x)
            outs.append(out)
            if train:
                self._loss_for_backward(out, y).backward()
        return outs

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> Tensor:
        """Train on one batch: `gradient_accumulation_steps` micro-batches through the schedule,
        gradients reduced once, one optimizer step. Every rank calls it.

        Returns:
            The mean loss over the micro-batches and data-parallel ranks, on every stage.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._progress.forward_started()  # the run's clock and tput_timer, as ZeroEngine.forward
        self._micro_losses = []
        inputs, labels, error = self._draw()
        self._strategy.begin_micro_batch(False)
        with self._held():
            if self._runner is None:
                self._run_local(inputs, labels, train=True)  # type: ignore[arg-type]
            else:
                try:
                    self._runner.run("train_batch", inputs, labels if self.is_last_stage() else None, error,
                                     train=True)
                finally:
                    if self._runner.failed:
                        self._pipe.capture.collect()  # the failed batch's gradients: dropped
            grads = self._pipe.capture.collect()
            self._reduce_tied(grads)
            *parts, last = self._pipe.capture.pieces(grads)  # Note: [exact gradient handover]
            for part in parts:
                self._strategy.begin_micro_batch(False)
                self._strategy.begin_delivered_backward()
                self._pipe.capture.deliver(part)
                self._strategy.after_backward()
            self._strategy.begin_micro_batch(True)
            self._strategy.begin_delivered_backward()  # ZeRO-3: start its arrivals afresh
            self._pipe.capture.deliver(last)
            self._strategy.after_backward()
        self._micro.batch_reduced(self.micro_batches)  # the delivered backward reduced the batch's gradients
        loss = self._aggregate_loss()
        self._progress.micro_batch_done(self.micro_batches)  # the batch's samples, for samples/s
        self._optimizer_step(self.micro_batches, micro_steps=self.micro_batches)
        self.agg_train_loss = loss
        return loss

    @contextmanager
    def _held(self) -> Iterator[None]:
        """ZeRO-3: the pipeline stage's parameters gathered for the whole batch (the strategy's hooks
        gather per root forward, which a pipeline stage never calls)."""
        self._strategy.hold_for_batch()
        try:
            yield
        finally:
            self._strategy.release_batch()

    def _reduce_tied(self, grads: dict[int, Tensor]) -> None:
        """Sum tied weights' gradients over the stages holding them (the gradient norm counts them
        at their first holder only: Note: [norm groups] in zero/strategy.py)."""
        for key, comm in self._pipe.tied.items():
            for p in self._pipe.module.tied_parameters(key):
                g = grads.get(id(p))
                if g is None:
                    g = grads[id(p)] = torch.zeros_like(p, dtype=torch.float32 if p.dtype != torch.float64 else p.dtype)
                comm.all_reduce(g)

    def _aggregate_loss(self) -> Tensor:
        """DeepSpeed's reported loss: the mean over micro-batches, averaged over data-parallel
        ranks, sent from the last stage to every stage."""
        value = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage() and self._micro_losses:
            # The last `micro_batches` are the batch's: torch's first step also runs the loss once
            # on placeholder data to infer the backward's shapes.
            value[0] = torch.stack([x.float() for x in self._micro_losses[-self.micro_batches:]]).mean()
            self._comm.all_reduce(value)
            value /= self.world_size
        self._pipe.pp_comm.broadcast(value, src=self.num_stages - 1)
        return value[0].clone()

    # -- evaluation -------------------------------------------------------------------------

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward only over `gradient_accumulation_steps` micro-batches (or `num_micro_batches`).

        Returns:
            The mean loss (every stage when `bcast_loss`), or with `return_logits` the pair
            (loss, the last micro-batch's outputs on the last stage, else None).
        """
        if num_micro_batches not in (None, self.micro_batches):
            raise PipelineError("eval_batch(num_micro_batches=...) other than gradient_accumulation_steps is not "
                                "supported: torch's schedule is built for that micro-batch count")
        if reduce_output not in ("avg", None):
            raise PipelineError(f"eval_batch(reduce_output={reduce_output!r}): expected 'avg' or None")
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        self.module.eval()
        try:
            inputs, labels, error = self._draw()
            with torch.no_grad(), self._held():
                if self._runner is None:
                    outs = self._run_local(inputs, labels, train=False)  # type: ignore[arg-type]
                else:
                    # torch's 1F1B computes the loss even forward-only, so the last stage passes
                    # its labels; the losses returned below are computed from the outputs here.
                    self._runner.run("eval_batch", inputs, labels if self.is_last_stage() else None, error,
                                     train=False)
                    outs = last_outputs(self._schedule)
                    self._micro_losses = []
        finally:
            self.data_iterator = saved
            self.module.train()
        result: Any = None
        if self.is_last_stage():
            per_mb = outs
            if compute_loss:
                per_mb = [self._pipe.module.loss_fn(o, y) for o, y in zip(outs, labels.chunk(self.micro_batches))]
            result = per_mb if reduce_output is None else self._average(per_mb)
        if compute_loss and bcast_loss:
            value = torch.zeros(1, dtype=torch.float32, device=self.device)
            if self.is_last_stage():
                value[0] = result
            self._pipe.pp_comm.broadcast(value, src=self.num_stages - 1)
            result = value[0].clone()
        if return_logits:
            return result, (outs[-1] if self.is_last_stage() and outs else None)
        return result

    def _average(self, values: list[Tensor]) -> Tensor:
        mean = torch.stack([v.float() for v in values]).sum(0) / self.micro_batches
        self._comm.all_reduce(mean)
        return mean / self.world_size


def _serialize(state: Mapping[str, Tensor]) -> Tensor:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
