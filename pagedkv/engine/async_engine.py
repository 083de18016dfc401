"""AsyncEngine: one background thread owns an `LLMEngine` and runs its step loop.

The engine is not thread-safe, so nothing but the loop thread ever touches it. HTTP handlers
(on the asyncio event loop) talk to it through a thread-safe queue of commands (`commands.py`)
that the loop drains before every step: add a request, abort one, start a utility call of the
engine core (stats, pins, the dashboard's feed). Each request's outputs go back to its own
`RequestStream` (`request_stream.py`), as the engine's cumulative `RequestOutput`s: a step's
outputs go over in one `loop.call_soon_threadsafe` per event loop (one wake-up per step, not
one per request); turning them into deltas is the caller's business.

The loop sleeps on an event while the engine has nothing to do (no busy spinning), checks the
block pool's invariants each time the engine falls idle, and stops cleanly on `shutdown()`
(aborting whatever is still running, so no block stays held and the thread is joined).

A step that raises (the engine itself ends only the failed step's requests when the model
runner raises; this is the net under that) fails every request in flight and the loop goes on
when the KV cache's invariants still hold. When they do not, the loop cannot go on: it stops,
logs why, and calls `on_fatal(reason)` (the server then exits instead of answering 503s). With
the engine core in its own process, a core that dies is noticed by the next step, or within
about a second while idle, and ends the loop the same way.

Utility calls never block the event loop, nor, with the core in its own process, the loop
thread: `call_utility()` awaits a future that the loop thread resolves when the core's answer
arrives among its outputs (the core steps on meanwhile); it fails with EngineDeadError when the
core or the loop dies, and with TimeoutError after its timeout.

`busy_for()` says how long the loop (or the core process) has been in its current round
(commands, then a step) while it has work: a step that never returns (a wedged kernel, a
deadlock) shows as a number that only grows, which the server's /health reports (a live thread
alone proves nothing). With the core in its own process, work sent to it (a request, an abort,
a utility call) that it has not taken counts as busy from when it was sent: a core frozen while
idle shows too.

Draining (a graceful shutdown): `begin_drain()` refuses new requests (EngineDeadError, a 503)
while those in flight run on; `end_remaining()` then ends each of them with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pagedkv.config.errors import EngineFatalError
from pagedkv.engine.commands import (
    AbortRequest,
    AddRequest,
    Answered,
    Command,
    FailAll,
    Pin,
    PinChecked,
    StartUtility,
    Stop,
    Unpin,
)
from pagedkv.engine.input_processor import PromptType
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request_stream import (
    ABORTED,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    RequestStream,
    put_all,
)
from pagedkv.engine.stats import EngineStats
from pagedkv.kv.pins import PinInfo
from pagedkv.sched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineStepError",
           "RequestStream"]

logger = logging.getLogger("pagedkv.server")

_IDLE_CHECK_S = 1.0  # an idle loop checks this often that the engine (its core process) lives
UTILITY_TIMEOUT_S = 60.0  # how long `call_utility` waits for the core's answer by default
_LIVENESS_S = 1.0  # a waiting `call_utility` checks this often that the loop still runs


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on `loop` from another thread; a closed loop drops it."""
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens any more
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # the waiter went away (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _engine_error(exc: BaseException) -> BaseException:
    """What a waiter sees: a core that cannot go on is an EngineDeadError (a 503)."""
    return EngineDeadError(str(exc)) if isinstance(exc, EngineFatalError) else exc


def _forward(fut: asyncio.Future, done: Future) -> None:
    """Resolve `fut` (an event loop's) like `done` (a resolved utility call); any thread."""
    exc = done.exception()
    if exc is not None:
        _call_in_loop(fut.get_loop(), _resolve, fut, None, _engine_error(exc))
    else:
        _call_in_loop(fut.get_loop(), _resolve, fut, done.result())


class AsyncEngine:
    """Runs `engine` in one background thread; see the module docstring.

    `max_pending` bounds the requests in flight (added and not yet closed); `add_request`
    raises EngineOverloadedError beyond it.
    """

    def __init__(self, engine: LLMEngine, *, max_pending: int = 4096,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        self.engine = engine
        self.max_pending = max_pending
        self.on_fatal = on_fatal  # called once, from the loop thread, when the loop dies
        self.error: str | None = None  # why the loop died or the pool went inconsistent
        self.draining = False  # set by begin_drain(): new requests are refused
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # owned by the loop thread
        # internal request id -> (prompt ids, cache_salt, future) of a pin awaiting its prefill
        self._pins_waiting: dict[str, tuple[list[int], str | None, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        # time.monotonic() when the loop's current round began; None while it waits for work.
        # Written by the loop thread only; read from any (a float swap is atomic).
        self._round_started: float | None = None

    # ---- engine facts (any thread: they read only fixed sizes and the tokenizer) ----------

    @property
    def tokenizer(self) -> Any:
        """The engine's Tokenizer (immutable after start; safe to use from any thread)."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are in [0, vocab_size); fixed)."""
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output the engine accepts, in tokens (fixed at engine creation)."""
        return self.engine.max_model_len

    def truncate_prompt(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """`LLMEngine.truncate_prompt` (reads only max_model_len: any thread may call it)."""
        return self.engine.truncate_prompt(ids, truncate_prompt_tokens)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when a prompt of this length with `params.n` samples could never fit
        in the KV cache (reads only the cache's fixed sizes, so any thread may call it)."""
        self.engine.check_fits(num_prompt_tokens, params)

    # ---- lifecycle (any thread) ---------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the loop and join its thread."""
        self._stopping = True
        self._submit(Stop())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine loop did not stop within %.0f s", timeout)
            self._thread = None

    def begin_drain(self) -> None:
        """Refuse new requests from now on (EngineDeadError); those in flight run on."""
        self.draining = True

    def end_remaining(self, reason: str) -> None:
        """End every request in flight with EngineDeadError(reason) (thread-safe, returns at
        once): streams raise it, so the server ends them with an error (503 / error event)."""
        self._submit(FailAll(reason))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def busy_for(self) -> float:
        """Seconds the loop has spent in its current round (its commands and one step), or a
        core process in its current step or with work sent and not taken, whichever is
        longer; 0.0 while both wait for work. Any thread may call it."""
        started = self._round_started
        own = 0.0 if started is None else max(0.0, time.monotonic() - started)
        return max(own, self.engine.core_busy_for())

    # ---- requests (event loop) ----------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams, *, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Add a request; its outputs arrive on the returned stream (close it when done).

        Raises EngineOverloadedError when `max_pending` requests are in flight, ValueError
        when the engine rejects the request, EngineDeadError when the loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine loop is not running")
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        with self._lock:
            if self._num_in_flight >= self.max_pending:
                raise EngineOverloadedError(
                    f"server overloaded: {self._num_in_flight} requests in flight "
                    f"(max_pending={self.max_pending}); retry later")
            self._num_in_flight += 1
        stream = RequestStream(request_id, self._close_stream)
        fut = stream.loop.create_future()
        stream.submitted = time.monotonic()
        self._submit(AddRequest(stream, prompt, params, priority, cache_salt, fut))
        try:
            await fut
        except asyncio.CancelledError:  # the client left: abort it in case the engine has it
            stream.close()
            raise
        except BaseException:
            stream.finished = True  # rejected: it never reached the engine
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort `request_id` (thread-safe, returns at once; unknown ids are ignored)."""
        self._submit(AbortRequest(request_id))

    async def get_stats(self) -> EngineStats:
        """The engine's stats, read by the core between steps (`call_utility("get_stats")`)."""
        return await self.call_utility("get_stats")

    async def call_utility(self, method: str, *args: Any,
                           timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """The engine core's utility call `method` (pagedkv/engine/utility.py: "get_stats",
        "dashboard.drain", ...), run by the core between its steps; see the module docstring.
        Raises what the call raised (ValueError, ...), EngineDeadError when the loop or the core
        is gone, TimeoutError when no answer came within `timeout` seconds (None: no limit)."""
        return await self._ask(lambda fut: StartUtility(method, args, fut), method,
                               timeout=timeout)

    async def pin_prefix(self, prompt: PromptType,
                         cache_salt: str | None = None) -> PinInfo:
        """Pin the prompt's full blocks (`LLMEngine.pin_prefix`), first running the prompt
        (one generated token) when they are not all cached: the pin is taken in the loop
        thread right after that request's last step, before any other step can evict them.
        ValueError as for `LLMEngine.pin_prefix`; EngineDeadError when the loop is not running."""
        return await self._ask(lambda fut: Pin(prompt, cache_salt, fut), "pin")

    async def unpin_prefix(self, prompt: PromptType,
                           cache_salt: str | None = None) -> PinInfo:
        """Release the prompt's pin (`LLMEngine.unpin_prefix`; NotPinnedError when none)."""
        return await self._ask(lambda fut: Unpin(prompt, cache_salt, fut), "unpin")

    async def _ask(self, command: Callable[[asyncio.Future], Answered], what: str,
                   timeout: float | None = None) -> Any:
        """Queue `command(future)` and await the future; see `call_utility` for the errors
        (`what` names the call in a TimeoutError)."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine loop is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(command(fut))
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while True:
                left = _LIVENESS_S if deadline is None else deadline - loop.time()
                done, _ = await asyncio.wait({fut}, timeout=max(0.0, min(left, _LIVENESS_S)))
                if done:
                    return fut.result()
                if not self.is_running:
                    raise EngineDeadError(self.error or "the engine loop is not running")
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(f"the engine core did not answer {what!r} within "
                                       f"{timeout:g} s")
        finally:
            fut.cancel()  # a no-op once resolved; else the loop thread skips or drops it

    def _close_stream(self, stream: RequestStream) -> None:
        """`RequestStream.close()`: abort its request unless it finished; release its place."""
        if not stream.finished:
            self.abort(stream.request_id)
        with self._lock:
            self._num_in_flight -= 1

    def _submit(self, command: Command) -> None:
        self._commands.put(command)
        self._wakeup.set()
        self.engine.wake()  # cut short a step() that waits on a core process

    # ---- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        was_busy = False
        try:
            while True:
                self._round_started = time.monotonic()
                self._wakeup.clear()
                idle = not self.engine.has_unfinished_requests()
                if idle and was_busy:  # before answering commands: a stats reply that shows
                    self._check_invariants()  # an idle engine comes after this check
                    was_busy = False
                if self.error is not None or not self._drain_commands():
                    break
                if not self.engine.has_unfinished_requests():
                    self._round_started = None
                    if self.engine.has_pending_calls():  # no request, but answers to receive
                        self._step()
                        continue
                    if not self._wakeup.wait(_IDLE_CHECK_S) and not self.engine.is_alive():
                        self.error = "the engine core process died"
                        self._fail_all(EngineDeadError(self.error))
                        break
                    continue
                was_busy = True
                self._step()
        except BaseException as exc:  # a bug in the loop itself: fail every request, say why
            logger.exception("engine loop failed")
            self.error = f"engine loop failed: {type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(self.error))
        finally:
            self._round_started = None
            self._abort_all()
        if self.error is not None and not self._stopping:
            logger.critical("the engine cannot go on (%s); stopping the server", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)

    def _step(self) -> None:
        """One engine step; a step that raises fails the requests in flight and, when the KV
        cache is still consistent afterwards, the loop goes on (else `self.error` is set)."""
        try:
            outputs = self.engine.step()
        except EngineFatalError:  # the engine cannot go on: the loop ends, on_fatal is told
            raise
        except Exception as exc:
            logger.exception("engine step failed; ending the %d requests in flight",
                             len(self._streams))
            self._fail_all(EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}"))
            self._check_invariants()
            return
        self._hand_over(outputs)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Give each output to its stream: the whole step's in one call on each event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._deliver(output)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in batches.items():
            _call_in_loop(loop, put_all, batch)

    def _drain_commands(self) -> bool:
        """Apply the queued commands in order; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return not self._stopping
            match command:
                case Stop():
                    return False
                case AddRequest():
                    self._add(command)
                case AbortRequest(request_id=request_id):
                    self._abort(request_id)
                case FailAll(reason=reason):
                    self._fail_all(EngineDeadError(reason))
                case StartUtility(method=method, args=args, future=fut):
                    self._start(fut, method, *args)
                case Pin(prompt=prompt, cache_salt=cache_salt, future=fut):
                    self._pin(prompt, cache_salt, fut)
                case PinChecked():
                    self._pin_checked(command)
                case Unpin(prompt=prompt, cache_salt=cache_salt, future=fut):
                    self._unpin(prompt, cache_salt, fut)

    def _start(self, fut: asyncio.Future, method: str, *args: Any) -> Future | None:
        """Start the utility call; `fut` is resolved like it once the answer is in (an
        exception raised at once resolves `fut` with it and returns None)."""
        if fut.done():  # the caller gave up before the call was sent
            return None
        try:
            call = self.engine.start_utility(method, *args)
        except Exception as exc:  # a bad call, or a core already gone
            _call_in_loop(fut.get_loop(), _resolve, fut, None, _engine_error(exc))
            return None
        call.add_done_callback(lambda done: _forward(fut, done))
        return call

    def _pin(self, prompt: PromptType, cache_salt: str | None, fut: asyncio.Future) -> None:
        """Ask the core whether the prompt is cached; `_pin_checked` goes on with the answer
        (see `pin_prefix`). Never waits for the core."""
        try:
            ids = self.engine.prefix_ids(prompt, cache_salt)
            check = self.engine.start_utility("is_prefix_cached", ids, cache_salt)
        except Exception as exc:  # a bad prompt or salt, or a core already gone
            _call_in_loop(fut.get_loop(), _resolve, fut, None, _engine_error(exc))
            return
        check.add_done_callback(
            lambda done: self._submit(PinChecked(ids, cache_salt, fut, done)))

    def _pin_checked(self, command: PinChecked) -> None:
        """Pin now when the prompt was cached; else run it first, pinning when it finishes
        (`_deliver`)."""
        ids, cache_salt, fut, check = (command.ids, command.cache_salt, command.future,
                                       command.check)
        if fut.done():  # the caller gave up
            return
        if check.exception() is not None:
            _forward(fut, check)
            return
        if check.result():
            self._start(fut, "pin_prefix", ids, cache_salt)
            return
        request_id = f"pin-{uuid.uuid4().hex}"
        try:
            self.engine.add_request(request_id, ids, SamplingParams(max_tokens=1),
                                    cache_salt=cache_salt)
        except ValueError as exc:
            _call_in_loop(fut.get_loop(), _resolve, fut, None, exc)
            return
        self._pins_waiting[request_id] = (ids, cache_salt, fut)

    def _unpin(self, prompt: PromptType, cache_salt: str | None, fut: asyncio.Future) -> None:
        try:
            ids = self.engine.prefix_ids(prompt, cache_salt)
        except ValueError as exc:
            _call_in_loop(fut.get_loop(), _resolve, fut, None, exc)
            return
        self._start(fut, "unpin_prefix", ids, cache_salt)

    def _add(self, command: AddRequest) -> None:
        stream, fut = command.stream, command.future
        if fut.done():  # the handler was cancelled before we got here
            return
        try:
            self.engine.add_request(stream.request_id, command.prompt, command.params,
                                    priority=command.priority, cache_salt=command.cache_salt)
        except ValueError as exc:
            _call_in_loop(stream.loop, _resolve, fut, None, ValueError(str(exc)))
            return
        self._streams[stream.request_id] = stream
        _call_in_loop(stream.loop, _resolve, fut, None)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:  # finished already, or never added
            return
        self.engine.abort_request(request_id)
        _call_in_loop(stream.loop, stream.put, ABORTED)

    def _deliver(self, output: RequestOutput) -> RequestStream | None:
        """The stream `output` goes to (None: a pin's request, or one no longer streamed)."""
        if output.request_id in self._pins_waiting:
            if output.finished:  # its blocks were just freed, still cached: pin them now
                ids, cache_salt, fut = self._pins_waiting.pop(output.request_id)
                self._start(fut, "pin_prefix", ids, cache_salt)
            return None
        stream = self._streams.get(output.request_id)
        if stream is not None and output.finished:
            del self._streams[output.request_id]
        return stream

    def _check_invariants(self) -> None:
        try:
            self.engine.check_invariants()
        except Exception as exc:
            if not self.engine.is_alive():
                logger.critical("the engine core process is gone: %s", exc)
                self.error = f"the engine core process is gone: {exc}"
                return
            logger.exception("KV cache invariants broken")
            self.error = f"KV cache invariants broken: {exc}"

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, (_, _, fut) in self._pins_waiting.items():
            _call_in_loop(fut.get_loop(), _resolve, fut, None, exc)
            self.engine.abort_request(request_id)
        self._pins_waiting.clear()
        for request_id, stream in self._streams.items():
            _call_in_loop(stream.loop, stream.put, exc)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is broken already; nothing more to do
                logger.exception("abort of %s failed", request_id)
        self._streams.clear()

    def _abort_all(self) -> None:
        """On the way out: abort what is left so every block goes back to the pool."""
        for request_id in list(self._streams):
            self._abort(request_id)
        for request_id, (_, _, fut) in self._pins_waiting.items():
            self.engine.abort_request(request_id)
            _call_in_loop(fut.get_loop(), _resolve, fut, None,
                          EngineDeadError("the engine is shutting down"))
        self._pins_waiting.clear()
        while True:  # requests added after the stop was queued never reached the engine
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Answered):
                fut = command.future
                _call_in_loop(fut.get_loop(), _resolve, fut, None,
                              EngineDeadError("the engine is shutting down"))
