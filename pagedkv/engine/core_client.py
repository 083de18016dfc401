"""How the frontend talks to its engine core: one interface, two clients.

- `InprocCoreClient`: the core lives in this process (offline `LLM`, and every engine test);
  calls go straight to it, with the same message objects the other client sends.
- `MPCoreClient`: the core runs in a child process (`core_proc.py`) and the messages travel
  msgpack-encoded over two ZMQ IPC sockets in a private temporary directory.

Both are owned by one thread (the one that steps the engine); only `wake()` may be called from
any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
from pagedkv.engine.utility import run_utility
from pagedkv.kv.pins import NotPinnedError, PinInfo
from pagedkv.sched.request import RequestStatus

logger = logging.getLogger(__name__)

# Seconds to wait for the core to build (model load, KV cache) before giving up.
CORE_START_TIMEOUT_S = 600.0


class CoreDeadError(EngineFatalError):
    """The engine core process is gone (crashed, killed, or its loop failed): the engine
    cannot go on (the server's loop ends and the server exits, saying why)."""


class CoreClient(Protocol):
    ready: EngineReady

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort(self, message: Abort) -> None: ...
    def get_outputs(self) -> list[CoreOutput]: ...
    def has_work(self) -> bool: ...
    def call(self, method: str, *args: Any) -> Any: ...
    def is_alive(self) -> bool: ...
    def wake(self) -> None: ...
    def shutdown(self) -> None: ...


def apply_abort(core: EngineCore, message: Abort) -> None:
    status = RequestStatus.FINISHED_STOPPED if message.status == "stop" \
        else RequestStatus.FINISHED_ABORTED
    core.finish_requests(message.request_ids, status, message.stop_reason)


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

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def call(self, method: str, *args: Any) -> Any:
        return run_utility(self.core, method, args)

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


def _result(method: str, value: Any) -> Any:
    kind = _RESULTS.get(method)
    if kind is EngineStats:
        return EngineStats(**{**value, "kv_store_tiers": tuple(value["kv_store_tiers"])})
    return kind(**value) if kind is not None else value


class MPCoreClient:
    """The core in a child process; see the module docstring. `get_outputs()` returns the
    outputs that arrived, waiting up to `poll_s` (or until `wake()`) for some."""

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
        self._pending: list[CoreOutput] = []
        self._calls = 0
        self._dead: str | None = None
        self._closed = False
        # A fresh interpreter (not multiprocessing): nothing of the caller's __main__ re-runs.
        command = [sys.executable, "-m", "pagedkv.engine.core_proc", in_addr, out_addr,
                   msgspec.json.encode(args).decode(), str(logging.getLogger().getEffectiveLevel())]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
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
                if isinstance(message, CoreDied):
                    raise _ERRORS.get(message.error_type or "", RuntimeError)(message.reason)
            elif self.process.poll() is not None:
                raise CoreDeadError(f"the engine core process exited with code "
                                    f"{self.process.returncode} while starting")
        raise CoreDeadError(f"the engine core did not start within {CORE_START_TIMEOUT_S:.0f} s")

    # ---- sending ------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._check_alive()
        self._input.send(self._codec.encode(message), copy=False)

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

    def has_work(self) -> bool:
        return bool(self._pending)

    def get_outputs(self) -> list[CoreOutput]:
        if not self._pending:
            self._receive(self.poll_s)
        outputs, self._pending = self._pending, []
        return outputs

    def _receive(self, timeout_s: float, call_id: int | None = None) -> UtilityResult | None:
        """Receive what is there (waiting up to `timeout_s` for the first message); returns the
        answer to `call_id` when it came."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._waker_r.fileno() in ready:
            with contextlib.suppress(BlockingIOError):
                self._waker_r.recv(4096)
        answer = None
        while True:
            try:
                data = self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._codec.decode_core(data)
            if isinstance(message, CoreStepOutputs):
                self._pending.extend(message.outputs)
            elif isinstance(message, UtilityResult):
                if message.call_id == call_id:
                    answer = message
            elif isinstance(message, CoreDied):
                self._dead = message.reason
        if answer is None:
            self._check_alive()
        return answer

    def _check_alive(self) -> None:
        if self._dead is None and self.process.poll() is not None and not self._closed:
            self._dead = f"the engine core process died (exit code {self.process.returncode})"
        if self._dead is not None:
            raise CoreDeadError(self._dead)

    def is_alive(self) -> bool:
        return self._dead is None and self.process.poll() is None

    def call(self, method: str, *args: Any) -> Any:
        """Run `EngineCore.<method>(*args)` in the core between its steps and return what it
        returned (its ValueError / NotPinnedError re-raised here)."""
        self._calls += 1
        call_id = self._calls
        self._send(UtilityCall(call_id, method, list(args)))
        while True:
            answer = self._receive(self.poll_s, call_id)
            if answer is not None:
                break
        if answer.error_type is not None:
            raise _ERRORS.get(answer.error_type, RuntimeError)(answer.error)
        return _result(method, answer.result)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (it aborts what runs and frees its memory), then clean up. Idempotent."""
        if self._closed:
            return
        if self.process.poll() is None and self._dead is None:
            with contextlib.suppress(Exception):
                self._input.send(self._codec.encode(UtilityCall(0, "stop")))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self._closed = True
        if self.process.poll() is None:
            logger.error("the engine core did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.wait(5)
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._waker_r.close()
        self._waker_w.close()
        shutil.rmtree(self._dir, ignore_errors=True)
