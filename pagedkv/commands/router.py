"""`pagedkv router --backend URL [--backend URL ...]`: a KV-cache-aware OpenAI-compatible front.

    pagedkv router --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
                   (or --prefill URL [URL ...] --decode URL [URL ...] [--pd-prefill-timeout 30]) \\
                   [--policy kv-aware|round-robin|least-load|session] [--model MODEL_DIR] \\
                   [--kv-events tcp://127.0.0.1:5557 ...] [--host 127.0.0.1] [--port 8080] \\
                   [--api-key KEY] [--backend-api-key KEY [--allow-anonymous-clients]] \\
                   [--first-byte-timeout 60] [--connect-timeout 2] [--eject-seconds 5] \\
                   [score weights: --prefill-weight ...]

Clients talk to it exactly as to `pagedkv serve`. kv-aware hashes prompts as the engine does:
with `--model` (the backends' model directory) it tokenizes them itself, else it asks a backend
serving the request's model for the token ids (its /tokenize, which vLLM has too); the block size and hash algorithm come from the backends' /kv_cache_info unless given
(vLLM has none: the block size then comes from its KV events, which are matched by their token
ids, since vLLM's block hashes are its own).
`--kv-events` pairs, in order, each backend with its ZMQ KV-event endpoint ("-" for none;
in prefill/decode mode the prefill instances first, then the decode ones);
without events the router predicts each backend's cache from where it sent which prompts.
With `--prefill URL... --decode URL...` instead of `--backend` (prefill/decode disaggregation,
vLLM's wire: pagedkv/router/pd.py) each completion is prefilled on a prefill instance, then
decoded on a decode instance with the producer's kv_transfer_params; a prefill that fails,
answers without them, or takes over `--pd-prefill-timeout` falls back to a normal request on a
decode instance.
No key is read from the server's $PAGEDKV_API_KEY: the backends' key is `--backend-api-key`
(or $PAGEDKV_ROUTER_BACKEND_API_KEY), and a router holding one needs its own `--api-key` for
clients unless `--allow-anonymous-clients` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from pagedkv.router.app import DEFAULT_CONNECT_TIMEOUT_S
from pagedkv.router.pd import DEFAULT_PREFILL_TIMEOUT_S
from pagedkv.router.policies import POLICY_NAMES
from pagedkv.router.policies.kv_aware import KVAwareWeights
from pagedkv.router.proxy import DEFAULT_FIRST_BYTE_TIMEOUT_S
from pagedkv.router.router import DEFAULT_EJECT_S, DEFAULT_RECORD_TTL_S, MAX_EJECT_S

DEFAULT_PORT = 8080


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `router` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "router", help="KV-cache-aware router in front of several `pagedkv serve` instances",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", action="append", default=None, metavar="URL",
                        help="a backend's base URL (repeat for each backend)")
    pd = parser.add_argument_group(
        "prefill/decode disaggregation (instead of --backend; vllm-router's flags)")
    pd.add_argument("--prefill", action="extend", nargs="+", default=None, metavar="URL",
                    help="prefill instances (KV producers), picked by --policy; a number "
                    "after a URL (sglang-router's bootstrap port) is accepted and unused")
    pd.add_argument("--decode", action="extend", nargs="+", default=None, metavar="URL",
                    help="decode instances (KV consumers), picked by load and KV room")
    pd.add_argument("--pd-disaggregation", "--vllm-pd-disaggregation", action="store_true",
                    help="prefill/decode mode (implied by --prefill and --decode)")
    pd.add_argument("--pd-prefill-timeout", type=float, default=DEFAULT_PREFILL_TIMEOUT_S,
                    metavar="SECONDS", help="a prefill hop not answered within this long is "
                    "abandoned and the request decodes as a normal request")
    parser.add_argument("--kv-events", action="append", default=None, metavar="ENDPOINT",
                        help="the ZMQ KV-event endpoint of the backend in the same position "
                        "('-' for none)")
    parser.add_argument("--policy", default="kv-aware", choices=POLICY_NAMES)
    parser.add_argument("--model", default=None, metavar="MODEL_DIR",
                        help="the backends' model (directory, .gguf file or Hugging Face id), to "
                        "tokenize prompts in the router "
                        "(tokenizer and chat template); without it kv-aware asks a backend's "
                        "/tokenize")
    parser.add_argument("--block-size", type=int, default=None,
                        help="the backends' block size (default: from their /kv_cache_info)")
    parser.add_argument("--prefix-caching-hash-algo", default=None, choices=("sha256", "xxhash"),
                        help="the backends' hash algorithm (default: from /kv_cache_info)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDKV_ROUTER_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $PAGEDKV_ROUTER_API_KEY, else none)")
    parser.add_argument("--backend-api-key",
                        default=os.environ.get("PAGEDKV_ROUTER_BACKEND_API_KEY"),
                        help="the key the backends require (default: "
                        "$PAGEDKV_ROUTER_BACKEND_API_KEY, else none; never the server's "
                        "$PAGEDKV_API_KEY)")
    parser.add_argument("--allow-anonymous-clients", action="store_true",
                        help="with --backend-api-key but no --api-key: serve clients without "
                        "a key (they then use the backend key through the router)")
    parser.add_argument("--first-byte-timeout", type=float, default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
                        metavar="SECONDS", help="a backend that sends no byte of its answer "
                        "within this long is ejected for a while and the request is tried on "
                        "another (504 when none answers); a non-streaming answer's first byte "
                        "is the whole answer, so this also bounds its generation time")
    parser.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                        metavar="SECONDS", help="a backend that accepts no connection within "
                        "this long is marked down and the request tried on another")
    parser.add_argument("--eject-seconds", type=float, default=DEFAULT_EJECT_S,
                        metavar="SECONDS", help="how long a backend that failed a request "
                        "(timeout, garbled answer) gets nothing new; doubled for each further "
                        f"failure in a row, at most {MAX_EJECT_S:g} s")
    parser.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                        help="largest request body; larger ones get 413 (default: 4 MiB)")
    parser.add_argument("--record-ttl", type=float, default=DEFAULT_RECORD_TTL_S,
                        metavar="SECONDS", help="how long the router's own record of a "
                        "prompt's blocks on a backend counts as a cache hit")
    parser.add_argument("--shared-tier", action="append", default=None, metavar="MEDIUM",
                        help="event media every backend can load from (default: REDIS)")
    parser.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--health-timeout", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))
    parser.add_argument("--access-log", action="store_true",
                        help="log every request at INFO (health checks and metric scrapes: "
                        "DEBUG): uvicorn's access log and httpx's line per request sent to a "
                        "backend (off by default: a line per request "
                        "costs the hot path; /metrics counts them)")
    weights = parser.add_argument_group("kv-aware score (see pagedkv/router/policies/kv_aware.py)")
    for f in fields(KVAwareWeights):
        weights.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default)
    parser.set_defaults(run=run)
    return parser


def build_router(args: argparse.Namespace):
    """The `Router` the flags describe (ValueError naming a bad flag)."""
    check_keys(args)
    check_timeouts(args)
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.router.backend import Backend
    from pagedkv.router.pd import pd_backends
    from pagedkv.router.policies import make_policy
    from pagedkv.router.router import Router

    endpoints = [None if ep == "-" else ep for ep in args.kv_events or []]
    if pd_mode(args):
        backends = pd_backends(pd_urls(args.prefill or [], "--prefill"),
                               pd_urls(args.decode or [], "--decode"), endpoints)
    else:
        if endpoints and len(endpoints) != len(args.backend):
            raise ValueError(f"--kv-events is given {len(endpoints)} times for "
                             f"{len(args.backend)} backends; give one per backend ('-' for none)")
        backends = [Backend(url, events_endpoint=ep)
                    for url, ep in zip(args.backend, endpoints or [None] * len(args.backend),
                                       strict=True)]
    weights = KVAwareWeights(**{f.name: getattr(args, f.name) for f in fields(KVAwareWeights)})
    if args.model is not None:
        from pagedkv.model.hub import resolve_model

        args.model = resolve_model(args.model)  # a directory, a .gguf file or a Hub id
        if not Path(args.model).exists():
            raise FileNotFoundError(f"model {args.model!r} does not exist")
    if (args.block_size is None) != (args.prefix_caching_hash_algo is None):
        raise ValueError("give --block-size and --prefix-caching-hash-algo together, or neither")
    if args.block_size is not None and args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    settings = (None if args.block_size is None
                else (args.block_size, args.prefix_caching_hash_algo))
    tokenizer = Tokenizer.from_dir(args.model) if args.model is not None else None
    return Router(backends, make_policy(args.policy, weights), tokenizer=tokenizer,
                  hash_settings=settings, record_ttl_s=args.record_ttl,
                  shared_media=tuple(args.shared_tier or ("REDIS",)), weights=weights,
                  eject_s=args.eject_seconds)


def pd_mode(args: argparse.Namespace) -> bool:
    """Whether the flags ask for prefill/decode mode; ValueError when they mix it up with
    --backend or give one side only."""
    split = bool(args.prefill or args.decode or args.pd_disaggregation)
    if split and args.backend:
        raise ValueError("give --backend (one kind of instance), or --prefill and --decode "
                         "(prefill/decode mode), not both")
    if split and not (args.prefill and args.decode):
        raise ValueError("prefill/decode mode needs --prefill URL... and --decode URL...")
    if not split and not args.backend:
        raise ValueError("give --backend URL..., or --prefill URL... and --decode URL...")
    return split


def pd_urls(tokens: list[str], flag: str) -> list[str]:
    """The URLs among `tokens`, dropping the bootstrap port sglang-router's `--prefill URL
    PORT` may put after one (a number, or "none"); ValueError naming anything else."""
    urls: list[str] = []
    for token in tokens:
        if urls and (token.isdigit() or token.lower() == "none"):
            continue
        if not token.startswith(("http://", "https://")):
            raise ValueError(f"{flag} takes base URLs (http://host:port), got {token!r}")
        urls.append(token)
    return urls


def build_pd(args: argparse.Namespace, router: Any) -> Any:
    """The `PDMode` over `router` the flags ask for, else None."""
    from pagedkv.router.pd import PDMode

    if not pd_mode(args):
        return None
    return PDMode(router, prefill_timeout_s=args.pd_prefill_timeout)


def check_keys(args: argparse.Namespace) -> None:
    """ValueError when the router would lend its backend key to anonymous clients."""
    if args.backend_api_key and not args.api_key and not args.allow_anonymous_clients:
        raise ValueError("--backend-api-key without --api-key would let anyone use the backend "
                         "key through the router: give --api-key KEY for clients, or "
                         "--allow-anonymous-clients to serve them without one")


def check_timeouts(args: argparse.Namespace) -> None:
    """ValueError naming a timeout flag that is not a positive number of seconds."""
    for flag, value in (("--first-byte-timeout", args.first_byte_timeout),
                        ("--connect-timeout", args.connect_timeout),
                        ("--eject-seconds", args.eject_seconds),
                        ("--pd-prefill-timeout", args.pd_prefill_timeout)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")


def max_request_bytes(args: argparse.Namespace) -> int:
    """--max-request-bytes, or the server's default; ValueError naming the flag when < 1."""
    from pagedkv.http.body_limit import DEFAULT_MAX_REQUEST_BYTES

    if args.max_request_bytes is None:
        return DEFAULT_MAX_REQUEST_BYTES
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be a positive integer, "
                         f"got {args.max_request_bytes}")
    return args.max_request_bytes


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedkv.http.access_log import LOG_FORMAT, uvicorn_log_config
    from pagedkv.router.app import create_router_app
    from pagedkv.server.graceful import CleanExitServer, bind_socket
    from pagedkv.utils import freeze_gc_heap

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if not args.access_log:  # httpx logs every request it sends (forwards, health checks) at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    router = build_router(args)
    app = create_router_app(router, api_key=args.api_key or None,
                            backend_api_key=args.backend_api_key or None,
                            health_interval_s=args.health_interval,
                            health_timeout_s=args.health_timeout,
                            max_request_bytes=max_request_bytes(args),
                            first_byte_timeout_s=args.first_byte_timeout,
                            connect_timeout_s=args.connect_timeout,
                            allow_anonymous_clients=args.allow_anonymous_clients,
                            pd=build_pd(args, router))
    sock = bind_socket(args.host, args.port)
    freeze_gc_heap()
    try:
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                access_log=args.access_log, log_config=uvicorn_log_config())
        CleanExitServer(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
