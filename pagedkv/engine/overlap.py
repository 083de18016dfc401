"""Overlapped scheduling (vLLM's `async_scheduling`): the forward pass of step N runs in a
worker thread while the engine core's thread builds step N+1's batch, and, once `step()` has
returned step N's outputs, while the frontend processes them (detokenization, stop strings).

    schedule(N) -> launch(N) | schedule(N+1) -> wait(N) -> update(N) -> fill(N+1) -> launch(N+1)
                                                          ^ only this part is serial

Step N+1 is scheduled before step N's tokens are known: each request N runs gets one
placeholder token, filled in after `update(N)` (`Scheduler.fill_placeholders`), which also drops
the requests step N finished. A request never samples a token that is thrown away, and its
sampling state is per request, so its tokens equal the serial loop's (greedy or seeded); only
when requests run can change. On CPU the forward's torch ops release the GIL while they compute;
the Python that dispatches them does not, so what overlap buys depends on the cores left over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedkv.engine.messages import CoreOutput
    from pagedkv.sched.scheduler import Scheduler


class SteppedCore(Protocol):
    """What the stepper needs of the engine core (`EngineCore` satisfies it)."""

    scheduler: Scheduler

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | Exception: ...

    def apply_step(self, scheduler_output: SchedulerOutput,
                   result: ModelRunnerOutput | Exception) -> list[CoreOutput]: ...


def _worker_init(device: str) -> Callable[[], None]:
    """The forward thread's initializer: on CUDA, make `device` its current device (the current
    device is per thread); a bare "cuda" is the device current where the stepper is built."""
    if not device.startswith("cuda"):
        return lambda: None
    import torch

    target = torch.device(device)
    if target.index is None:  # torch.cuda.set_device refuses a device without an index
        target = torch.device("cuda", torch.cuda.current_device())
    return lambda: torch.cuda.set_device(target)


class OverlappedStepper:
    """Steps one engine core (`SteppedCore`) with its forward passes in a worker thread; see
    the module docstring. Owned by the core's thread; `step()` mutates the core's scheduler
    and KV manager, and keeps at most one step running."""

    def __init__(self, core: SteppedCore, device: str) -> None:
        self.core = core
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-forward",
                                        initializer=_worker_init(device))
        self._running: tuple[SchedulerOutput, Future] | None = None
        self._closer = weakref.finalize(self, self._pool.shutdown, wait=True)

    @property
    def is_running(self) -> bool:
        """Whether a forward pass is in flight (its outputs come with the next `step()`)."""
        return self._running is not None

    def step(self) -> list[CoreOutput]:
        """Finish the running step (launching one first when none runs), launch the next one,
        built while the forward pass ran; returns the finished step's outputs."""
        core = self.core
        scheduler = core.scheduler
        if self._running is None:
            first = scheduler.schedule()
            if not self._launch(first):
                return core.apply_step(first, ModelRunnerOutput())
        out, future = self._running
        following = scheduler.schedule()  # while the forward pass runs
        result = future.result()  # EngineFatalError propagates; other failures come back
        self._running = None
        outputs = core.apply_step(out, result)
        scheduler.fill_placeholders(following)
        if not self._launch(following):
            outputs += core.apply_step(following, ModelRunnerOutput())
        return outputs

    def _launch(self, out: SchedulerOutput) -> bool:
        """Start `out`'s forward pass; False when it has nothing for the runner."""
        if out.is_empty and not out.finished_request_ids:
            return False
        self._running = (out, self._pool.submit(self.core.execute, out))
        return True

    def abandon(self) -> None:
        """Wait for the running forward pass, if any, and drop its step unapplied (the core
        then ends every request: `EngineCore.fail_all`)."""
        running, self._running = self._running, None
        if running is not None:
            running[1].exception()

    def close(self) -> None:
        """Wait for the running forward pass (its results are dropped) and stop the worker."""
        self.abandon()
        self._closer()
