"""`pagedkv profile MODEL_DIR`: time a grid of step shapes through the real model runner and
save a fitted latency model for `pagedkv simulate --latency PATH`. With `--fit-from STEP_LOG`
it fits the same model to the steps a real engine logged instead (`pagedkv serve --step-log
PATH`: every real step, with the scheduling and output work around the model), no engine built.

    pagedkv profile MODEL_DIR [--out latency.json] [--grid quick|full] [--repeats 3]
                    [--clock wall|cpu] [engine flags: --block-size, --dtype, --cpu-threads, ...]
    pagedkv profile --fit-from STEP_LOG [--calibrate PROFILE.json] [--request-log LOG]
                    [--clock wall|cpu] [--out latency.json]

With `--calibrate`, the step log calibrates a profiled model (its machine share and the serving
loop's work per step and per request: `pagedkv.sim.latency.calibrate`) instead of fitting a new
one, so a short run need not cover every step shape. With `--request-log` (the same run's `serve --request-log`), the serving frontend's delays
before a request reaches the engine and after its tokens leave it are fitted too
(`pagedkv.sim.frontend`), and `pagedkv simulate` applies them.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from pagedkv.commands.early_checks import check_before_loading
from pagedkv.commands.engine_flags import HelpFormatter, add_engine_flags, engine_args_from_flags

if TYPE_CHECKING:
    from pagedkv.sim.latency import FittedLatency


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `profile` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "profile", help="fit a step-latency model for `pagedkv simulate`",
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("model", metavar="MODEL_DIR", nargs="?", default=None,
                        help="Hugging Face model directory (not with --fit-from)")
    parser.add_argument("--fit-from", default=None, metavar="STEP_LOG",
                        help="fit to the steps of a real run's step log (serve --step-log) "
                             "instead of timing a grid")
    parser.add_argument("--calibrate", default=None, metavar="PROFILE",
                        help="with --fit-from: calibrate this profiled model (a JSON file "
                             "from `pagedkv profile`) to the step log instead of fitting anew")
    parser.add_argument("--request-log", default=None, metavar="LOG",
                        help="with --fit-from: the same run's request log (serve "
                             "--request-log), to fit the frontend's delays too")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="fit wall time, or the engine thread's CPU time (the work "
                             "without a shared machine's time slicing; with --cpu-threads 1)")
    parser.add_argument("--out", default="latency.json", help="where to save the fitted model")
    parser.add_argument("--grid", choices=("quick", "full"), default="quick",
                        help="step shapes to time (quick: 129 points, full: 524)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape")
    add_engine_flags(parser)
    parser.set_defaults(run=run)
    return parser


def _fit(args: argparse.Namespace) -> FittedLatency:
    from pagedkv.engine.step_log import read_step_log
    from pagedkv.jsonl import read_jsonl
    from pagedkv.sim.frontend import FrontendDelays
    from pagedkv.sim.latency import FittedLatency
    from pagedkv.sim.latency.calibrate import calibrate
    from pagedkv.sim.profiling import FULL_GRID, QUICK_GRID, profile_model

    if args.fit_from is not None:
        if args.model is not None:
            raise ValueError(f"give MODEL_DIR ({args.model!r}) or --fit-from, not both")
        shapes, times = read_step_log(args.fit_from, args.clock)
        if args.calibrate is not None:
            fitted = calibrate(FittedLatency.load(args.calibrate), shapes, times)
        else:
            fitted = FittedLatency.fit(shapes, times, {"step_log": str(args.fit_from),
                                                       "clock": args.clock})
        if args.request_log is None:
            return fitted
        return fitted.with_frontend(FrontendDelays.fit(read_jsonl(args.request_log)))
    for flag in ("request_log", "calibrate"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} goes with --fit-from STEP_LOG")
    if args.model is None:
        raise ValueError("give MODEL_DIR to profile, or --fit-from STEP_LOG")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    engine_args = engine_args_from_flags(args, args.model)
    check_before_loading(engine_args)
    return profile_model(engine_args, FULL_GRID if args.grid == "full" else QUICK_GRID,
                         repeats=args.repeats, log=lambda m: print(m, file=sys.stderr),
                         clock=args.clock)


def run(args: argparse.Namespace) -> int:
    fitted = _fit(args)
    fitted.save(args.out)
    meta = fitted.meta
    if "calibration" in meta:
        cal = meta["calibration"]
        print(f"saved {args.out}: calibrated to {cal['steps']} logged steps: "
              f"{cal['share']:.3f}x the profile "
              f"+ {cal['per_step'] * 1e3:.3f} ms a step + {cal['per_request'] * 1e3:.4f} ms a "
              f"request (mean error {cal['mean_rel_error']:.1%}, total "
              f"{cal['total_ratio']:.3f}x)")
    else:
        print(f"saved {args.out}: {meta['samples']} steps, mean error "
              f"{meta['mean_rel_error']:.1%}, max {meta['max_rel_error']:.1%}")
    for name, value in fitted.coefficients.items():
        print(f"  {name:<18} {value:.3e}")
    if not fitted.frontend.is_zero:
        delays = fitted.frontend
        print(f"  frontend delays: admit {delays.admit * 1e3:.2f} ms, output "
              f"{delays.output * 1e3:.2f} ms, finish {delays.finish * 1e3:.2f} ms, wake "
              f"{delays.wake * 1e3:.2f} ms")
    return 0
