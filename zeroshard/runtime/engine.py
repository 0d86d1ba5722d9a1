"""The training engine: forward, backward, step, with one ZeRO strategy doing the partitioning.

The engine owns the step as one unit (Note: [one step]): loss scaling, gradient reduction
(through the strategy), unscale + clip, the optimizer, the loss scaler and the lr scheduler.
A step skipped for fp16 overflow therefore never advances the scheduler. The engine never
asks which ZeRO stage it runs; see zero/strategy.py for the protocol it drives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.errors import LossError, NotSupportedError, UsageError
from zeroshard.moe.prepare import routing_telemetry
from zeroshard.optim.factory import optimizer_state_bytes
from zeroshard.runtime.autocast import autocast_dtype, cast_inputs_half, forward_context
from zeroshard.runtime.compile import CompileStats, compile_model
from zeroshard.runtime.direct_backward import DirectBackward, func_transforms
from zeroshard.runtime.engine_accumulation import AccumulationControl
from zeroshard.runtime.engine_checkpoints import EngineCheckpoints
from zeroshard.runtime.engine_progress import EngineProgress
from zeroshard.runtime.engine_queries import EngineQueries
from zeroshard.runtime.engine_state import Phase
from zeroshard.runtime.inference import generate_tokens, hf_generate
from zeroshard.runtime.loss_scaler import LossScaler
from zeroshard.runtime.model_export import ModelExport
from zeroshard.runtime.monitor import MetricSink, Timers
from zeroshard.runtime.param_access import forget_engine, register_engine
from zeroshard.runtime.zero_optimizer import ZeroOptimizer
from zeroshard.sequence.sp_setup import gradient_factor
from zeroshard.zero.strategy import GradStats, ModelStateBytes, ZeroStrategy

if TYPE_CHECKING:
    from zeroshard.comm import Comm, ProcessGroups
    from zeroshard.comm.parallel_dims import ParallelDims
    from zeroshard.config import Config
    from zeroshard.moe.balance import ExpertBiasBalance
    from zeroshard.runtime.throughput import ThroughputTimer
    from zeroshard.tensor_parallel.setup import ParallelGroups

logger = logging.getLogger("zeroshard")


class _KeptByProgress:
    """An engine attribute kept by its `EngineProgress` (runtime/engine_progress.py), read and
    written through (a checkpoint load sets the counters)."""

    def __init__(self, name: str | None = None) -> None:
        self._name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name

    def __get__(self, engine: "ZeroEngine | None", owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine._progress, self._name)

    def __set__(self, engine: "ZeroEngine", value: Any) -> None:
        setattr(engine._progress, self._name, value)


class ZeroEngine(AccumulationControl, EngineQueries, ModelExport, EngineCheckpoints, nn.Module):
    """Wraps a model for data-parallel ZeRO training. Built by `zeroshard.initialize`.

    Use it as DeepSpeed's engine::

        loss = engine(batch)          # the model's forward
        engine.backward(loss)         # scaled, accumulated, reduced in buckets
        engine.step()                 # optimizer + scheduler at the accumulation boundary

    Attributes:
        config: the config as the user gave it (a dict; a file is read into one), like
            DeepSpeed's `engine.config`. The typed, validated Config is `engine.zs_config`.
        module: the wrapped model (in the training dtype).
        optimizer: DeepSpeed's ZeRO optimizer surface (runtime/zero_optimizer.py) over the
            torch optimizer stepping on the master parameters (`engine.optimizer.optimizer`), or None.
        lr_scheduler: the lr scheduler, stepped after every applied optimizer step, or None.
        global_steps: optimizer steps taken, skipped (overflow) steps included.
        global_samples: samples consumed over all ranks.
        micro_steps: micro-batches processed by this rank.
        skipped_steps: steps skipped because of an fp16 overflow.

    A public name the engine does not have is looked up on the wrapped model, as DeepSpeed's
    engine does (`engine.generate(...)`, `engine.gradient_checkpointing_enable()`, a client
    attribute such as `engine.id`); names starting with "_" are not, so that the engine's own
    private state is never silently taken from the model.
    """

    expert_balance: "ExpertBiasBalance | None" = None
    """`expert_parallel.load_balance_coeff`'s router-bias updates (moe/balance.py); set by `initialize`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # the engine's own parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("_") or not hasattr(module, name):
                raise
        return getattr(module, name)

    def __init__(
        self,
        *,
        module: nn.Module,
        config: "Config",
        groups: "ProcessGroups",
        comm: "Comm",
        strategy: ZeroStrategy,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        loss_scaler: LossScaler | None,
        sinks: list[MetricSink],
        training_dataloader: Any = None,
        raw_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self._config = config
        self.config: Mapping[str, Any] = raw_config if raw_config is not None else {}
        self.optimizer = None if optimizer is None else ZeroOptimizer(
            optimizer, loss_scaler=loss_scaler, parameter_offload=strategy.parameter_offload(),
            states=(self.offload_states, self.reload_states))
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self._groups, self._comm, self._strategy = groups, comm, strategy
        self._loss_scaler = loss_scaler
        self.timers = Timers(groups.device, enabled=config.wall_clock_breakdown)
        self._progress = EngineProgress(
            comm=comm, device=groups.device, sinks=sinks, timers=self.timers,
            micro_batch_samples=config.train_micro_batch_size_per_gpu * groups.world_size,
            train_batch_size=config.train_batch_size, steps_per_print=config.steps_per_print,
            routing=routing_telemetry(module))
        self._last_grad_stats: GradStats | None = None
        self._step_applied = False
        self._autocast_dtype = autocast_dtype(config.torch_autocast, groups.device.type)
        # _micro: Note: [micro-batch phases] in runtime/engine_state.py
        self._init_accumulation(config.managed_gradient_accumulation)
        self._direct = DirectBackward(self._begin_direct_backward, self._end_direct_backward)
        self._publish_loss_scale(overflow=False)
        register_engine(self, module)

    # -- counters (owned by EngineProgress; checkpoints restore them) ---------------------

    global_steps = _KeptByProgress()
    global_samples = _KeptByProgress()
    micro_steps = _KeptByProgress()
    skipped_steps = _KeptByProgress()
    last_loss = _KeptByProgress()
    """Mean loss over ranks at the last progress report (None before one)."""
    last_samples_per_s = _KeptByProgress()
    """Throughput over all ranks between the last two progress reports (None before one)."""
    _sinks = _KeptByProgress("sinks")

    @property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer (`avg_samples_per_sec()`, `update_epoch_count()`, ...):
        started at each forward, stopped at each `step()` (runtime/throughput.py)."""
        return self._progress.tput_timer

    def summary(self) -> dict[str, Any]:
        """End-of-run figures (steps, samples, final loss, throughput, peak memory per rank);
        every rank must call it (peak memory is gathered)."""
        return self._progress.summary()

    def print_summary(self) -> dict[str, Any]:
        """`summary()`, logged on one line; closes the monitor sinks. Every rank must call it."""
        return self._progress.print_summary()

    def _report(self) -> None:
        lrs = self.get_lr()
        self._progress.report(lr=lrs[0] if lrs else 0.0, loss_scale=self.get_loss_scale(),
                              grad_norm=self.get_global_grad_norm(), model_states=self.model_state_bytes())

    # -- collaborators, read-only (library code: safe_* helpers, generation, the CLI) -----

    @property
    def zs_config(self) -> "Config":
        """The typed, validated Config (`engine.config` is the dict the user passed)."""
        return self._config

    @property
    def comm(self) -> "Comm":
        """The data-parallel group's collectives (zeroshard.comm.Comm)."""
        return self._comm

    @property
    def strategy(self) -> ZeroStrategy:
        """The ZeRO strategy partitioning this engine's states (zero/strategy.py)."""
        return self._strategy

    parallel: "ParallelGroups | None" = None
    """The data- and model-parallel groups (zeroshard/tensor_parallel/setup.py); set by `zeroshard.initialize`."""
    dims: "ParallelDims | None" = None
    """The sizes of every parallel dimension (comm/parallel_dims.py), as `initialize` decided them."""

    @property
    def grads_ready(self) -> bool:
        """Reduced gradients wait for `step()`: between the backward that ends an optimizer
        step and the step (when `safe_get_full_grad` and friends can read them)."""
        return self._micro.grads_ready

    # -- DeepSpeed-compatible queries (the accumulation controls: runtime/engine_accumulation.py)

    def torch_autocast_enabled(self) -> bool:
        """The `torch_autocast` section is on: the forward runs under torch.autocast."""
        return self._autocast_dtype is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self._autocast_dtype

    def get_loss_scale(self) -> float:
        return self._loss_scaler.loss_scale if self._loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        return self.get_loss_scale()

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The fp16 dynamic loss scaler, None under fp32/bf16."""
        return self._loss_scaler

    def _publish_loss_scale(self, overflow: bool) -> None:
        # engine.optimizer reads the scale from the scaler; the overflow it is told.
        if self.optimizer is not None:
            self.optimizer.overflow = overflow

    def get_global_grad_norm(self) -> float | None:
        """Pre-clip L2 norm of the averaged, unscaled gradient at the last step."""
        return None if self._last_grad_stats is None else self._last_grad_stats.norm

    def was_step_applied(self) -> bool:
        """Whether the last `step()` call stepped the optimizer: False inside gradient accumulation
        (not the boundary) and for a step skipped on an fp16 overflow, as in DeepSpeed."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Gradients live in the strategy's buffers and are reset by `step()`; nothing to do."""

    def destroy(self) -> None:
        """Forget this engine's parameters in `zeroshard.utils.safe_*` look-ups (DeepSpeed's
        `destroy` releases its optimizer's buffers). The engine stays usable for inference.
        An asynchronous save in flight is published first, and an optimizer step running late
        (the delayed update) finishes (collective: every rank calls it)."""
        self.wait_for_checkpoint()
        self._strategy.settle_step()
        forget_engine(self)

    @property
    def device(self) -> torch.device:
        return self._groups.device

    @property
    def rank(self) -> int:
        return self._groups.rank

    @property
    def world_size(self) -> int:
        return self._groups.world_size

    def model_state_bytes(self) -> list[ModelStateBytes]:
        """Model-state bytes held by this rank, by category and home (device / CPU)."""
        opt = optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0
        return self._strategy.model_state_bytes(opt)

    def transient_bytes(self) -> int:
        """Bytes this rank keeps between steps beyond its model states (gradient staging pool)."""
        return self._strategy.transient_bytes()

    def describe_state(self) -> str:
        """What the engine holds: strategy, parameters, optimizer, scheduler, loss scaler."""
        n_params = sum(p.numel() for p in self.module.parameters())
        lines = [
            f"strategy: {self._strategy!r}",
            f"module parameters: {n_params} elements, dtype {next(self.module.parameters()).dtype}",
            f"optimizer: {self.optimizer!r}",
            f"lr scheduler: {type(self.lr_scheduler).__name__ if self.lr_scheduler else None}",
            f"loss scaler: {self._loss_scaler.state_dict() if self._loss_scaler else None}",
        ]
        return "\n".join(lines)

    # -- training -------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_states("forward()")
        differentiating = bool(func_transforms() & {"Grad", "Jvp"})  # torch.func.grad, jacrev, jvp, ...
        if differentiating and self._config.zero_optimization.stage == 3:
            raise NotSupportedError(
                "torch.func.grad / jacrev / jvp through a ZeRO stage-3 engine is not supported: stage 3 gathers "
                "and releases the parameters in place around each unit in forward and backward, which a "
                "differentiating transform forbids. Use stage 0, 1 or 2 for the transform (torch.func.vmap "
                "alone works at stage 3).")
        self._progress.forward_started()
        self.timers.start("forward")
        if self._config.fp16.auto_cast:  # DeepSpeed casts the positional inputs only
            args = cast_inputs_half(args)
        with forward_context(self._autocast_dtype, self.device.type):  # torch_autocast section
            out = self.module(*args, **kwargs)
        # A training forward must be followed by engine.backward before step(): see step(). A
        # forward inside torch.func.grad & co. is the transform's (its gradients are returned to
        # the caller, never accumulated): not a micro-batch.
        training = torch.is_grad_enabled() and self.module.training and not differentiating
        self._micro.forward(training)
        if training:  # a direct loss.backward() is a micro-batch too
            self._direct.attach(out)
        self.timers.stop("forward")
        return out

    def scale(self, loss: Tensor) -> Tensor:
        """The loss multiplied by the current loss scale, for a direct backward (DeepSpeed's
        `engine.scale(loss).backward()`; needed with fp16 loss scaling). The division by
        gradient_accumulation_steps happens in the backward, as for a bare `loss.backward()`."""
        if loss.dim() != 0 or not loss.requires_grad:
            raise LossError(f"engine.scale expects the loss as a scalar tensor with a graph, got shape "
                            f"{tuple(loss.shape)} (requires_grad={loss.requires_grad}); reduce it first (e.g. "
                            "loss.mean()), or call output.backward(grad) yourself for a non-scalar output")
        self._micro.scaled()
        scale = self.get_loss_scale()
        return loss.float() * scale if scale != 1.0 else loss

    def _begin_direct_backward(self) -> float:
        """Prologue of a `backward()` the script called itself (runtime/direct_backward.py)."""
        if self._loss_scaler is not None and self._micro.phase is not Phase.SCALED:
            raise RuntimeError(
                "loss.backward() without engine.backward: this config scales the loss (fp16), so the "
                "gradients would not be scaled; call engine.backward(loss), or "
                "engine.scale(loss).backward() (as DeepSpeed requires)")
        reduces = self._micro.reduces(self.micro_steps, self._config.gradient_accumulation_steps)
        self._micro.begin_backward(reduces)
        self._strategy.begin_micro_batch(reduces)
        self.timers.start("backward")
        return self._sequence_factor() / self._config.gradient_accumulation_steps

    def _sequence_factor(self) -> float:
        """sp with sequence parallelism: ZeRO's mean then sums the sequence-parallel shares
        (Note: [sequence-parallel gradients] in sequence/sp_setup.py); 1 otherwise."""
        parallel = self.parallel
        if parallel is None:
            return 1.0
        return gradient_factor(self._config, parallel.sequence, parallel.sequence_sum)

    def _end_direct_backward(self) -> None:
        self.timers.stop("backward")
        self._strategy.after_backward()
        self._micro.end_backward()

    def backward(self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Tensor:
        """Backward of a micro-batch's loss, divided by gradient_accumulation_steps.

        Gradients accumulate locally; on the last micro-batch of a step they are reduced in
        buckets as they become ready.

        Args:
            loss: the micro-batch's scalar loss.
            retain_graph: passed to `Tensor.backward`.
            scale_wrt_gas: divide the loss (and so the gradients) by
                `gradient_accumulation_steps`; False backpropagates the loss as it is.

        Returns:
            The loss divided by gradient_accumulation_steps (when `scale_wrt_gas`), as DeepSpeed.
        """
        self._require_states("backward()")
        if loss.dim() != 0:
            raise LossError(
                f"engine.backward expects the loss as a scalar tensor, got shape {tuple(loss.shape)}; "
                "reduce it first (e.g. loss.mean())"
            )
        reduces = self._micro.reduces(self.micro_steps, self._config.gradient_accumulation_steps)
        self._micro.begin_backward(reduces)
        self._strategy.begin_micro_batch(reduces)
        gas = self._config.gradient_accumulation_steps if scale_wrt_gas else 1
        scale = self.get_loss_scale() * self._sequence_factor() / gas
        self.timers.start("backward")
        self._direct.in_engine_backward = True
        try:
            (loss.float() * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._direct.in_engine_backward = False
        self.timers.stop("backward")
        self.timers.start("reduce_wait")
        self._strategy.after_backward()
        self.timers.stop("reduce_wait")
        self._micro.end_backward()
        self._progress.add_loss(loss)
        return loss / gas if gas != 1 else loss

    def step(self) -> None:
        """End of a micro-batch; at the accumulation boundary, one optimizer step.

        Unscale and clip the averaged gradient, skip the step on every rank if any rank saw an
        fp16 overflow (lowering the loss scale), otherwise step the optimizer and then the
        lr scheduler.
        """
        self._require_states("step()")
        if self._coalescing:
            raise UsageError("engine.step() inside engine.coalesce_grad_reduction() (DeepSpeed: It is illegal "
                             "to call Engine.step() inside no_sync context manager): leave the block first; "
                             "leaving it reduces the accumulated gradients")
        if self._micro.no_sync:
            raise UsageError("engine.step() inside engine.no_sync() (DeepSpeed: It is illegal to call "
                             "Engine.step() inside no_sync context manager): leave the block and run one "
                             "more backward (it reduces the accumulated gradients) before step()")
        if self._micro.awaits_backward:
            # A training forward whose output never reached backward (engine.backward or a
            # direct backward of the output, runtime/direct_backward.py): no gradients to step on.
            raise RuntimeError(
                "engine.step() after a training forward without a backward: call "
                "engine.backward(loss) (or loss.backward()) on the forward's loss before step(), "
                "or run an evaluation forward under torch.no_grad() / engine.eval()")
        self._step_applied = False
        # Unmanaged accumulation: the script's step() is the boundary, after the backward passes
        # since the last one; managed: one micro-batch, the boundary every gas-th call.
        micro_batches = 1 if self._micro.managed else self._micro.pending_backwards
        self._progress.micro_batch_done(micro_batches)
        if self._micro.managed and not self.is_gradient_accumulation_boundary():
            self._progress.accumulation_step_done()
            return
        self._micro.stepping = True  # the boundary while step() runs (unmanaged accumulation)
        try:
            self._optimizer_step(micro_batches)
        finally:
            self._micro.stepping = False

    def _optimizer_step(self, micro_batches: int, micro_steps: int = 1) -> None:
        """The boundary's optimizer step, in one place for both drivers (`step()` here, the
        pipeline's `train_batch`): prepare (reduce, unscale, norm, clip) -> optimizer -> strategy ->
        loss scaler -> scheduler -> progress -> periodic save -> preemption. `micro_batches`
        accumulated since the last step; `micro_steps` of them are counted here (1 when step()
        counted the others)."""
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step() needs an optimizer: add an \"optimizer\" section to the config "
                "or pass optimizer= to zeroshard.initialize()"
            )
        if not self._micro.managed and self._micro.pending_backwards and not self._micro.grads_ready:
            self._reduce_accumulated()  # no backward reduced (managed_gradient_accumulation false)
        self.timers.start("step")
        self._micro.stepped()
        stats = self._prepare_step()
        if not stats.overflow:
            self.optimizer.step()
        self._strategy.after_step(applied=not stats.overflow)
        if self.expert_balance is not None:
            self.expert_balance.step()  # Note: [expert bias balancing] in moe/balance.py
        self.timers.stop("step")
        self._last_grad_stats = stats
        self._step_applied = not stats.overflow
        if self._loss_scaler is not None:
            before = self._loss_scaler.loss_scale
            self._loss_scaler.update(stats.overflow)
            if stats.overflow:
                logger.info(
                    f"step {self.global_steps + 1}: gradient overflow, step skipped; "
                    f"loss scale {before:g} -> {self._loss_scaler.loss_scale:g}"
                )
        self._publish_loss_scale(stats.overflow)
        if not stats.overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        samples = None if self._micro.managed else micro_batches  # None: train_batch_size
        if self._progress.optimizer_step_done(skipped=stats.overflow, micro_batches=samples,  # steps_per_print
                                              micro_steps=micro_steps):
            self._report()
        saved = self.save_schedule is not None and self.save_schedule.due(self.global_steps)
        if saved:
            self.save_checkpoint(self.save_schedule.save_dir)  # checkpoint.save_interval_steps / _minutes
        if self.preemption is not None and self.preemption.requested():  # Note: [preemption]
            self.preemption.save_and_exit(self, saved=saved)  # SystemExit(75) after the emergency save

    def _prepare_step(self) -> GradStats:
        """Reduced gradients -> unscaled, clipped, with the global norm (the pipeline engine
        sums the norm over its stages)."""
        return self._strategy.prepare_step(1.0 / self.get_loss_scale(), self._config.gradient_clipping)

    # -- torch.compile (runtime/compile.py) -------------------------------------------------

    _compile_stats: CompileStats | None = None

    def compile(self, backend: str | Callable[..., Any] = "inductor",
                compile_kwargs: Mapping[str, Any] = {},  # DeepSpeed's default; never mutated
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the wrapped model with torch.compile, in place (DeepSpeed 0.19.8's signature).

        The ZeRO hooks and AutoTP's collectives stay eager (the graph breaks at each: stage 3's
        gather and release, a tensor-parallel layer's all-reduce / all-gather); with a pipeline each
        layer of this rank's stages is compiled and the schedule stays eager. The number of graphs and
        graph breaks, and later recompiles, are logged and kept in `engine.compile_stats`. A second
        call does nothing, as in DeepSpeed.

        Args:
            backend: torch.compile's backend; "inductor" is DeepSpeed's default on every accelerator
                zeroshard runs on.
            compile_kwargs: more torch.compile arguments (`mode`, `dynamic`, `fullgraph`, ...).
            schedule: DeepCompile's pass schedule; only None (DeepCompile is not implemented).
            compiled_autograd_enabled: only False (compiled autograd would trace the gradient hooks).

        Raises:
            NotSupportedError: a schedule, compiled autograd, or model-parallel layers of the script's
                own (an mpu).

        Example::

            engine, *_ = zeroshard.initialize(model=model, config=cfg)
            engine.compile()
            loss = engine(batch)  # the first forward compiles (and logs the graph breaks)
        """
        if self._compile_stats is None:
            self._compile_stats = compile_model(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` ran (DeepSpeed's `engine.is_compiled`)."""
        return self._compile_stats is not None

    @property
    def compile_stats(self) -> CompileStats | None:
        """Graphs, graph breaks (with reasons), recompiles and first-forward time of the compiled
        model; None before `compile()`. zeroshard's extension."""
        return self._compile_stats

    # -- inference ------------------------------------------------------------------------

    def generate(self, input_ids: Tensor | None = None, max_new_tokens: int = 20, **kwargs: Any) -> Any:
        """Generate on every rank at once; ranks may want different lengths (never hangs).

        A Hugging Face model (one with `.generate`) is driven through its own generate with
        `synced_gpus`; any other model must map token ids (B, T) to logits (B, T, V) and is
        decoded greedily (`eos_token_id=`, `block_size=` are accepted).
        """
        was_training = self.module.training
        self.module.eval()
        try:
            if hasattr(self.module, "generate"):
                return hf_generate(self, input_ids=input_ids, max_new_tokens=max_new_tokens, **kwargs)
            if input_ids is None:
                raise ValueError("generate() needs input_ids")
            return generate_tokens(self, input_ids, max_new_tokens, **kwargs)
        finally:
            self.module.train(was_training)

    # -- checkpoints (runtime/engine_checkpoints.py; docs/checkpoints.md) -----------------

    def _check_states_present(self, what: str) -> None:  # EngineCheckpoints' hooks
        self._require_states(what)

    def _pending_backwards(self) -> int:
        return self._micro.pending_backwards

    def _after_load(self) -> None:
        self._micro.stepped()
        self._publish_loss_scale(overflow=False)


DeepSpeedEngine = ZeroEngine
"""DeepSpeed's name for the engine class (`isinstance(engine, deepspeed.DeepSpeedEngine)`)."""
