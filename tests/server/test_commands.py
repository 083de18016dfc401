"""The CLI glue: engine flags generated from EngineArgs (shared by serve and generate), and
`pagedkv generate` printing what the offline LLM generates."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.cli import build_parser
from pagedkv.commands.engine_flags import add_engine_flags, engine_args_from_flags
from pagedkv.engine.args import EngineArgs


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


def test_every_engine_arg_is_a_flag_of_serve_and_generate():
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    for command in (("serve", "m"), ("generate", "m", "--prompt", "x")):
        args = parse(*command)
        assert names <= set(vars(args)), names - set(vars(args))
        assert engine_args_from_flags(args, "m") == EngineArgs(model="m")  # defaults kept


def test_flags_parse_to_engine_args():
    args = parse("serve", "dir", "--block-size", "8", "--no-enable-prefix-caching",
                 "--swap-space", "0.5", "--preemption-mode", "swap", "--max-num-seqs", "7",
                 "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "99",
                 "--kv-cache-memory-bytes", "1MiB", "--max-model-len", "128", "--seed", "3",
                 "--dtype", "bfloat16", "--port", "0", "--served-model-name", "x")
    engine_args = engine_args_from_flags(args, args.model)
    assert engine_args == EngineArgs(
        model="dir", block_size=8, enable_prefix_caching=False, swap_space=0.5,
        preemption_mode="swap", max_num_seqs=7, max_num_batched_tokens=64,
        num_gpu_blocks_override=99, kv_cache_memory_bytes=2**20, max_model_len=128, seed=3,
        dtype="bfloat16")
    assert (args.port, args.served_model_name) == (0, "x")


def test_bad_flag_values_are_rejected_by_name():
    with pytest.raises(SystemExit):
        parse("serve", "m", "--preemption-mode", "sometimes")
    args = parse("serve", "m", "--block-size", "0")
    with pytest.raises(ValueError, match="block_size"):
        engine_args_from_flags(args, "m")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])


def test_generate_prints_the_offline_greedy_text(tiny_llama, capsys):
    flags = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks-override", "64",
             "--max-model-len", "128"]
    args = parse("generate", str(tiny_llama), "--prompt", "Hello, world", "--max-tokens", "9",
                 "--ignore-eos", *flags)
    assert args.run(args) == 0
    out, err = capsys.readouterr()
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              max_model_len=128)
    expected = llm.generate("Hello, world", SamplingParams(temperature=0.0, max_tokens=9,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert out == expected.outputs[0].text + "\n"
    assert "9 generated" in err
    llm.llm_engine.check_invariants()


def _option_help(help_text: str, flag: str) -> str:
    """The help entry of `flag` in argparse's `help_text`, on one line (its own line and the
    continuation lines up to the next option)."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("-")),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_prints_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        build_parser(command).parse_args([command, "--help"])
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "(default: None)" not in flat
    assert _option_help(out, "--block-size").count("(default: 16)") == 1
    assert _option_help(out, "--swap-space").count("(default: 4.0)") == 1
    for line in out.splitlines():
        assert line.count("(default:") <= 1, line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "lots"])
def test_non_finite_float_flags_name_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse("serve", "m", "--swap-space", value)
    assert "argument --swap-space" in capsys.readouterr().err


def test_generate_takes_model_and_chat_template_flags(tiny_llama, capsys):
    """`--model DIR` for the positional and `--chat --chat-template T`: the text is what
    `LLM.chat(..., chat_template=T)` generates."""
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}=>"
    flags = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks-override", "64",
             "--max-model-len", "128"]
    args = parse("generate", "--model", str(tiny_llama), "--prompt", "Hello", "--chat",
                 "--chat-template", template, "--max-tokens", "5", "--ignore-eos", *flags)
    assert args.run(args) == 0
    out, _ = capsys.readouterr()
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              max_model_len=128)
    expected = llm.chat([{"role": "user", "content": "Hello"}],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False, chat_template=template)[0]
    assert expected.prompt == "<Hello>=>"
    assert out == expected.outputs[0].text + "\n"
    llm.llm_engine.check_invariants()
