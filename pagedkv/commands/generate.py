"""`pagedkv generate MODEL_DIR --prompt "..."`: one completion from the shell, streamed to stdout.

    pagedkv generate MODEL_DIR --prompt TEXT [--max-tokens 64] [--temperature 0] [--top-p 1]
                     [--top-k 0] [--sampling-seed N] [--n 1] [--stop STR ...] [--ignore-eos]
                     [--chat [--chat-template FILE_OR_TEMPLATE]]
                     [engine flags: --block-size, --dtype, ...]

Greedy by default (temperature 0). `--chat` sends the prompt as one user message through the
model's chat template (or `--chat-template`'s). The model may be given as `--model MODEL_DIR`.
The text goes to stdout (streamed when n == 1 and no --stop); a one-line summary (tokens,
cached prompt tokens, time) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedkv.commands.early_checks import check_before_loading
from pagedkv.commands.engine_flags import (
    HelpFormatter,
    add_engine_flags,
    add_model_argument,
    engine_args_from_flags,
    model_argument,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `generate` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "generate", help="generate a completion for one prompt",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="number of samples")
    parser.add_argument("--stop", action="append", default=None, metavar="STR",
                        help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true",
                        help="apply the chat template to the prompt as a user message")
    parser.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                        help="with --chat: this template, a file or the Jinja template itself "
                        "(default: the model's)")
    parser.add_argument("--sampling-seed", type=int, default=None, metavar="N",
                        help="seed of this request's sampling (--seed is the engine's)")
    add_engine_flags(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from_flags(args, model_argument(args))  # before torch loads
    check_before_loading(engine_args)
    template = None
    if args.chat_template is not None:
        from pagedkv.commands.chat_template import load_chat_template

        template = load_chat_template(args.chat_template)
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.sched.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos, seed=args.sampling_seed)
    engine = LLMEngine.from_engine_args(engine_args)
    if template is not None:
        engine.tokenizer.use_chat_template(template)
    prompt: str | dict = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                    add_generation_prompt=True)
        prompt = {"prompt": text,
                  "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    start = time.perf_counter()
    engine.add_request("generate-0", prompt, params)
    # Stream only when no stop string could cut off text already printed.
    stream = params.n == 1 and not params.stop_strings
    final = _drive(engine, stream=stream)
    elapsed = time.perf_counter() - start
    if final is None:
        raise RuntimeError("the engine stopped before the request finished")
    if final.error:
        raise ValueError(final.error)
    if params.n == 1 and not stream:
        print(final.outputs[0].text)
    elif params.n > 1:
        for comp in final.outputs:
            print(f"--- sample {comp.index} ({comp.finish_reason}) ---\n{comp.text}")
    num_tokens = sum(len(c.token_ids) for c in final.outputs)
    print(f"[{len(final.prompt_token_ids)} prompt tokens ({final.num_cached_tokens} cached), "
          f"{num_tokens} generated in {elapsed:.2f} s, {num_tokens / max(elapsed, 1e-9):.1f} "
          f"tok/s, finish: {','.join(str(c.finish_reason) for c in final.outputs)}]",
          file=sys.stderr)
    return 0


def _drive(engine: Any, *, stream: bool) -> Any:
    """Step `engine` until its only request finishes; print text deltas when `stream`."""
    final, printed = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
            if stream:
                text = output.outputs[0].text if output.outputs else ""
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = max(printed, len(text))
    if stream:
        sys.stdout.write("\n")
    return final
