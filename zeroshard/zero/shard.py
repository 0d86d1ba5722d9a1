"""One optimizer shard: the fp32 master weights and gradient shard a rank owns (stages 1-3).

The optimizer steps on *fragments* (zero/flat.py): one `nn.Parameter` per piece of a model
parameter inside this rank's shard, each a view of the master shard, so the optimizer's state
is sharded with no change to torch.optim. Where the master lives is the offload policy's
(zero/offload/policy.py) concern. This module knows nothing about units, gathers or hooks.

Note: [shard storage] The low-precision values a rank holds are either the whole flat buffer
(stages 1/2: every rank holds the model; rank r's shard is chunk r of each bucket, addressed by
flat offsets) or only the shard (stage 3: addressed by shard offsets). In fp32 without offload
the fragments are views of those values themselves, so no second copy exists; otherwise a
separate fp32 master shard is allocated at the optimizer's home. Likewise the gradient shard is
a separate tensor unless a whole-gradient buffer exists on the model's device (stage 1
without offload), whose own chunks are then the gradient shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.zero.flat import BucketedPartition, ShardFragment
from zeroshard.zero.grad_shard import GradShard
from zeroshard.zero.offload.delayed_step import DelayedStep
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.offload.split_home import SplitFlat, device_buckets, parts_of
from zeroshard.zero.offload.zenflow import ZenFlowStep
from zeroshard.zero.offload.zenflow_state import ZenFlowPiece
from zeroshard.zero.strategy import (
    BytesByHome,
    GradStats,
    MasterFragment,
    ModelParallelNorm,
    ZeroStrategy,
    attach_grads,
    sum_of_squares,
    unscale_and_clip,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.zero.offload.nvme_optim import SwapAdam


class OptimizerShard:
    """This rank's master shard, gradient shard and fragments.

    Args:
        plan: the bucketed partition of the parameters.
        params: the model parameters in plan order; `trainable[i]` False skips parameter i.
        lp: this rank's low-precision values, the whole flat buffer (`lp_is_flat`) or the shard
            (Note: [shard storage]). `device`: the model's device.
        policy: the optimizer's home (`offload_optimizer`); `lp_policy`: the home of `lp`.
        grad_dtype: dtype of the gradient shard.
        master_dtype: dtype of the master shard: fp32, or bf16 with
            `bf16.bf16_master_weights_and_grads` (the optimizer's states then follow it).
        whole_grads: a whole-gradient flat buffer whose own chunks serve as the gradient shard
            when the policy keeps it on the model's device (stage 1), or None.
    """

    def __init__(self, plan: BucketedPartition, comm: "Comm", params: Sequence[nn.Parameter], *,
                 trainable: Sequence[bool], lp: Tensor, lp_is_flat: bool, device: torch.device,
                 policy: OffloadPolicy, lp_policy: OffloadPolicy = OffloadPolicy(),
                 grad_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32,
                 whole_grads: Tensor | None = None, norm_group: ModelParallelNorm | None = None,
                 release_grads: bool = False) -> None:
        self._plan, self._comm, self._rank = plan, comm, comm.rank
        self._params, self._policy = list(params), policy
        self._device = device  # the model's device (collectives, the norm)
        self._lp, self._lp_is_flat = lp, lp_is_flat
        # A master of the parameters' own dtype on their own device is the parameters themselves
        # (fp32, or bf16 with bf16 masters: DeepSpeed's separate bf16 copy would hold equal values).
        self._separate = lp.dtype != master_dtype or policy.offloaded or lp_policy.offloaded
        if policy.nvme is not None:  # the master lives in swap files; fragments alias `lp`
            self._separate = False
        self._swap_optimizer: "SwapAdam | None" = None
        self._delayed: DelayedStep | None = None  # offload_optimizer.delayed_update
        self._zenflow_step: ZenFlowStep | None = None  # zero_optimization.zenflow
        self._spare_grads: GradShard | None = None  # Note: [double gradient buffer]
        self.norm_group = norm_group  # Note: [norm groups] in zero/strategy.py
        # 1D master_dtype / grad_dtype, shard_numel, at the policy's home (Note: [partial offload]: split)
        self.master: Tensor | SplitFlat | None = None
        if self._separate:
            self.master = self._allocate(master_dtype, zero=False)
            self.load_master_from_lp()
        self._whole_grads = whole_grads if not policy.offloaded else None
        self.grad_shard: GradShard | None = None  # grad_dtype, shard_numel, at the policy's home
        if self._whole_grads is None:  # Note: [gradient lifetime] in zero/grad_shard.py
            self.grad_shard = GradShard(plan, lambda: self._allocate(grad_dtype, zero=True),
                                        lambda n: policy.allocate(n, grad_dtype, self._device),
                                        release=release_grads and not policy.offloaded)
        self._init_fragments(trainable)
        if self.grad_shard is not None:
            self.grad_shard.release()  # views taken: nothing is held until the first reduction

    def _allocate(self, dtype: torch.dtype, *, zero: bool) -> Tensor | SplitFlat:
        """A shard-sized buffer at the policy's home; with `offload_optimizer.ratio` below 1, its
        leading buckets on the model's device (Note: [partial offload] in zero/offload/split_home.py)."""
        numel, policy = self._plan.shard_numel, self._policy
        if policy.ratio >= 1.0:
            return policy.allocate(numel, dtype, self._device, zero=zero)
        n = device_buckets(policy.ratio, len(self._plan.buckets))
        split = self._plan.shard_range(n)[0] if n < len(self._plan.buckets) else numel
        factory = torch.zeros if zero else torch.empty
        return SplitFlat(numel, split, lambda k: factory(k, dtype=dtype, device=self._device),
                         lambda k: policy.allocate(k, dtype, self._device, zero=zero))

    def _init_fragments(self, trainable: Sequence[bool]) -> None:
        self._fragments: list[ShardFragment] = [f for f in self._plan.rank_fragments(self._rank)
                                                if trainable[f.param_index]]
        self.fragment_params: list[nn.Parameter] = []
        self._fragment_grads: list[Tensor] = []
        self._master_of: dict[int, nn.Parameter] = {}
        for f in self._fragments:
            frag = nn.Parameter(self._values(f), requires_grad=True)  # shares the shard's storage
            self.fragment_params.append(frag)
            self._master_of[id(self._params[f.param_index])] = frag
            if self.grad_shard is not None:
                self._fragment_grads.append(self.grad_shard.fragment(f))
            else:
                self._fragment_grads.append(self._whole(f.flat_offset, f.numel))

    def _values(self, f: ShardFragment) -> Tensor:
        if self.master is not None:
            return self.master[f.shard_offset : f.shard_offset + f.numel]
        start = f.flat_offset if self._lp_is_flat else f.shard_offset
        return self._lp[start : start + f.numel]

    def _whole(self, start: int, numel: int) -> Tensor:
        if self._whole_grads is None:
            raise AssertionError("expected a whole-gradient buffer")
        return self._whole_grads[start : start + numel]

    def __repr__(self) -> str:
        home = self._policy.home(self._device)
        return (f"OptimizerShard({self._plan.shard_numel} elements, {len(self._fragments)} fragments, "
                f"master {'separate' if self._separate else 'aliases the parameters'} on {home})")

    # -- what the reducer and the strategies read ---------------------------------------------

    def grad_target(self, bucket: int) -> Tensor | None:
        """Where bucket `bucket`'s reduced chunk is folded (None: it stays in the whole buffer)."""
        return None if self.grad_shard is None else self.grad_shard.bucket(bucket)

    def master_chunk(self, bucket: int) -> Tensor | None:
        """This rank's updated fp32 values of bucket `bucket` (None: the parameters are the master,
        or ZenFlow wrote the step's values into them: Note: [zenflow rule] in zero/offload/zenflow.py)."""
        if self.master is None or self._policy.zenflow is not None:
            return None
        return self.master[slice(*self._plan.shard_range(bucket))]

    def _own_lp(self, bucket: int) -> Tensor:
        if self._lp_is_flat:
            return self._lp[slice(*self._plan.chunk_range(bucket, self._rank))]
        return self._lp[slice(*self._plan.shard_range(bucket))]

    def _grad_views(self) -> list[Tensor]:
        if self.grad_shard is not None:
            return self.grad_shard.views()
        chunks = [self._plan.chunk_range(b, self._rank) for b in range(len(self._plan.buckets))]
        return [self._whole(start, end - start) for start, end in chunks]

    # -- the optimizer -----------------------------------------------------------------------

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.fragment_params)

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        known = {id(p) for p in self._params}
        out = []
        for p in params:
            if id(p) not in known:
                if not p.requires_grad:  # frozen, in a client optimizer's group: left out, as DeepSpeed does
                    continue
                raise ValueError("the optimizer was given a parameter that is not a trainable parameter of "
                                 "the model passed to initialize(); build it from model.parameters()")
            if id(p) in self._master_of:  # this rank owns part of it
                out.append(self._master_of[id(p)])
        return out

    def prepare_step(self, grad_scale: float, max_norm: float, reduced_mult: float) -> GradStats:
        """Global norm from this rank's sum of squares (one all-reduce), then average, unscale
        and clip in place and give the fragments their gradients (Note: [norm rounding])."""
        views = self._grad_views()
        sq = sum_of_squares(views).to(self._device)
        norm_group = self.norm_group
        # Before the dp sum: each rank drops its own fragments' squares.
        if norm_group is not None and norm_group.duplicates:
            sq -= sum_of_squares(self._duplicate_grads(norm_group.duplicates)).to(self._device)
        sq = self._summed_over_ranks(sq)
        zenflow = self._zenflow_step  # it clips what its two optimizers step with (Note: [zenflow clip])
        stats = unscale_and_clip(views, sq.item(), grad_scale * reduced_mult, 0.0 if zenflow is not None else max_norm)
        if zenflow is not None:
            zenflow.set_clip(max_norm, stats.norm)
        # The NVMe step reads the full-precision gradient shard itself (SwapAdam(grads=...)), and
        # its fragments alias the parameters on the model's device while that shard is on the
        # CPU: attaching would copy (or, on a GPU, refuse) a gradient nobody reads.
        if not stats.overflow and self._swap_optimizer is None:
            attach_grads(self.fragment_params, self._fragment_grads)
        return stats

    def _duplicate_grads(self, ids: frozenset[int]) -> list[Tensor]:
        return [g for f, g in zip(self._fragments, self._fragment_grads) if id(self._params[f.param_index]) in ids]

    def _global_squares(self, per_fragment: Sequence[Tensor]) -> float:
        """The global sum of squares of one tensor per fragment (fragment order), counted as the
        gradient norm counts (Note: [norm groups] in zero/strategy.py): ZenFlow's clip norms."""
        sq = sum_of_squares(per_fragment).to(self._device)
        norm_group = self.norm_group
        if norm_group is not None and norm_group.duplicates:
            dup = [t for f, t in zip(self._fragments, per_fragment) if id(self._params[f.param_index])
                   in norm_group.duplicates]
            sq -= sum_of_squares(dup).to(self._device)
        return float(self._summed_over_ranks(sq).item())

    def _summed_over_ranks(self, sq: Tensor) -> Tensor:
        """This rank's sum of squares (its duplicates already left out) summed over the data-parallel
        ranks, then over the norm group (Note: [norm groups] in zero/strategy.py)."""
        self._comm.all_reduce(sq)
        return self.norm_group.finish(sq, ()) if self.norm_group is not None else sq

    def fragment_grads(self, grad_scale: float, reduced_mult: float) -> list[Tensor]:
        """Each fragment's reduced gradient as a new 1-D fp32 tensor, times `reduced_mult` (the
        average's or the sum's factor, ShardedStrategyBase.reduced_mult) and `grad_scale`, before
        clipping (`safe_get_full_grad`)."""
        mult = grad_scale * reduced_mult
        return [g.float() * mult for g in self._fragment_grads]

    @torch.no_grad()
    def set_fragment_grad(self, index: int, value: Tensor, grad_scale: float, reduced_mult: float) -> None:
        """The inverse of `fragment_grads` for one fragment (`safe_set_full_grad`)."""
        mult = grad_scale * reduced_mult
        self._fragment_grads[index].copy_(value.reshape(-1) / mult)

    def after_step(self) -> None:
        for frag in self.fragment_params:
            frag.grad = None
        if self.grad_shard is not None:
            self.grad_shard.release()

    def swap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """With an NVMe home, the optimizer whose states live in this shard's swap files (the
        directory is checked now, before any step); with the delayed update, the optimizer that
        steps `optimizer` one step late (zero/offload/delayed_step.py); otherwise `optimizer` itself."""
        home = self._policy.nvme
        if self._policy.zenflow is not None:
            return self._zenflow(optimizer)
        if self._policy.delayed_update is not None:
            self._delayed = DelayedStep(optimizer, self.fragment_params, self._policy.delayed_update,
                                        swap_grads=self._swap_grad_buffers)
            return self._delayed
        if home is None:
            return optimizer
        from zeroshard.zero.offload.nvme_io import check_swap_dir
        from zeroshard.zero.offload.nvme_optim import SwapAdam
        from zeroshard.zero.offload.nvme_swap import SwappedAdam, swap_bytes

        numel = sum(f.numel for f in self._fragments)
        root = check_swap_dir(home.path, swap_bytes(numel), key=home.key, direct=home.io.direct)
        swap = SwappedAdam(root, numel, rank=self._rank, sub_group_numel=home.sub_group_numel,
                           fragments=[f.numel for f in self._fragments], io=home.io, fast_init=home.fast_init,
                           buffer_count=home.buffer_count)
        try:
            self._swap_optimizer = SwapAdam(optimizer, self.fragment_params, swap, grads=self._fragment_grads)
        except BaseException:
            swap.close()
            raise
        self._swap_optimizer.write_master()
        return self._swap_optimizer

    def _zenflow(self, optimizer: torch.optim.Optimizer) -> ZenFlowStep:
        """ZenFlow over the fragments. Its pieces view the model's values it writes: the whole flat
        buffer at stages 1-2 (the all-gather after the step spreads them), the rank's parameter
        shard at stage 3 (the next forward gathers it; `store_master_to_lp` then leaves the shard
        to ZenFlow)."""
        rule = self._policy.zenflow
        if rule is None or self.master is None:
            raise AssertionError("expected ZenFlow with a separate (offloaded) master")
        pieces = []
        for f, frag in zip(self._fragments, self.fragment_params):
            shape = self._params[f.param_index].shape
            columns = None
            if len(shape) == 2:
                columns = torch.arange(f.param_offset, f.param_offset + f.numel, device=self._device) % shape[1]
            start = f.flat_offset if self._lp_is_flat else f.shard_offset
            pieces.append(ZenFlowPiece(master=frag, lp=self._lp[start : start + f.numel],
                                       param_index=f.param_index, columns=columns))
        self._zenflow_step = ZenFlowStep(optimizer, pieces, [p.shape for p in self._params], rule,
                                         all_reduce=self._sum_over_ranks, device=self._device,
                                         world_size=self._comm.world_size, squares=self._global_squares)
        return self._zenflow_step

    def _sum_over_ranks(self, t: Tensor) -> None:
        self._comm.all_reduce(t)

    def _swap_grad_buffers(self) -> None:
        """Note: [double gradient buffer] The delayed update's background step reads step k's
        gradient shard in place while step k+1's backward reduces into the other one (allocated
        at the first delayed step, the size of the gradient shard); the next boundary waits for
        the step before swapping back. A copy instead would cost a pass over the shard per step
        on the main thread, about what the CPU Adam step it hides costs (measured on CPU)."""
        if self.grad_shard is None:
            raise AssertionError("expected a separate gradient shard to double-buffer")
        if self._spare_grads is None:
            numel, dtype, policy = self._plan.shard_numel, self.grad_shard.dtype, self._policy
            self._spare_grads = GradShard(self._plan, lambda: policy.allocate(numel, dtype, self._device),
                                          lambda n: policy.allocate(n, dtype, self._device), release=False)
        self.grad_shard, self._spare_grads = self._spare_grads, self.grad_shard
        self._fragment_grads = [self.grad_shard.fragment(f) for f in self._fragments]

    @property
    def step_in_flight(self) -> bool:
        """The delayed update's step runs in the background: the masters are not final yet."""
        return self._delayed is not None and self._delayed.in_flight

    def settle(self) -> bool:
        """Wait for the delayed update's step in flight; True when a step finished since the last
        call (its masters are then to be published into the model's values). ZenFlow's overlapped
        CPU step is waited for and stays pending: DeepSpeed casts it at the next CPU step only
        (Note: [zenflow overlap])."""
        self.wait_step()
        if self._delayed is None:
            return False
        return self._delayed.take_landed()

    def wait_step(self) -> None:
        if self._delayed is not None:
            self._delayed.wait()
        if self._zenflow_step is not None:
            self._zenflow_step.drain()

    @torch.no_grad()
    def load_master_from_lp(self) -> None:
        """(Re-)initialise the master from the low-precision values (construction, weights-only load)."""
        if self._swap_optimizer is not None:
            self._swap_optimizer.write_master(from_params=True)
        if self.master is None:
            return
        for b in range(len(self._plan.buckets)):
            self.master[slice(*self._plan.shard_range(b))].copy_(self._own_lp(b))

    @torch.no_grad()
    def store_master_to_lp(self) -> None:
        """Cast the master into this rank's own low-precision values (stage 3: the shard); with
        ZenFlow nothing: its step wrote them (Note: [zenflow rule] in zero/offload/zenflow.py)."""
        if self.master is None or self._policy.zenflow is not None:
            return
        for b in range(len(self._plan.buckets)):
            self._own_lp(b).copy_(self.master[slice(*self._plan.shard_range(b))], non_blocking=True)
        if self._delayed is not None and self._device.type == "cuda":
            # the copies above read the pinned master asynchronously, and the delayed update's next
            # step writes it from its thread as soon as the boundary returns
            torch.cuda.current_stream(self._device).synchronize()

    # -- checkpoints and accounting ------------------------------------------------------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        swap = self._swap_optimizer
        staged: list[Tensor | None] = [None] * len(self._fragments)
        if swap is not None and any(p.dtype != torch.float32 for p in self.fragment_params):
            staged = swap.fetch_masters()  # fp32 copies read from the swap file (save and load)
        return [MasterFragment(param=self._params[f.param_index], param_offset=f.param_offset,
                               numel=f.numel, master=frag, values=v)
                for f, frag, v in zip(self._fragments, self.fragment_params, staged)]

    def state_tensors(self) -> dict[str, list[Tensor]]:
        """The master shard ("hp_params": the fragments, views of the low-precision values when
        there is no separate master) and the gradient shard ("lp_grads")."""
        hp = parts_of(self.master) if self.master is not None else list(self.fragment_params)
        grads = [t for g in (self.grad_shard, self._spare_grads) if g is not None for t in g.tensors()]
        if self._whole_grads is not None:
            grads.append(self._whole_grads)
        return {"hp_params": hp, "lp_grads": grads}

    def count_bytes(self, acc: BytesByHome, optimizer_state_bytes: int) -> None:
        """Add the gradient shard, master shard and optimizer state at the policy's home."""
        home = self._policy.label(self._device)
        on_device = 0  # Note: [partial offload]: the leading buckets stay on the model's device
        grads = self.grad_shard
        for key, buffer in (("grads", None if grads is None else grads.flat), ("master_params", self.master)):
            if isinstance(buffer, SplitFlat):
                acc.add(self._device.type, key, _nbytes(buffer.parts[0]))
                on_device = buffer.split
            acc.add(home, key, _nbytes(parts_of(buffer)[-1] if buffer is not None else None))
        if grads is not None and grads.flat is None:  # per-bucket pieces, released after each step
            acc.add(home, "grads", grads.nbytes)
        acc.add(home, "grads", 0 if self._spare_grads is None else self._spare_grads.nbytes)
        # per-element states (Adam's) split as the master does; counted by that share
        device_states = optimizer_state_bytes * on_device // max(self._plan.shard_numel, 1)
        if on_device:
            acc.add(self._device.type, "optimizer_states", device_states)
        acc.add(home, "optimizer_states", optimizer_state_bytes - device_states)


class ShardedStrategyBase(ZeroStrategy):
    """The `ZeroStrategy` methods every sharded stage (1-3) answers from its optimizer shard."""

    _shard: OptimizerShard
    _prescale_factor: float
    _average: bool = True
    """`gradient_allreduce_op`: True for "mean", False for "sum" (the prescale factor is then 1)."""

    @property
    def reduced_mult(self) -> float:
        """What turns a reduced bucket into the gradient: the buckets were divided by the prescale
        factor and summed over the ranks, so `prescale / world_size` for the mean, 1 for the sum."""
        return self._prescale_factor / self._shard._comm.world_size if self._average else 1.0

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return self._shard.optimizer_params

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        return self._shard.master_params_for(params)

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        self.settle_step()  # Note: [delayed update] in zero/offload/delayed_step.py
        return self._shard.prepare_step(grad_scale, max_norm, self.reduced_mult)

    def settle_step(self) -> None:
        if self._shard.settle():
            self._publish_master()

    def wait_step(self) -> None:
        self._shard.wait_step()

    def _publish_master(self) -> None:
        """Make the model's values equal the updated masters (the end of an applied step)."""
        raise NotImplementedError

    def checkpoint_fragments(self) -> list[MasterFragment]:
        return self._shard.checkpoint_fragments()

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        return self._shard.fragment_grads(grad_scale, self.reduced_mult)

    def set_fragment_grad(self, index: int, value: Tensor, grad_scale: float) -> None:
        self._shard.set_fragment_grad(index, value, grad_scale, self.reduced_mult)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the engine steps (an NVMe home swaps the states: zero/offload/nvme_optim.py)."""
        return self._shard.swap_optimizer(optimizer)


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
