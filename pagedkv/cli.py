"""`pagedkv` command line: serve | generate | plan | bench | router | simulate | profile.

Each subcommand lives in `pagedkv/commands/<name>.py` and exposes `add_parser(subparsers)` and
`run(args) -> int`. Modules load lazily so `pagedkv plan` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("serve", "generate", "plan", "bench", "router", "simulate", "profile")


def _load(name: str):
    return importlib.import_module(f"pagedkv.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="Paged-KV-cache LLM engine")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        _load(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
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
