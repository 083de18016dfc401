"""The engine core's own process: build an `EngineCore`, say ready, then a busy loop.

    loop: take every message waiting (requests, aborts, utility calls; block while idle)
          -> one core step -> queue its outputs (an output thread encodes and sends them
             while the next step runs)

Each step's start time goes to the frontend through a shared step clock (step_clock.py), so
the server's /health sees a step that never returns.

The frontend (`core_client.MPCoreClient`) owns the process: SIGINT and SIGTERM (a terminal's
Ctrl-C, or a service manager's stop, sent to the whole process group) are ignored here (the
frontend drains, then sends "stop"). The core also stops when the frontend is gone, whatever
killed it: its standard input is a pipe whose other end only the frontend holds, and end of
file there (checked between steps and while idle) aborts the requests, stops the
tensor-parallel workers, removes the client's private folder and exits. Each message taken
is counted on the shared clock, so the frontend sees work that a frozen core never took.
A step that raises outside the model runner ends the requests in flight with an internal
error; when the KV cache's invariants no longer hold afterwards the core says why
(`CoreDied`) and exits, and the frontend ends the server. A configuration error found while
building the core (a ValueError) is reported to the frontend without a traceback here: the
frontend raises it again and the command line prints its one line.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import stat
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from pagedkv.config.errors import EngineFatalError, ErrorKind
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.messages import (
    Abort,
    Codec,
    CoreDied,
    CoreInput,
    CoreOutput,
    CoreStepOutputs,
    UtilityCall,
    UtilityResult,
)
from pagedkv.engine.step_clock import StepClock
from pagedkv.engine.utility import run_utility
from pagedkv.utils import freeze_gc_heap

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how often an idle core checks its parent's pid (the pipe wakes it at once)


def main(argv: list[str]) -> None:
    """`python -m pagedkv.engine.core_proc IN_ADDR OUT_ADDR ENGINE_ARGS_JSON LOG_LEVEL
    CLOCK_PATH`."""
    in_addr, out_addr, args_json, log_level, clock_path = argv
    run_engine_core(msgspec.json.decode(args_json, type=EngineArgs), in_addr, out_addr,
                    int(log_level), clock_path)
    # Everything is closed and freed: skip the interpreter's teardown (torch's takes seconds,
    # and a frontend waiting for this exit, or none, gains nothing from it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_engine_core(args: EngineArgs, in_addr: str, out_addr: str,
                    log_level: int = logging.WARNING, clock_path: str | None = None) -> None:
    """The child process's entry point (see the module docstring)."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # the frontend decides when the core stops
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    inputs.connect(in_addr)
    outputs.connect(out_addr)
    codec = Codec()
    from pagedkv.model.cpu_threads import count_as_own

    count_as_own(os.getppid())  # the frontend's CPU is this server's, not another process's
    try:
        from pagedkv.engine.core import EngineCore

        core = EngineCore.from_args(args)
    except BaseException as exc:  # the frontend raises it again, by type
        if isinstance(exc, ValueError):  # a configuration error: its message says it all
            logger.debug("the engine core failed to start", exc_info=True)
        else:
            logger.exception("the engine core failed to start")
        outputs.send(codec.encode(CoreDied(str(exc), type(exc).__name__)))
        inputs.close(linger=0)  # ctx.term() waits for every socket: an open one hangs it
        outputs.close(linger=5000)
        ctx.term()
        return
    freeze_gc_heap()  # the runner's shutdown then collects only what the steps allocated
    outputs.send(codec.encode(core.ready()))
    sender = _OutputThread(outputs)
    clock = StepClock(clock_path) if clock_path else None
    loop = _CoreLoop(core, inputs, sender, codec, clock, frontend_pipe())
    try:
        loop.run()
    finally:
        orphaned = loop.frontend_gone
        if orphaned and clock_path:  # the frontend cannot clean its private folder up now
            shutil.rmtree(os.path.dirname(clock_path), ignore_errors=True)
        core.shutdown()
        sender.close(1.0 if orphaned else 30.0)  # nobody reads a dead frontend's socket
        if clock is not None:
            clock.close()
        inputs.close(linger=0)
        outputs.close(linger=0 if orphaned else 5000)
        ctx.term()


def frontend_pipe() -> int | None:
    """The standard input's descriptor when it is a pipe (the frontend holds its write end,
    so end of file there means the frontend is gone), else None."""
    try:
        return 0 if stat.S_ISFIFO(os.fstat(0).st_mode) else None
    except OSError:
        return None


class _OutputThread:
    """Encodes and sends the core's messages in a thread of its own, so step N's outputs go
    out while step N + 1 runs (the forward pass releases the GIL). Owns the output socket."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedkv-core-output",
                                        daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def _run(self) -> None:
        encoder = Codec()
        while (message := self._queue.get()) is not None:
            self._socket.send(encoder.encode(message), copy=False)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (waiting up to `timeout` seconds), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)


class _CoreLoop:
    def __init__(self, core: Any, inputs: zmq.Socket, outputs: _OutputThread,
                 codec: Codec, clock: StepClock | None = None,
                 frontend_fd: int | None = None) -> None:
        self.core = core
        self.clock = clock
        self.inputs = inputs
        self.outputs = outputs
        self.codec = codec
        self.parent = os.getppid()
        self.frontend_fd = frontend_fd
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        if frontend_fd is not None:
            self.poller.register(frontend_fd, zmq.POLLIN)
        self.taken = 0  # messages taken from the frontend (counted on the shared clock)
        self.stopping = False
        self.frontend_gone = False

    def run(self) -> None:
        core = self.core
        while not self.stopping:
            busy = core.has_unfinished_requests()
            if not busy and self.clock is not None:
                self.clock.idle()
            self._take_inputs(0 if busy else _IDLE_POLL_MS)
            if self.stopping:
                return
            if self.frontend_gone or os.getppid() != self.parent:
                self.frontend_gone = True
                logger.warning("the frontend process is gone; the engine core aborts its "
                               "requests and exits")
                return
            if core.has_unfinished_requests() and not self._step():
                return

    def _send(self, message: Any) -> None:
        self.outputs.send(message)

    def _take_inputs(self, timeout_ms: int) -> None:
        while ready := dict(self.poller.poll(timeout_ms)):
            timeout_ms = 0
            if self.frontend_fd in ready:  # only end of file: the frontend never writes
                self.frontend_gone = True
                return
            message = self.codec.decode_frontend(self.inputs.recv())
            self.taken += 1
            if self.clock is not None:
                self.clock.taken(self.taken)
            if isinstance(message, CoreInput):
                self._add(message)
            elif isinstance(message, Abort):
                from pagedkv.engine.core_client import apply_abort

                apply_abort(self.core, message)
            elif isinstance(message, UtilityCall):
                if message.method == "stop":
                    self.stopping = True
                    return
                self._utility(message)

    def _add(self, message: CoreInput) -> None:
        request = message.request
        try:
            self.core.add_request(request)
        except Exception as exc:  # reported as the request's end; the core goes on
            self._send(CoreStepOutputs([CoreOutput(request.request_id, finish_reason="error",
                                                   error=str(exc), error_kind=ErrorKind.INVALID)]))

    def _utility(self, call: UtilityCall) -> None:
        try:
            result = run_utility(self.core, call.method, call.args)
        except Exception as exc:
            self._send(UtilityResult(call.call_id, error_type=type(exc).__name__, error=str(exc)))
            return
        self._send(UtilityResult(call.call_id, result))

    def _step(self) -> bool:
        """One core step; False when the core cannot go on."""
        if self.clock is not None:
            self.clock.step_started()
        try:
            outs = self.core.step()
        except EngineFatalError as exc:  # e.g. a tensor-parallel rank died: the core ends
            self._send(CoreDied(f"{type(exc).__name__}: {exc}", "EngineFatalError"))
            return False
        except Exception as exc:
            logger.exception("engine step failed; ending the requests in flight")
            outs = self.core.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            try:
                self.core.check_invariants()
            except Exception as broken:
                self._send(CoreStepOutputs(outs, time.monotonic()))
                self._send(CoreDied(f"KV cache invariants broken: {broken}", "RuntimeError"))
                return False
        if outs:
            self._send(step_outputs(self.core, outs))
        return True


def step_outputs(core: Any, outs: list[CoreOutput]) -> CoreStepOutputs:
    """A step's outputs, stamped now, with the core's queues and KV usage after it."""
    scheduler = core.scheduler
    return CoreStepOutputs(outs, time.monotonic(), len(scheduler.running),
                           len(scheduler.waiting) + len(scheduler.loading),
                           scheduler.kv_cache_manager.usage)


if __name__ == "__main__":
    main(sys.argv[1:])
