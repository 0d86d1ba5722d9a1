"""The one-step delayed parameter update (the ZeRO-Offload paper's DPU) of a CPU-offloaded step.

`DelayedStep` is the optimizer the engine steps when `offload_optimizer.delayed_update` is on:
after `warmup` synchronous steps, `step()` starts the torch optimizer's step in a background
thread and returns, so the CPU update of step k runs while step k+1's forward and backward
compute; the strategy publishes the updated master weights at the next step boundary
(`settle()`, Note: [delayed update]). Imports nothing of zeroshard.

Note: [delayed update] The rule, for step k after the warm-up (k > warmup, steps counted from 1):
the boundary of step k first waits for the update of step k-1 and publishes its master weights
into the model, then starts update k on step k's (averaged, unscaled, clipped) gradient. The
forward of step k+1 therefore runs on the weights after update k-1, and update k+1 applies that
gradient to the masters after update k: one update newer than the weights it was computed on.
Warm-up steps (k <= warmup) update and publish before returning, as without the switch.

The thread never touches what the main thread uses meanwhile: it steps *shadow* parameters
(new `nn.Parameter`s over the fragments' master storage) whose gradients are step k's gradient
buffer, which the shard retires until the next boundary (Note: [double gradient buffer] in
zero/shard.py), on a copy of each parameter group's hyper-parameters taken at launch, so
`zero_grad()`, the next step's gradient reduction and an lr scheduler stepping right after
`step()` cannot race with it. The optimizer state is shared (the shadows map to the fragments'
own state dicts). Anything that reads masters or optimizer state (checkpoints,
`offload_states`) calls the strategy's `settle_step()` first.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn


class DelayedStep(torch.optim.Optimizer):
    """Steps `inner` one step late, in a background thread (Note: [delayed update]).

    `param_groups`, `state` and `defaults` are `inner`'s own objects (an lr scheduler built on
    either sees the same groups); `state_dict` / `load_state_dict` wait for the step in flight.

    Args:
        inner: the torch optimizer over the shard's fragments (its step reads only its groups,
            its state and the gradients; one that communicates must not be wrapped).
        fragments: the shard's fragment parameters (all parameters of `inner`'s groups).
        warmup: steps run synchronously before the first delayed one.
        swap_grads: called once the background step holds the fragments' gradients: the owner
            then reduces the next step's gradients into its other buffer, so the step reads
            them in place (Note: [double gradient buffer] in zero/shard.py).
    """

    def __init__(self, inner: torch.optim.Optimizer, fragments: Sequence[nn.Parameter], warmup: int,
                 swap_grads: Callable[[], None]) -> None:
        # torch.optim.Optimizer.__init__ is not called: groups and state stay inner's objects.
        self.inner = inner
        self._fragments = list(fragments)
        self._warmup = int(warmup)
        self._swap_grads = swap_grads
        self.steps = 0
        """Optimizer steps requested (`step()` calls), warm-up ones included."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._shadow_of: dict[nn.Parameter, nn.Parameter] = {}
        self._stepped_state: Any = None
        self._landed = False

    # -- the wrapped optimizer's objects ------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)  # the fragments' grads; the thread's are its own

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self.wait()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load `inner`'s state; the warm-up resumes from the loaded step count (the optimizer
        state's largest "step"), so a resumed run delays exactly where the saved run did."""
        self.wait()
        self.inner.load_state_dict(state_dict)
        counts = [float(s["step"]) for s in self.inner.state.values() if isinstance(s, dict) and "step" in s]
        self.steps = int(max(counts)) if counts else 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add_param_group on a ZeRO engine's optimizer: build every group before "
                                  "zeroshard.initialize()")

    def __repr__(self) -> str:
        return f"DelayedStep({self.inner!r}, warmup={self._warmup})"

    # -- the step ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """An update was started in the background and not yet waited for."""
        return self._thread is not None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Warm-up: `inner.step()`. After it: snapshot the gradients and start the update in a
        background thread (the strategy waited for the previous one at this step's
        `prepare_step`, Note: [delayed update])."""
        if closure is not None:
            raise NotImplementedError("a closure re-evaluates the loss on the updated weights, which the "
                                      "delayed update does not have yet; step without one")
        if self.wait() or self._landed:
            raise AssertionError("expected the strategy to publish the previous update (settle_step) before the "
                                 "next step starts")
        self.steps += 1
        if self.steps <= self._warmup:
            return self.inner.step()
        stepper = self._stepper()
        self._swap_grads()
        self._error = None
        # Not a daemon: a script that ends right after step() lets the update finish (a daemon thread
        # inside a torch kernel at interpreter exit aborts the process: "terminate called ...").
        self._thread = threading.Thread(target=self._run, args=(stepper,), name="zeroshard-delayed-step")
        self._thread.start()
        return None

    def _stepper(self) -> torch.optim.Optimizer:
        """A shallow copy of `inner` over shadow parameters: the fragments' gradients handed
        over now, the groups' hyper-parameters copied now, the state dicts shared with `inner`'s."""
        shadows: dict[nn.Parameter, nn.Parameter] = {}
        for p in self._fragments:
            s = nn.Parameter(p.detach(), requires_grad=True)  # the master storage, as it is now
            s.grad = p.grad  # a view of the buffer swap_grads retires, or a cast copy
            shadows[p] = s
        stepper = object.__new__(type(self.inner))
        stepper.__dict__.update(self.inner.__dict__)
        stepper.param_groups = [{**g, "params": [shadows[p] for p in g["params"]]} for g in self.inner.param_groups]
        state: defaultdict[Tensor, Any] = defaultdict(dict)
        for p, s in shadows.items():
            if p in self.inner.state:
                state[s] = self.inner.state[p]
        stepper.state = state
        self._shadow_of = shadows
        return stepper

    def _run(self, stepper: torch.optim.Optimizer) -> None:
        try:
            with torch.no_grad():
                stepper.step()
        except BaseException as e:  # re-raised by wait() on the main thread
            self._error = e
        self._stepped_state = stepper.state

    def take_landed(self) -> bool:
        """Whether an update finished (was waited for) since the last call: its masters are final
        and not yet published into the model."""
        landed, self._landed = self._landed, False
        return landed

    def wait(self) -> bool:
        """Wait for the update in flight; True when there was one (its masters are now final).
        A failure of the background step is raised here."""
        thread = self._thread
        if thread is None:
            return False
        thread.join()
        self._thread, self._landed = None, True
        state = self._stepped_state
        for p, s in self._shadow_of.items():  # state first created by this step
            if p not in self.inner.state and s in state:
                self.inner.state[p] = state[s]
        self._shadow_of, self._stepped_state = {}, None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the delayed optimizer step failed in its background thread") from error
        return True
