"""`pagedkv profile MODEL_DIR`: time a grid of step shapes through the real model runner and
save a fitted latency model for `pagedkv simulate --latency PATH`.

    pagedkv profile MODEL_DIR [--out latency.json] [--grid quick|full] [--repeats 3]
                    [engine flags: --block-size, --dtype, --cpu-threads, ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.commands.engine_flags import HelpFormatter, add_engine_flags, engine_args_from_flags


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `profile` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "profile", help="fit a step-latency model for `pagedkv simulate`",
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("model", metavar="MODEL_DIR", help="Hugging Face model directory")
    parser.add_argument("--out", default="latency.json", help="where to save the fitted model")
    parser.add_argument("--grid", choices=("quick", "full"), default="quick",
                        help="step shapes to time (quick: 48 points, full: 150)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape")
    add_engine_flags(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedkv.sim.profiling import FULL_GRID, QUICK_GRID, profile_model

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    engine_args = engine_args_from_flags(args, args.model)
    fitted = profile_model(engine_args, FULL_GRID if args.grid == "full" else QUICK_GRID,
                           repeats=args.repeats, log=lambda m: print(m, file=sys.stderr))
    fitted.save(args.out)
    meta = fitted.meta
    print(f"saved {args.out}: {meta['samples']} shapes, mean error {meta['mean_rel_error']:.1%}"
          f", max {meta['max_rel_error']:.1%}")
    for name, value in fitted.coefficients.items():
        print(f"  {name:<18} {value:.3e}")
    return 0
