"""`pagedkv` command line: serve | generate | plan | bench | router | simulate | profile.

Each subcommand lives in `pagedkv/commands/<name>.py` and exposes `add_parser(subparsers)` and
`run(args) -> int`. Only the subcommand named on the command line is imported (its module
imports nothing heavy: torch and the server load in `run`, after the flags are parsed and
checked), so `pagedkv --help`, `--version` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# Each subcommand and its one-line summary (shown by `pagedkv --help` without importing it;
# each module's own `help=` says the same, see tests/server/test_cli_startup.py).
COMMANDS: dict[str, str] = {
    "serve": "OpenAI-compatible HTTP server",
    "generate": "generate a completion for one prompt",
    "plan": "KV cache capacity for a model config and a memory budget",
    "bench": "benchmarks (serve: load a running server)",
    "router": "KV-cache-aware router in front of several `pagedkv serve` instances",
    "simulate": "replay a trace through the real scheduler on a virtual clock",
    "profile": "fit a step-latency model for `pagedkv simulate`",
}


def _load(name: str):
    return importlib.import_module(f"pagedkv.commands.{name}")


def package_version() -> str:
    """pagedkv's version from its installed metadata (the source's `__version__` when it runs
    from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedkv")
    except PackageNotFoundError:
        from pagedkv import __version__

        return __version__


class _VersionAction(argparse.Action):
    """`--version`: print the version and exit (read only when asked: importlib.metadata is
    not free)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(package_version())
        parser.exit()


class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose mistakes are one line, `PROG: error: MESSAGE`, exit code 2, saying where
    the flags are listed (argparse's default prints the usage first: sixty lines for `serve`).
    Subcommands' parsers are of the same class (argparse's `add_subparsers` default)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `pagedkv` parser with subcommand `only`'s full parser (the others as one-line stubs:
    importing every command would import the server and the router)."""
    parser = OneLineErrorParser(prog="pagedkv", description="Paged-KV-cache LLM engine")
    parser.add_argument("--version", action=_VersionAction, help="print pagedkv's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, summary in COMMANDS.items():
        if name == only:
            _load(name).add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand that was given them
        prog = f"pagedkv {args.command}" if args.command else "pagedkv"
        OneLineErrorParser(prog=prog).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:  # every subcommand's parser sets `run`
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
