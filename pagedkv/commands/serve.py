"""`pagedkv serve MODEL_DIR`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedkv serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                  [--api-key KEY] [--max-pending N] [engine flags: --block-size, --dtype, ...]

Every `EngineArgs` field is a flag with vLLM's name (see `pagedkv serve --help`). With
`--api-key` (or PAGEDKV_API_KEY in the environment) every /v1 route needs
`Authorization: Bearer KEY`. `--max-pending` bounds the requests in flight; beyond it the
server answers 503 instead of queueing without limit.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from pagedkv.commands.engine_flags import add_engine_flags, engine_args_from_flags
from pagedkv.server.tool_parsers import TOOL_PARSERS  # plain Python: keeps --help light

DEFAULT_PORT = 8000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", metavar="MODEL_DIR", help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="model name the API answers to (default: MODEL_DIR as given)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $PAGEDKV_API_KEY, else none)")
    parser.add_argument("--max-pending", type=int, default=None, metavar="N",
                        help="most requests in flight before answering 503 (default: 4096)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="parse the model's tool calls in this format, enabling "
                        'tool_choice "auto" (vLLM\'s names)')
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM compatibility: --tool-call-parser enables "
                        'tool_choice "auto"')
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))
    add_engine_flags(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.server.app import DEFAULT_MAX_PENDING, create_app

    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_pending is not None and args.max_pending < 1:
        raise ValueError(f"--max-pending must be a positive integer, got {args.max_pending}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine.from_engine_args(engine_args_from_flags(args, args.model))
    app = create_app(engine, served_model_name=args.served_model_name or args.model,
                     api_key=args.api_key or None,
                     max_pending=DEFAULT_MAX_PENDING if args.max_pending is None
                     else args.max_pending, tool_call_parser=args.tool_call_parser)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
