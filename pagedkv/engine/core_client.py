"""How the frontend talks to its engine core: one interface, two clients.

- `InprocCoreClient`: the core lives in this process (offline `LLM`, and every engine test);
  calls go straight to it, with the same message objects the other client sends.
- `MPCoreClient`: the core runs in a child process (`core_proc.py`) and the messages travel
  msgpack-encoded over two ZMQ IPC sockets in a private temporary directory. The child's
  standard input is a pipe that only this process holds open: when this process dies, however
  it dies, the core sees end of file there and exits (removing the directory itself).

With `data_parallel_size` > 1 the frontend's client is `DPCoreClient` (dp_client.py): N
`MPCoreClient`s behind this same interface.

Both are owned by one thread (the one that steps the engine); only `wake()` may be called from
any thread. A utility call is either waited for (`call`) or started (`call_async`): its
`concurrent.futures.Future` is resolved by whatever next reads the core's outputs (the owning
thread's `get_outputs()` or `call()`), and failed with CoreDeadError when the core dies.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec
import zmq

from pagedkv.config.errors import EngineFatalError
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core import EngineCore
from pagedkv.engine.messages import (
    Abort,
    Codec,
    CoreDied,
    CoreInput,
    CoreOutput,
    CoreStepOutputs,
    EngineCoreRequest,
    EngineReady,
    UtilityCall,
    UtilityResult,
)
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.step_clock import StepClock
from pagedkv.engine.utility import run_utility
from pagedkv.kv.pins import NotPinnedError, PinInfo
from pagedkv.sched.request import RequestStatus

logger = logging.getLogger(__name__)

# Seconds to wait for the core to build (model load, KV cache) before giving up.
CORE_START_TIMEOUT_S = 600.0
DEAD_CORE_EXIT_S = 5.0  # how long shutdown() waits for a core that reported its death to exit


class CoreDeadError(EngineFatalError):
    """The engine core process is gone (crashed, killed, or its loop failed): the engine
    cannot go on (the server's loop ends and the server exits, saying why)."""


class CoreClient(Protocol):
    ready: EngineReady

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort(self, message: Abort) -> None: ...
    def get_outputs(self) -> list[CoreOutput]: ...
    def output_time(self) -> float | None: ...
    def call(self, method: str, *args: Any) -> Any: ...
    def call_async(self, method: str, *args: Any) -> Future: ...
    def has_pending_calls(self) -> bool: ...
    def busy_for(self) -> float: ...
    def is_alive(self) -> bool: ...
    def wake(self) -> None: ...
    def shutdown(self) -> None: ...


def apply_abort(core: EngineCore, message: Abort) -> None:
    status = RequestStatus.FINISHED_STOPPED if message.status == "stop" \
        else RequestStatus.FINISHED_ABORTED
    core.finish_requests(message.request_ids, status, message.stop_reason)


def core_env(args: EngineArgs) -> dict[str, str]:
    """The engine core process's environment: this one's, with tcmalloc preloaded for a CPU
    engine where installed (`cpu_malloc` "auto"; pagedkv.model.cpu_memory)."""
    from pagedkv.model.cpu_memory import find_tcmalloc, with_tcmalloc

    if args.cpu_malloc != "auto" or args.device == "cuda":
        return dict(os.environ)
    return with_tcmalloc(os.environ, find_tcmalloc())


def start_core_client(args: EngineArgs, tokenizer: Any, *, core_process: bool) -> CoreClient:
    """A started core for `args` (checked and resolved already): in a child process, or in
    this one sharing the frontend's `tokenizer`; returns once it is ready."""
    if core_process:
        return MPCoreClient(args)
    return InprocCoreClient(EngineCore.from_args(args, tokenizer=tokenizer))


class InprocCoreClient:
    """The core in this process: `get_outputs()` runs one core step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.ready = core.ready()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort(self, message: Abort) -> None:
        apply_abort(self.core, message)

    def get_outputs(self) -> list[CoreOutput]:
        return self.core.step()

    def output_time(self) -> float | None:
        """None: the outputs were made just now, by the step `get_outputs()` ran."""
        return None

    def call(self, method: str, *args: Any) -> Any:
        return run_utility(self.core, method, args)

    def call_async(self, method: str, *args: Any) -> Future:
        """The call, run now; its result (or exception) in an already resolved future."""
        future: Future = Future()
        try:
            future.set_result(run_utility(self.core, method, args))
        except Exception as exc:  # the caller reads it from the future
            future.set_exception(exc)
        return future

    def has_pending_calls(self) -> bool:
        return False

    def busy_for(self) -> float:
        return 0.0  # the thread that steps the core measures its own rounds

    def is_alive(self) -> bool:
        return self.core.runner is not None

    def wake(self) -> None:
        pass

    def shutdown(self) -> None:
        self.core.shutdown()


_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "NotPinnedError": NotPinnedError,
                                       "TypeError": TypeError}
_RESULTS: dict[str, Any] = {"get_stats": EngineStats, "pin_prefix": PinInfo,
                            "unpin_prefix": PinInfo}


def _stats(value: dict) -> EngineStats:
    return EngineStats(**{**value, "kv_store_tiers": tuple(value["kv_store_tiers"]),
                          "iteration_token_counts": tuple(value["iteration_token_counts"])})


def _result(method: str, value: Any) -> Any:
    if method == "get_core_stats":
        return [_stats(v) for v in value]
    kind = _RESULTS.get(method)
    if kind is EngineStats:
        return _stats(value)
    return kind(**value) if kind is not None else value


def _settle(future: Future, method: str, answer: UtilityResult) -> None:
    """Resolve `future` with `answer` (its result converted, or its error raised again)."""
    if answer.error_type is not None:
        future.set_exception(_ERRORS.get(answer.error_type, RuntimeError)(answer.error))
    else:
        future.set_result(_result(method, answer.result))


class MPCoreClient:
    """The core in a child process; see the module docstring. `get_outputs()` returns the
    outputs of the oldest core step that arrived and is not yet taken, waiting up to `poll_s`
    (or until `wake()`) for one; `output_time()` is when that step ended, in the core. Steps
    are handed out one at a time, never merged, so a stream sees each step's tokens apart and
    its token times are the core's, however far the frontend runs behind."""

    def __init__(self, args: EngineArgs, *, poll_s: float = 0.25) -> None:
        self.poll_s = poll_s
        self._codec = Codec()
        self._dir = tempfile.mkdtemp(prefix="pagedkv-core-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
        in_addr = f"ipc://{os.path.join(self._dir, 'in')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'out')}"
        self._input.bind(in_addr)
        self._output.bind(out_addr)
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self._waker_r.fileno(), zmq.POLLIN)
        self._pending: collections.deque[CoreStepOutputs] = collections.deque()
        self._output_time: float | None = None
        self._calls = 0
        self._futures: dict[int, tuple[str, Future]] = {}  # call id -> (method, its future)
        self._clock = StepClock(os.path.join(self._dir, "clock"), create=True)
        self._sent = 0  # messages sent to the core; the clock counts those it took
        self._unacked: collections.deque[tuple[int, float]] = collections.deque()
        self._unacked_lock = threading.Lock()  # sends (owner) and busy_for() (any thread)
        self._dead: str | None = None
        self._closed = False
        # A fresh interpreter (not multiprocessing): nothing of the caller's __main__ re-runs.
        command = [sys.executable, "-m", "pagedkv.engine.core_proc", in_addr, out_addr,
                   msgspec.json.encode(args).decode(), str(logging.getLogger().getEffectiveLevel()),
                   os.path.join(self._dir, "clock")]
        # stdin: a pipe never written to, whose end of file tells the core this process is gone
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, env=core_env(args))
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + CORE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._output.poll(200):
                message = self._codec.decode_core(self._output.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, CoreDied):  # it is exiting: shutdown() need not ask
                    self._dead = message.reason
                    raise _ERRORS.get(message.error_type or "", RuntimeError)(message.reason)
            elif self.process.poll() is not None:
                raise CoreDeadError(f"the engine core process exited with code "
                                    f"{self.process.returncode} while starting")
        raise CoreDeadError(f"the engine core did not start within {CORE_START_TIMEOUT_S:.0f} s")

    # ---- sending ------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._check_alive()
        self._input.send(self._codec.encode(message), copy=False)
        with self._unacked_lock:
            self._sent += 1
            self._unacked.append((self._sent, time.monotonic()))
            self._forget_taken()

    def _forget_taken(self) -> None:
        """Drop the send times of the messages the core has taken (hold `_unacked_lock`)."""
        taken = self._clock.num_taken()
        while self._unacked and self._unacked[0][0] <= taken:
            self._unacked.popleft()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(CoreInput(request))

    def abort(self, message: Abort) -> None:
        """Send an abort; a dead core has nothing left to abort, so this never raises."""
        if self._dead is None and not self._closed:
            with contextlib.suppress(CoreDeadError):
                self._send(message)

    def wake(self) -> None:
        """Interrupt a `get_outputs()` wait (any thread)."""
        with contextlib.suppress(OSError):
            self._waker_w.send(b"x")

    # ---- receiving ----------------------------------------------------------------------

    def get_outputs(self) -> list[CoreOutput]:
        if not self._pending:
            self._receive(self.poll_s)
        if not self._pending:
            return []
        step = self._pending.popleft()
        self._output_time = step.timestamp or None
        return step.outputs

    def output_time(self) -> float | None:
        """When the step of the last `get_outputs()` ended (the core's monotonic clock)."""
        return self._output_time

    @property
    def output_socket(self) -> zmq.Socket:
        """The socket the core's messages arrive on (to poll several cores at once)."""
        return self._output

    def has_outputs(self) -> bool:
        """Whether a step's outputs arrived and wait to be taken."""
        return bool(self._pending)

    def take_step(self) -> CoreStepOutputs:
        """The oldest step that arrived and is not taken (`has_outputs()` first)."""
        return self._pending.popleft()

    def receive(self, timeout_s: float) -> None:
        """Take what arrived, waiting up to `timeout_s` for it (see `_receive`)."""
        self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> None:
        """Receive what is there (waiting up to `timeout_s` for the first message): step
        outputs are queued for `get_outputs()`, utility answers resolve their futures (their
        done-callbacks run here, in this thread). CoreDeadError when the core is gone."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._waker_r.fileno() in ready:
            with contextlib.suppress(BlockingIOError):
                self._waker_r.recv(4096)
        while True:
            try:
                data = self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._codec.decode_core(data)
            if isinstance(message, CoreStepOutputs):
                self._pending.append(message)
            elif isinstance(message, UtilityResult):
                waiting = self._futures.pop(message.call_id, None)
                if waiting is not None:
                    _settle(waiting[1], waiting[0], message)
            elif isinstance(message, CoreDied):
                self._dead = message.reason
        self._check_alive()

    def _check_alive(self) -> None:
        """CoreDeadError (and every unanswered call failed with it) when the core is gone."""
        if self._dead is None and self.process.poll() is not None and not self._closed:
            self._dead = f"the engine core process died (exit code {self.process.returncode})"
        if self._dead is not None:
            self._fail_calls(self._dead)
            raise CoreDeadError(self._dead)

    def _fail_calls(self, reason: str) -> None:
        """Fail every unanswered utility call with CoreDeadError(reason)."""
        futures, self._futures = self._futures, {}
        for _, future in futures.values():
            future.set_exception(CoreDeadError(reason))

    def is_alive(self) -> bool:
        return self._dead is None and self.process.poll() is None

    def busy_for(self) -> float:
        """Seconds the core has spent in its current step, or, when longer, since the oldest
        message it has not taken yet was sent (a core frozen while idle never steps); 0.0 while
        it is idle with nothing waiting. Any thread."""
        if self._closed:
            return 0.0
        with self._unacked_lock:
            self._forget_taken()
            waiting = time.monotonic() - self._unacked[0][1] if self._unacked else 0.0
        return max(self._clock.busy_for(), waiting)

    def call_async(self, method: str, *args: Any) -> Future:
        """Send the utility call `EngineCore.<method>(*args)` (run in the core between its
        steps) and return its future at once; see the module docstring. CoreDeadError when the
        core is gone already."""
        self._calls += 1
        future: Future = Future()
        future.set_running_or_notify_cancel()  # nobody can cancel it: it is answered or failed
        self._send(UtilityCall(self._calls, method, list(args)))
        self._futures[self._calls] = (method, future)
        return future

    def has_pending_calls(self) -> bool:
        """Whether a utility call waits for its answer (the owner should keep receiving)."""
        return bool(self._futures)

    def call(self, method: str, *args: Any) -> Any:
        """Run `EngineCore.<method>(*args)` in the core between its steps and return what it
        returned (its ValueError / NotPinnedError re-raised here); step outputs that arrive
        meanwhile wait for `get_outputs()`."""
        future = self.call_async(method, *args)
        while not future.done():
            self._receive(self.poll_s)
        return future.result()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (it aborts what runs and frees its memory), then clean up. Idempotent."""
        if self._closed:
            return
        if self.process.poll() is None:
            if self._dead is None:
                with contextlib.suppress(Exception):  # never blocks: a core gone has no socket
                    self._input.send(self._codec.encode(UtilityCall(0, "stop")),
                                     flags=zmq.NOBLOCK)
            else:  # it said it died and is exiting by itself
                timeout = min(timeout, DEAD_CORE_EXIT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self._closed = True
        self._fail_calls("the engine core was shut down")
        if self.process.poll() is None:
            logger.error("the engine core did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.wait(5)
        if self.process.stdin is not None:
            self.process.stdin.close()
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._waker_r.close()
        self._waker_w.close()
        self._clock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
