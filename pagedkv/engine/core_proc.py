"""The engine core's own process: build an `EngineCore`, say ready, then a busy loop.

    loop: take every message waiting (requests, aborts, utility calls; block while idle)
          -> one core step -> queue its outputs (an output thread encodes and sends them
             while the next step runs)

Each step's start time goes to the frontend through a shared step clock (step_clock.py), so
the server's /health sees a step that never returns.

The frontend (`core_client.MPCoreClient`) owns the process: SIGINT (a terminal's Ctrl-C, sent
to the whole process group) is ignored here (the frontend drains, then sends "stop"), and the
loop exits by itself when the frontend process is gone. A step that raises outside the model runner ends the requests in flight
with an internal error; when the KV cache's invariants no longer hold afterwards the core says
why (`CoreDied`) and exits, and the frontend ends the server.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from pagedkv.config.errors import EngineFatalError
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

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how often an idle core checks that its frontend still lives


def main(argv: list[str]) -> None:
    """`python -m pagedkv.engine.core_proc IN_ADDR OUT_ADDR ENGINE_ARGS_JSON LOG_LEVEL
    CLOCK_PATH`."""
    in_addr, out_addr, args_json, log_level, clock_path = argv
    run_engine_core(msgspec.json.decode(args_json, type=EngineArgs), in_addr, out_addr,
                    int(log_level), clock_path)


def run_engine_core(args: EngineArgs, in_addr: str, out_addr: str,
                    log_level: int = logging.WARNING, clock_path: str | None = None) -> None:
    """The child process's entry point (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    inputs.connect(in_addr)
    outputs.connect(out_addr)
    codec = Codec()
    try:
        from pagedkv.engine.core import EngineCore

        core = EngineCore(args)
    except BaseException as exc:  # the frontend raises it again, by type
        logger.exception("the engine core failed to start")
        outputs.send(codec.encode(CoreDied(str(exc), type(exc).__name__)))
        inputs.close(linger=0)  # ctx.term() waits for every socket: an open one hangs it
        outputs.close(linger=5000)
        ctx.term()
        return
    outputs.send(codec.encode(core.ready()))
    sender = _OutputThread(outputs)
    clock = StepClock(clock_path) if clock_path else None
    try:
        _CoreLoop(core, inputs, sender, codec, clock).run()
    finally:
        core.shutdown()
        sender.close()
        if clock is not None:
            clock.close()
        inputs.close(linger=0)
        outputs.close(linger=5000)
        ctx.term()


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

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(30)


class _CoreLoop:
    def __init__(self, core: Any, inputs: zmq.Socket, outputs: _OutputThread,
                 codec: Codec, clock: StepClock | None = None) -> None:
        self.core = core
        self.clock = clock
        self.inputs = inputs
        self.outputs = outputs
        self.codec = codec
        self.parent = os.getppid()
        self.stopping = False

    def run(self) -> None:
        core = self.core
        while not self.stopping:
            busy = core.has_unfinished_requests()
            if not busy and self.clock is not None:
                self.clock.idle()
            self._take_inputs(0 if busy else _IDLE_POLL_MS)
            if self.stopping:
                return
            if not busy and os.getppid() != self.parent:
                logger.warning("the frontend process is gone; the engine core exits")
                return
            if core.has_unfinished_requests() and not self._step():
                return

    def _send(self, message: Any) -> None:
        self.outputs.send(message)

    def _take_inputs(self, timeout_ms: int) -> None:
        while self.inputs.poll(timeout_ms):
            timeout_ms = 0
            message = self.codec.decode_frontend(self.inputs.recv())
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
                                                   error=str(exc), error_kind="invalid")]))

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
            self._send(CoreStepOutputs(outs, time.monotonic()))
        return True


if __name__ == "__main__":
    main(sys.argv[1:])
