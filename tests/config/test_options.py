"""Each engine option is declared once (pagedkv/config/options.py): EngineArgs, its checks, the
commands' flags and the scheduler's config all come from that declaration."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from pagedkv.commands.engine_flags import add_option_flags
from pagedkv.config.options import (
    ENGINE_OPTION_GROUPS,
    CacheOptions,
    CpuKernelMode,
    EvictionPolicyName,
    SchedulerOptions,
    check_options,
    option_spec,
    option_specs,
)
from pagedkv.engine.args import EngineArgs
from pagedkv.kv.eviction import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from pagedkv.sched.scheduler import SchedulerConfig
from pagedkv.structured.limits import StructuredOutputsLimits


def test_every_engine_field_is_declared_in_exactly_one_group():
    declared = [spec.name for group in ENGINE_OPTION_GROUPS for spec in option_specs(group)]
    assert len(declared) == len(set(declared))
    assert set(declared) == {f.name for f in dataclasses.fields(EngineArgs)}
    assert EngineArgs("m", block_size=32) == EngineArgs(model="m", block_size=32)


def test_names_kept_beside_their_registries_match_them():
    assert typing.get_args(EvictionPolicyName) == tuple(EVICTION_POLICIES)
    assert option_spec("eviction_policy").default == DEFAULT_EVICTION_POLICY
    from pagedkv.kernels.modes import CPU_KERNEL_MODES

    assert typing.get_args(CpuKernelMode) == CPU_KERNEL_MODES
    assert EngineArgs().structured_outputs_limits() == StructuredOutputsLimits()


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size must be a positive integer, got 0"),
    ("block_size", True, "block_size must be a positive integer, got True"),
    ("gpu_memory_utilization", 0.0, "gpu_memory_utilization must be a number in (0, 1], got 0.0"),
    ("gpu_memory_utilization", 1.5, "in (0, 1], got 1.5"),
    ("watermark", 1.0, "watermark must be a number in [0, 1), got 1.0"),
    ("swap_space", -1, "swap_space must be a number >= 0, got -1"),
    ("swap_space", float("inf"), "swap_space must be a finite number >= 0, got inf"),
    ("master_port", 70000, "master_port must be an integer in [1, 65535], got 70000"),
    ("node_rank", -1, "node_rank must be an integer >= 0, got -1"),
    ("preemption_mode", "sometimes", "preemption_mode must be one of ('recompute', 'swap'), "
                                     "got 'sometimes'"),
    ("dtype", "float8", "dtype must be one of"),
    ("enforce_eager", 1, "enforce_eager must be a bool, got 1"),
    ("kv_offloading_remote_url", "", "kv_offloading_remote_url must be a non-empty string"),
    ("structured_outputs_compile_timeout_s", 0,
     "structured_outputs_compile_timeout_s must be a number > 0, got 0"),
])
def test_a_bad_value_is_refused_naming_the_field_the_value_and_the_limit(field, value, message):
    with pytest.raises(ValueError) as info:
        EngineArgs(model="m", **{field: value})
    assert message in str(info.value)


def test_none_is_a_value_only_where_the_default_is_none():
    EngineArgs(model="m", max_model_len=None, master_port=None)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got None"):
        EngineArgs(model="m", block_size=None)


def test_check_options_checks_any_object_with_the_declared_names():
    @dataclasses.dataclass
    class Sim:
        block_size: int = 16
        preemption_mode: str = "recompute"
        unrelated: int = -5

    check_options(Sim(), CacheOptions, SchedulerOptions)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        check_options(Sim(preemption_mode="bar"), CacheOptions, SchedulerOptions)


def test_flags_take_the_declared_defaults_or_the_commands_own():
    parser = argparse.ArgumentParser()
    group = add_option_flags(parser, CacheOptions, SchedulerOptions,
                             only=("block_size", "preemption_mode", "enable_prefix_caching"),
                             defaults={"block_size": 32}, helps={"block_size": "tokens a block"},
                             title="engine")
    assert group.title == "engine"
    args = parser.parse_args([])
    assert (args.block_size, args.preemption_mode, args.enable_prefix_caching) == (
        32, "recompute", True)
    args = parser.parse_args(["--block-size", "8", "--no-enable-prefix-caching"])
    assert (args.block_size, args.enable_prefix_caching) == (8, False)
    assert not hasattr(args, "max_num_seqs")  # not in `only`
    block = next(a for a in parser._actions if a.dest == "block_size")
    assert block.help == "tokens a block (default: 32)"
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "sometimes"])


def test_flags_of_an_undeclared_option_are_refused():
    with pytest.raises(ValueError, match="no_such_knob"):
        add_option_flags(argparse.ArgumentParser(), CacheOptions, only=("no_such_knob",))
    with pytest.raises(ValueError, match="max_num_seqs"):  # a default for a flag not added
        add_option_flags(argparse.ArgumentParser(), CacheOptions, only=("block_size",),
                         defaults={"max_num_seqs": 2})


def test_scheduler_config_is_the_scheduler_options_with_budgets_resolved():
    args = EngineArgs(model="m", max_num_seqs=7, preemption_mode="swap",
                      scheduling_policy="priority")
    config = SchedulerConfig.from_options(args, max_num_batched_tokens=64, max_model_len=512)
    resolved = ("max_num_batched_tokens", "prefill_batching")
    for spec in option_specs(SchedulerOptions):
        if spec.name not in resolved:
            assert getattr(config, spec.name) == getattr(args, spec.name), spec.name
    assert (config.max_num_batched_tokens, config.max_model_len) == (64, 512)
    assert (args.prefill_batching, config.prefill_batching) == ("auto", "spread")  # on CPU
    assert config.policy == "priority"  # vLLM's name
    assert isinstance(config, SchedulerOptions)
