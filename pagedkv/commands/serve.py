"""`pagedkv serve MODEL_DIR`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedkv serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                  [--chat-template FILE_OR_TEMPLATE] [--api-key KEY] [--max-pending N]
                  [--max-request-bytes N]
                  [--shutdown-timeout S] [--engine-stall-timeout S] [--request-log PATH]
                  [engine flags: --block-size, --dtype, ...]

Every `EngineArgs` field is a flag with vLLM's name (see `pagedkv serve --help`). With
`--api-key` (or PAGEDKV_API_KEY in the environment) every /v1 route needs
`Authorization: Bearer KEY`. `--max-pending` bounds the requests in flight; beyond it the
server answers 503 instead of queueing without limit. A body over `--max-request-bytes` is a
413. The port is bound before the model loads (a busy port fails at once). SIGTERM / SIGINT
drain: new requests get 503, those in flight get `--shutdown-timeout` seconds to finish, the
rest end with an error (streams: an error event and [DONE]); then the process exits 0. When
the engine loop dies the process exits 1, saying why; while one engine step, or work sent to the
core and not yet taken, is older than `--engine-stall-timeout` seconds, /health answers 503 (a
wedged engine). The scheduler, KV cache
and model runner run in a child process (pagedkv/engine/core_proc.py; `--engine-core inproc`:
in a thread of this one): a core that dies ends the server the same way.

As vLLM: the model may be given as `--model MODEL_DIR` too, and the API answers to the model
argument exactly as given unless `--served-model-name` says otherwise. The flags are checked
before anything heavy is imported (a mistake answers at once); the server then logs the weight
load (and a first CPU kernel build) and, once ready, a banner: its URL, the model, dtype and
device, the KV cache's blocks and bytes, the maximum concurrency at max_model_len, the engine
core's pid and the CPU kernels in use (server/banner.py). Health checks and metric scrapes are
logged at DEBUG, requests at INFO (pagedkv/http/access_log.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.commands.early_checks import check_before_loading
from pagedkv.commands.engine_flags import (
    HelpFormatter,
    add_engine_flags,
    add_model_argument,
    engine_args_from_flags,
    model_argument,
    positive_number,
)
from pagedkv.http.access_log import LOG_FORMAT
from pagedkv.server.tool_parsers import TOOL_PARSERS  # plain Python: keeps --help light

if TYPE_CHECKING:
    from pagedkv.engine.args import EngineArgs

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
    add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="model name the API answers to (default: the model argument as "
                        "given, as vLLM)")
    parser.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                        help="chat template for /v1/chat/completions: a file, or the Jinja "
                        "template itself (default: the model's)")
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
                        metavar="S", help="/health answers 503 while one engine step, or work "
                        "sent to the engine and not yet taken, is older than this (a wedged "
                        "engine; default: 120)")
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


def check_flags(args: argparse.Namespace) -> EngineArgs:
    """Check every flag that needs no model loaded (no torch imported: a mistake answers in
    well under a second) and return the engine's arguments. Sets `args.model` to the model
    given positionally or as --model, and `args.chat_template` to the template's text.
    Raises ValueError / FileNotFoundError naming the flag."""
    from pagedkv.model.hub import looks_like_repo_id

    args.model = model_argument(args)
    if not Path(args.model).exists() and not looks_like_repo_id(args.model):
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_pending", "max_request_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    engine_core_mode(args.engine_core)
    if args.chat_template is not None:
        from pagedkv.commands.chat_template import load_chat_template

        args.chat_template = load_chat_template(args.chat_template)
    engine_args = engine_args_from_flags(args, args.model)
    if engine_args.data_parallel_size > 1 and engine_core_mode(args.engine_core) == "inproc":
        raise ValueError(f"--data-parallel-size {engine_args.data_parallel_size} runs each "
                         "engine core in its own process: it does not combine with "
                         "--engine-core inproc")
    return engine_args


def run(args: argparse.Namespace) -> int:
    engine_args = check_flags(args)  # before the heavy imports below
    check_before_loading(engine_args)  # what this machine and the model's config.json tell
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if engine_args.node_rank > 0:  # another machine's tensor-parallel ranks: no server here
        from pagedkv.engine.executor import run_node_ranks

        return run_node_ranks(engine_args)
    from pagedkv.server.graceful import bind_socket

    sock = bind_socket(args.host, args.port)  # before the slow part: a busy port fails now
    try:
        return _serve(args, engine_args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, engine_args: EngineArgs, sock: Any) -> int:
    """Load the engine and serve on the bound `sock` until a signal (or the engine's death)."""
    import uvicorn

    from pagedkv.cli import package_version
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.http.access_log import uvicorn_log_config
    from pagedkv.server.app import (
        DEFAULT_MAX_PENDING,
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_STALL_TIMEOUT_S,
        create_app,
    )
    from pagedkv.server.banner import listen_url, log_banner
    from pagedkv.server.graceful import DrainingServer
    from pagedkv.utils import freeze_gc_heap

    served_model_name = args.served_model_name or args.model
    logger.info("pagedkv %s: loading %s (the server listens on %s once it is loaded)",
                package_version(), args.model, listen_url(sock))
    engine = None
    server: DrainingServer | None = None
    try:
        engine = LLMEngine.from_engine_args(
            engine_args, core_process=engine_core_mode(args.engine_core) == "process")
        if args.chat_template is not None:
            engine.tokenizer.use_chat_template(args.chat_template)

        def on_engine_dead(reason: str) -> None:
            if server is not None:
                server.stop_for_dead_engine(reason)

        def on_ready() -> None:
            log_banner(engine, url=listen_url(sock), served_model_name=served_model_name,
                       version=package_version())

        app = create_app(
            engine, served_model_name=served_model_name,
            api_key=args.api_key or None,
            max_pending=args.max_pending or DEFAULT_MAX_PENDING,
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            tool_call_parser=args.tool_call_parser, on_engine_dead=on_engine_dead,
            stall_timeout_s=args.engine_stall_timeout or DEFAULT_STALL_TIMEOUT_S,
            strict_request_fields=args.strict_request_fields, on_ready=on_ready)
        if args.request_log:
            from pagedkv.server.request_log import RequestLog

            app.state.serving.request_log = RequestLog(args.request_log, engine.block_hasher(),
                                                       registry=app.state.metrics.registry)
        config = uvicorn.Config(app, log_level=args.log_level, log_config=uvicorn_log_config())
        server = DrainingServer(config, app.state.async_engine, args.shutdown_timeout)
        # What start-up left alive (the modules, the model) out of every collection, as vLLM's
        # server and the router do: the engine's shutdown, and the interpreter's exit, then
        # collect over what serving allocated, not the whole heap (a stop took seconds).
        freeze_gc_heap()
        server.run(sockets=[sock])
    finally:
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
