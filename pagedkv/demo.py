"""`make demo` (temporary): the KV cache plan of the bundled Llama-3-8B config on an 80 GiB budget.

The engine demo (real generation with a tiny model) replaces this once the engine exists.
`--model DIR` plans for that model directory's config.json instead.
"""

from __future__ import annotations

import argparse
import sys

from pagedkv.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.demo", description=__doc__)
    parser.add_argument("--model", default=None, help="a model directory or config.json")
    parser.add_argument("--memory", default="80GiB", help="memory budget (default 80GiB)")
    args = parser.parse_args(argv)
    config = args.model or "llama-3-8b"  # a bundled example config (pagedkv/data/configs)
    command = ["plan", "--config", config, "--memory", args.memory]
    print("$ pagedkv " + " ".join(command), flush=True)
    rc = cli_main(command)
    print("\nThe engine demo (generation through the paged KV cache) is coming; "
          "for now this shows `pagedkv plan`.")
    return rc


if __name__ == "__main__":
    sys.exit(main())
