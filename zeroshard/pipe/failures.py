"""Pipeline failures that name themselves: a stage that raises, a stage whose activations change
shape or dtype, or a stage whose process is gone is reported on every rank, never a hang.

Imports comm/ and pipe/ only; the vote is comm/agreement.py's.

Note: [pipeline failure vote]
torch's schedules move activations with point-to-point sends whose shapes were agreed once, when
the first batch ran (torch's metadata inference). Three things break that agreement, and each
leaves the other stages blocked in a receive that only the process-group timeout (30 minutes by
default) ends, or crashes gloo without a word about which stage was wrong:
- a stage's forward (or the loss) raises on one rank;
- a stage's output changes shape or dtype after the first batch (a batch whose shape changes
  without `PipelineModule(dynamic_shape=True)`, or a layer whose output depends on its data);
- a stage's process exits.
So every stage's forward runs inside `StageGuard.forward`: a raise or a changed output is recorded
and the stage sends a placeholder of the agreed shape (joined to the autograd graph, so the
backward completes too). After the schedule every rank exchanges what it recorded (one small
all_gather over the world) and every rank raises the same `PipelineError`, naming the stage
that failed and, for a changed shape, the stage that expected the old one; the optimizer does
not step. A process that exited cannot vote: its neighbours' receives fail on the closed
connection, and they name the stage whose rank is gone (the store says which exited).
With `dynamic_shape=True` the first stage's input shapes are agreed before every batch (the same
all_gather) and the schedule is rebuilt, with torch's inference run anew, for each new shape
(kept, so alternating shapes reuse theirs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import Comm
from zeroshard.comm.agreement import exchange_outcomes, failures
from zeroshard.comm.divergence import exited_peers
from zeroshard.pipe.module import PipelineError

Meta = tuple[tuple[tuple[int, ...], str], ...]
"""The (shape, dtype) of each tensor a stage sends."""


def metas(x: Any) -> Meta:
    """(shape, dtype) of each tensor in `x` (a tensor or a tuple/list of them)."""
    items = x if isinstance(x, (tuple, list)) else (x,)
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in items if isinstance(t, Tensor))


def describe(meta: Meta) -> str:
    return ", ".join(f"{list(s)} {d}" for s, d in meta) or "no tensors"


def shape_key(inputs: tuple[Tensor, ...] | None, micro_batches: int) -> int:
    """A fingerprint of a batch's input shapes and dtypes (0 on ranks without inputs)."""
    if inputs is None:
        return 0
    text = f"{micro_batches}|{describe(metas(inputs))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") % ((1 << 56) - 1) + 1


def _placeholder(meta: Meta, anchors: list[Tensor]) -> Any:
    """Tensors of the agreed shapes, joined (times zero) to the stage's inputs and weights so the
    schedule's backward runs through them."""
    anchor = sum((a.float().sum() * 0 for a in anchors), torch.zeros(()))
    out = []
    for shape, dtype in meta:
        dt = getattr(torch, dtype)
        t = torch.zeros(shape, dtype=dt)
        out.append(t + anchor.to(dt) if dt.is_floating_point else t)
    return out[0] if len(out) == 1 else tuple(out)


class StageGuard:
    """Runs this rank's stages' forwards and the loss, recording failures instead of raising
    (Note: [pipeline failure vote]); `settle()` raises the batch's failures on every rank."""

    def __init__(self, world: Comm, stage_of_rank: Callable[[int], int], num_stages: int) -> None:
        self.world = world
        self.stage_of_rank = stage_of_rank
        self.num_stages = num_stages
        self.key = 0
        self._expected: dict[tuple[int, int], Meta] = {}
        self._failure: str | None = None
        self._cause: BaseException | None = None

    # -- inside the schedule ----------------------------------------------------------------

    def forward(self, stage: int, chunk: nn.Module, inputs: tuple[Any, ...]) -> Any:
        anchors = [t for t in inputs if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
        anchors += [p for p in chunk.parameters() if p.requires_grad][:1]
        expected = self._expected.get((self.key, stage))
        if self._failure is None:
            try:
                out = chunk(*inputs)
            except Exception as e:
                self._record(f"stage {stage} raised in its forward: {type(e).__name__}: {first_line(e)}", e)
            else:
                got = metas(out)
                if expected is None:  # the schedule's first forward: what the next stage is set up for
                    self._expected[(self.key, stage)] = got
                    return out
                if got == expected or stage == self.num_stages - 1:
                    return out
                self._record(
                    f"stage {stage}'s output ({describe(got)}) differs from the ({describe(expected)}) stage "
                    f"{stage + 1} was set up to receive. Activations between stages keep the shapes and dtypes "
                    "of the first batch: build the PipelineModule with dynamic_shape=True if the batch's shape "
                    f"changes between steps, or make stage {stage}'s last layer return the same shape and dtype "
                    "for every micro-batch", None)
        return _placeholder(expected or (((), "float32"),), anchors)

    def loss(self, fn: Callable[[Any, Tensor], Tensor], stage: int, output: Any, target: Tensor) -> Tensor:
        tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                   if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
        if self._failure is None:
            try:
                return fn(output, target)
            except Exception as e:
                self._record(f"stage {stage}'s loss_fn raised: {type(e).__name__}: {first_line(e)}", e)
        return sum((t.float().sum() * 0 for t in tensors), torch.zeros((), requires_grad=not tensors))

    def _record(self, message: str, cause: BaseException | None) -> None:
        self._failure, self._cause = message, cause

    # -- around the schedule ----------------------------------------------------------------

    def agree(self, what: str, error: str | None, key: int) -> list[int]:
        """Before a batch: every rank's input fingerprint (see shape_key); raises on every rank
        when any rank could not draw its batch."""
        return [k for _, k in self._exchange(what, error, key)]

    def settle(self, what: str) -> None:
        """After the schedule: raise the batch's failures on every rank (nothing when none)."""
        failure, cause = self._failure, self._cause
        self._failure = self._cause = None
        self._exchange(what, failure, 0, cause)

    def _exchange(self, what: str, failure: str | None, key: int,
                  cause: BaseException | None = None) -> list[tuple[str | None, int]]:
        """comm/agreement.py's vote over the world: every rank's failure and key, then the same
        PipelineError on every rank when any stage failed."""
        try:
            outcomes = exchange_outcomes(self.world, failure, key)
        except Exception as e:
            raise PipelineError(self.lost(what, e)) from (cause or e)
        failed = failures(outcomes)
        if failed:
            lines = [f"pipeline {what} failed on rank {r} (stage {self.stage_of_rank(r)}): {text}"
                     for r, text in failed]
            raise PipelineError(f"{lines[0]}\n" + "\n".join(lines[1:] + [
                f"(reported on every rank; rank {self.world.rank} is stage {self.stage_of_rank(self.world.rank)}; "
                "this batch's optimizer step was skipped)"])) from cause
        return [(o.error, o.key) for o in outcomes]

    def lost(self, what: str, error: BaseException) -> str:
        """The message for a rank whose peer stopped answering (its process is gone)."""
        me = self.world.rank
        gone = exited_peers(self.world.groups.dp_group)
        if gone:
            who = ", ".join(f"stage {self.stage_of_rank(r)} (rank {r}) {state}" for r, state in sorted(gone.items()))
        else:
            who = "a peer stage's process (its rank exited or was killed; see its log)"
        return (f"pipeline {what} failed on rank {me} (stage {self.stage_of_rank(me)}): lost {who}: "
                f"{type(error).__name__}: {first_line(error)}")


class GuardedChunk(nn.Module):
    """A stage's module as torch's PipelineStage runs it: the forward inside the guard (the
    chunk's parameters are this module's, for torch's weight-gradient split)."""

    def __init__(self, chunk: nn.Module, stage: int, guard: StageGuard) -> None:
        super().__init__()
        self.chunk = chunk
        self.stage = stage
        self.guard = guard

    def forward(self, *inputs: Any) -> Any:
        return self.guard.forward(self.stage, self.chunk, inputs)


def first_line(error: BaseException) -> str:
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    return lines[0][:300] if lines else ""


def is_peer_lost(error: BaseException) -> bool:
    """A point-to-point or collective failure because the other end closed (gloo's and NCCL's words)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        w in text for w in ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
                            "Socket Timeout", "NCCL communicator was aborted"))
