"""`pagedkv serve MODEL_DIR`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedkv serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                  [--api-key KEY] [--max-pending N] [--max-request-bytes N]
                  [--shutdown-timeout S] [--engine-stall-timeout S] [--request-log PATH]
                  [engine flags: --block-size, --dtype, ...]

Every `EngineArgs` field is a flag with vLLM's name (see `pagedkv serve --help`). With
`--api-key` (or PAGEDKV_API_KEY in the environment) every /v1 route needs
`Authorization: Bearer KEY`. `--max-pending` bounds the requests in flight; beyond it the
server answers 503 instead of queueing without limit. A body over `--max-request-bytes` is a
413. The port is bound before the model loads (a busy port fails at once). SIGTERM / SIGINT
drain: new requests get 503, those in flight get `--shutdown-timeout` seconds to finish, the
rest end with an error (streams: an error event and [DONE]); then the process exits 0. When
the engine loop dies the process exits 1, saying why; while one engine step has run longer than
`--engine-stall-timeout` seconds, /health answers 503 (a wedged engine). The scheduler, KV cache
and model runner run in a child process (pagedkv/engine/core_proc.py; `--engine-core inproc`:
in a thread of this one): a core that dies ends the server the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from pagedkv.commands.engine_flags import (
    HelpFormatter,
    add_engine_flags,
    engine_args_from_flags,
    positive_number,
)
from pagedkv.server.tool_parsers import TOOL_PARSERS  # plain Python: keeps --help light

DEFAULT_PORT = 8000

ENGINE_CORE_MODES = ("process", "inproc")
ENGINE_CORE_ENV = "PAGEDKV_ENGINE_CORE"

logger = logging.getLogger("pagedkv.server")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter)
    parser.add_argument("model", metavar="MODEL_DIR",
                        help="model directory, .gguf file or Hugging Face id (org/name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="model name the API answers to (default: MODEL_DIR's name)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $PAGEDKV_API_KEY, else none)")
    parser.add_argument("--max-pending", type=int, default=None, metavar="N",
                        help="most requests in flight before answering 503 (default: 4096)")
    parser.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                        help="largest request body; larger ones get 413 (default: 4 MiB)")
    parser.add_argument("--shutdown-timeout", type=positive_number, default=5.0, metavar="S",
                        help="on SIGTERM/SIGINT, seconds the requests in flight get to finish")
    parser.add_argument("--engine-stall-timeout", type=positive_number, default=None,
                        metavar="S", help="/health answers 503 while one engine step has run "
                        "longer than this (a wedged engine; default: 120)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="parse the model's tool calls in this format, enabling "
                        'tool_choice "auto" (vLLM\'s names)')
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM compatibility: --tool-call-parser enables "
                        'tool_choice "auto"')
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="answer 400 for request fields no API of ours defines (default: "
                        "ignore them with a logged warning, as vLLM does)")
    parser.add_argument("--request-log", default=None, metavar="PATH",
                        help="append one JSON line per finished request (a trace for "
                        "`pagedkv simulate`)")
    parser.add_argument("--log-level", default="info", help="log verbosity",
                        choices=("critical", "error", "warning", "info", "debug"))
    parser.add_argument("--engine-core", choices=ENGINE_CORE_MODES, default=None,
                        help="where the engine core (scheduler, KV cache, model runner) runs: "
                        "'process' (its own process; the HTTP server, tokenizer and "
                        "detokenizer stay in this one) or 'inproc' (a thread of this process). "
                        f"Default: ${ENGINE_CORE_ENV} when set, else 'process'")
    add_engine_flags(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.model.hub import looks_like_repo_id
    from pagedkv.server.app import (
        DEFAULT_MAX_PENDING,
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_STALL_TIMEOUT_S,
        create_app,
    )
    from pagedkv.server.graceful import DrainingServer, bind_socket

    if not Path(args.model).exists() and not looks_like_repo_id(args.model):
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_pending", "max_request_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from_flags(args, args.model)
    if engine_args.node_rank > 0:  # another machine's tensor-parallel ranks: no server here
        from pagedkv.engine.executor import run_node_ranks

        return run_node_ranks(engine_args)
    sock = bind_socket(args.host, args.port)  # before the slow part: a busy port fails now
    engine = None
    try:
        engine = LLMEngine.from_engine_args(
            engine_args, core_process=engine_core_mode(args.engine_core) == "process")
        server: DrainingServer | None = None

        def on_engine_dead(reason: str) -> None:
            if server is not None:
                server.stop_for_dead_engine(reason)

        app = create_app(
            engine, served_model_name=args.served_model_name or default_model_name(args.model),
            api_key=args.api_key or None,
            max_pending=args.max_pending or DEFAULT_MAX_PENDING,
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            tool_call_parser=args.tool_call_parser, on_engine_dead=on_engine_dead,
            stall_timeout_s=args.engine_stall_timeout or DEFAULT_STALL_TIMEOUT_S,
            strict_request_fields=args.strict_request_fields)
        if args.request_log:
            from pagedkv.server.request_log import RequestLog

            app.state.serving.request_log = RequestLog(args.request_log, engine.block_hasher())
        config = uvicorn.Config(app, log_level=args.log_level)
        server = DrainingServer(config, app.state.async_engine, args.shutdown_timeout)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()  # stops the core process (a no-op for a stopped one)
    if server.exit_reason is not None:
        logger.critical("pagedkv serve: exiting because the engine failed: %s",
                        server.exit_reason)
        return 1
    return 0


def engine_core_mode(flag: str | None) -> str:
    """The --engine-core mode: the flag, else $PAGEDKV_ENGINE_CORE, else 'process' (vLLM's
    layout; see the README's "The engine core process")."""
    mode = flag or os.environ.get(ENGINE_CORE_ENV) or "process"
    if mode not in ENGINE_CORE_MODES:
        raise ValueError(f"{ENGINE_CORE_ENV} must be one of {ENGINE_CORE_MODES}, got {mode!r}")
    return mode


def default_model_name(model_dir: str) -> str:
    """The served model name when none is given: the model directory's own name."""
    return Path(model_dir).resolve().name or model_dir
