"""CompilePool: the grammar compiles' own threads, shared per constraint, dropped when unwanted.

Compiles never run on asyncio's default executor (which tokenizing, file reads and every other
`to_thread` share): one backend owns `threads` workers, plus one worker that takes only small
constraints (`cost <= small_cost`, in characters), so a 2-choice list never waits behind big
compiles. Every worker takes the cheapest queued task first. Requests for a constraint already
queued or compiling wait on the same task (one compile per constraint). Each waiter holds a
`Ticket` and `release`s it when it stops waiting (answered, timed out, or its client went away):

- a queued task whose last waiter left is removed and never runs (no compile for a client
  already gone);
- a running task whose last waiter left is abandoned: it cannot be interrupted, so it finishes on
  its thread (its result is still cached by the caller's function), and a replacement worker
  starts (after `REPLACEMENT_GRACE_S`, so waiters leaving together drop their queued tasks
  first) so the queue keeps its live workers, up to `max_abandoned` abandoned compiles at once.
  Beyond that, new compiles wait, each bounded by its caller's timeout.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_GRACE_S = 0.05
DEFAULT_SMALL_COST = 1024


@dataclass(eq=False)
class _Task:
    key: Hashable
    fn: Callable[[], Any]
    cost: int
    seq: int
    future: Future = field(default_factory=Future)
    waiters: int = 0
    started: bool = False
    dropped: bool = False
    abandoned: bool = False
    small_lane: bool = False  # run by the small-constraint worker

    def __lt__(self, other: _Task) -> bool:
        return (self.cost, self.seq) < (other.cost, other.seq)


@dataclass(eq=False)
class Ticket:
    """One waiter's claim on a task: `future` resolves to the compile's result."""

    task: _Task
    released: bool = False

    @property
    def future(self) -> Future:
        return self.task.future


class CompilePool:
    """See the module docstring. Thread-safe; workers are daemon threads started on demand."""

    def __init__(self, threads: int, max_abandoned: int = 4, name: str = "grammar-compile",
                 small_cost: int = DEFAULT_SMALL_COST) -> None:
        if threads < 1:
            raise ValueError(f"compile threads must be >= 1, got {threads!r}")
        self.threads = threads
        self.max_abandoned = max_abandoned
        self.small_cost = small_cost
        self.name = name
        self._cv = threading.Condition()
        self._heap: list[_Task] = []  # queued tasks, cheapest first (dropped ones skipped)
        self._tasks: dict[Hashable, _Task] = {}  # queued or running, by key
        self._seq = itertools.count()
        self._live = {False: 0, True: 0}  # live workers: general, small lane
        self._abandoned_running = 0
        self._closed = False
        self.num_started = 0  # compiles that began (for tests and stats)
        self.num_dropped = 0  # queued compiles removed because nobody waited any more

    def submit(self, key: Hashable, fn: Callable[[], Any], cost: int) -> Ticket:
        """A ticket on the task compiling `key` with `fn` (joining one already queued or
        running); `cost`: the constraint's size in characters. The caller must `release` it."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            task = self._tasks.get(key)
            if task is None:
                task = _Task(key, fn, cost, next(self._seq))
                self._tasks[key] = task
                heapq.heappush(self._heap, task)
                self._spawn(small_lane=False, limit=self.threads)
                self._spawn(small_lane=True, limit=1)
                self._cv.notify_all()
            task.waiters += 1
            return Ticket(task)

    def release(self, ticket: Ticket) -> None:
        """The ticket's holder stops waiting (idempotent)."""
        with self._cv:
            if ticket.released:
                return
            ticket.released = True
            task = ticket.task
            task.waiters -= 1
            if task.waiters > 0 or task.future.done():
                return
            self._tasks.pop(task.key, None)
            if not task.started:
                task.dropped = True  # skipped when popped
                task.future.cancel()
                self.num_dropped += 1
            elif not task.abandoned and self._abandoned_running < self.max_abandoned:
                task.abandoned = True
                self._abandoned_running += 1
                self._live[task.small_lane] -= 1
                self._spawn(task.small_lane, self.threads if not task.small_lane else 1,
                            grace=True)

    def close(self) -> None:
        """Stop the idle workers; queued compiles are cancelled (running ones finish on their
        threads). Idempotent; `submit` afterwards raises RuntimeError."""
        with self._cv:
            self._closed = True
            for task in self._heap:
                if not task.dropped:
                    task.dropped = True
                    task.future.cancel()
            self._heap.clear()
            self._tasks.clear()
            self._cv.notify_all()

    def _spawn(self, small_lane: bool, limit: int, grace: bool = False) -> None:
        if self._live[small_lane] < limit:
            self._live[small_lane] += 1
            threading.Thread(target=self._work, args=(small_lane, grace), daemon=True,
                             name=f"{self.name}{'-small' if small_lane else ''}").start()

    def _next(self, small_lane: bool) -> _Task | None:
        while self._heap and self._heap[0].dropped:
            heapq.heappop(self._heap)
        if not self._heap or (small_lane and self._heap[0].cost > self.small_cost):
            return None
        return heapq.heappop(self._heap)

    def _work(self, small_lane: bool, grace: bool) -> None:
        if grace:
            time.sleep(REPLACEMENT_GRACE_S)
        while True:
            with self._cv:
                while (task := self._next(small_lane)) is None:
                    if self._closed:
                        return
                    self._cv.wait()
                task.started = True
                task.small_lane = small_lane
                self.num_started += 1
            try:
                result = task.fn()
            except BaseException as exc:  # handed to the waiters
                task.future.set_exception(exc)
            else:
                task.future.set_result(result)
            with self._cv:
                if self._tasks.get(task.key) is task:
                    del self._tasks[task.key]
                if task.abandoned:  # a replacement took this thread's place
                    self._abandoned_running -= 1
                    return
