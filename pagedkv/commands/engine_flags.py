"""Engine options as command-line flags, with vLLM's names, generated from their declaration.

`add_option_flags(parser, *groups, only=..., defaults=...)` turns the options declared in
pagedkv/config/options.py into flags: `--block-size`, `--dtype`, `--max-model-len`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ... with their help, choices, type and
default; every command that takes engine options (serve, generate, profile: all of them;
simulate and plan: those they model) calls it, and a command whose default differs says so in
`defaults`. `add_engine_flags(parser)` adds every `EngineArgs` field but `model` (the commands
take it as MODEL_DIR or --model: `add_model_argument` and `model_argument`), and
`engine_args_from_flags(args, model)` turns the parsed namespace back into `EngineArgs`, which
checks the values (a ValueError naming the field).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pagedkv.config.options import ENGINE_OPTION_GROUPS, OptionSpec, option_specs
from pagedkv.engine.args import EngineArgs

ENGINE_GROUP_TITLE = "engine"
ENGINE_GROUP_DESCRIPTION = "EngineArgs, with vLLM's flag names"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, but '(default: X)' appears once: not again when the help
    text states it (as every option flag's does), and not for None (meaning 'not given')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _finite_float(text: str) -> float:
    """A float flag value; nan and infinities are refused (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a flag value)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional_int(text: str) -> int | None:
    """Parse an int flag value; 'none' means None (for fields whose default is None)."""
    return None if text.lower() == "none" else int(text)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model directory: positional (`pagedkv serve MODEL_DIR`) or `--model MODEL_DIR`,
    both accepted as vLLM's `vllm serve` does; `model_argument(args)` reads it."""
    parser.add_argument("model", metavar="MODEL_DIR", nargs="?", default=None,
                        help="model directory, .gguf file or Hugging Face id (org/name); "
                        "or --model MODEL_DIR")
    parser.add_argument("--model", dest="model_option", metavar="MODEL_DIR", default=None,
                        help="the model directory, as the positional MODEL_DIR")


def model_argument(args: argparse.Namespace) -> str:
    """The model directory given positionally or as --model (ValueError when neither is given,
    or both and they differ)."""
    positional, option = args.model, getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"the model is given twice: {positional!r} and --model {option!r}")
    model = positional if positional is not None else option
    if not model:
        command = getattr(args, "command", None) or "serve"
        raise ValueError(f"no model given: pagedkv {command} MODEL_DIR (or --model MODEL_DIR)")
    return model


def _flag_type(spec: OptionSpec) -> Callable[[str], Any] | None:
    if spec.parse is not None:
        return spec.parse
    if spec.kind == "int":
        return _optional_int if spec.nullable else int
    return _finite_float if spec.kind == "float" else str


def _add_flag(group: Any, spec: OptionSpec, default: Any, help_text: str) -> None:
    if default is not None:
        help_text = f"{help_text} (default: {default})"
    kwargs: dict[str, Any] = {"dest": spec.name, "default": default,
                              "help": help_text.replace("%", "%%")}
    if spec.kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _flag_type(spec)
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        else:
            kwargs["metavar"] = spec.name.upper()
    group.add_argument(_flag(spec.name), **kwargs)


def add_option_flags(parser: argparse.ArgumentParser, *groups: type,
                     only: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None,
                     helps: Mapping[str, str] | None = None, title: str | None = None,
                     description: str | None = None) -> Any:
    """Add a flag for each option of `groups` (pagedkv.config.options), in declaration order.

    `only`: just these options, in this order (default: every option with a flag); `defaults`:
    this command's own defaults (default: the declared ones); `helps`: this command's own help
    text of an option; `title`: put the flags in an argument group of that title. Returns the
    group the flags went to (the parser without `title`), for the command's own flags beside.
    """
    specs = {spec.name: spec for group in groups for spec in option_specs(group)}
    names = list(only) if only is not None else [n for n, s in specs.items() if s.flag]
    unknown = sorted(set(names) - set(specs) | set(defaults or ()) - set(names)
                     | set(helps or ()) - set(names))
    if unknown:
        raise ValueError(f"no such option among {[g.__name__ for g in groups]}: {unknown}")
    target = parser.add_argument_group(title, description) if title else parser
    for name in names:
        spec = specs[name]
        _add_flag(target, spec, (defaults or {}).get(name, spec.default),
                  (helps or {}).get(name, spec.help))
    return target


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `EngineArgs` field (but `model`) to `parser`, in an 'engine' group."""
    add_option_flags(parser, *ENGINE_OPTION_GROUPS, title=ENGINE_GROUP_TITLE,
                     description=ENGINE_GROUP_DESCRIPTION)
    return parser


def engine_args_from_flags(args: argparse.Namespace, model: str) -> EngineArgs:
    """`EngineArgs` for `model` from the parsed engine flags (those `args` lacks default).

    Raises ValueError (naming the field) when a value is out of range.
    """
    given = {spec.name: getattr(args, spec.name) for group in ENGINE_OPTION_GROUPS
             for spec in option_specs(group) if spec.flag and hasattr(args, spec.name)}
    return EngineArgs(model=model, **given)
