"""--eviction-policy and --max-pinned-fraction: engine flags of serve and generate (choices
checked by argparse, ranges by EngineArgs, naming the value), and facts of `pagedkv plan`."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import build_parser, main
from pagedkv.commands.engine_flags import engine_args_from_flags
from pagedkv.engine.args import EngineArgs


def parse(*argv: str):
    return build_parser(argv[0]).parse_args(list(argv))


@pytest.mark.parametrize("command", [("serve", "m"), ("generate", "m", "--prompt", "x")])
def test_flags_reach_engine_args(command):
    args = parse(*command, "--eviction-policy", "lfu", "--max-pinned-fraction", "0.2")
    assert engine_args_from_flags(args, "m") == EngineArgs(
        model="m", eviction_policy="lfu", max_pinned_fraction=0.2)
    assert engine_args_from_flags(parse(*command), "m").eviction_policy == "lru"


def test_bad_values_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "m", "--eviction-policy", "mru")
    assert "--eviction-policy" in capsys.readouterr().err
    args = parse("serve", "m", "--max-pinned-fraction", "1.0")
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        engine_args_from_flags(args, "m")
    with pytest.raises(ValueError, match="max_pinned_fraction.*-0.1"):
        EngineArgs(model="m", max_pinned_fraction=-0.1)


def test_plan_reports_policy_and_pinnable_blocks(capsys):
    assert main(["plan", "--config", "llama-3-8b", "--memory", "80GiB", "--json",
                 "--eviction-policy", "arc", "--max-pinned-fraction", "0.25"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eviction_policy"] == "arc"
    assert out["max_pinned_blocks"] == int(0.25 * (out["num_blocks"] - 1))
