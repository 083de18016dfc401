"""speculative_config: parsed from JSON or a dict, each bad value a ValueError naming it."""

from __future__ import annotations

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.spec import SpeculativeConfig, parse_speculative_config


def test_json_and_dict_give_the_same_config():
    text = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
            '"prompt_lookup_max": 4}')
    expected = SpeculativeConfig("ngram", 3, 2, 4)
    assert parse_speculative_config(text) == expected
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4}) == expected
    assert parse_speculative_config(None) is None


def test_lookup_lengths_default_to_one_and_max_follows_min():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}) == \
        SpeculativeConfig("ngram", 2, 1, 1)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 3}).prompt_lookup_max == 3


@pytest.mark.parametrize(("value", "named"), [
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle9", "num_speculative_tokens": 3}, "'eagle9'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a "
     "positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "got True"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "<= 32, got 99"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": -1}, "got -1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 2}, "prompt_lookup_min (5) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys ['model']"),
])
def test_bad_values_are_named(value, named):
    with pytest.raises(ValueError, match="speculative_config") as info:
        parse_speculative_config(value)
    assert named in str(info.value)


def test_engine_args_check_it_and_refuse_async_scheduling():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs("m", speculative_config='{"method": "ngram", "num_speculative_tokens": -2}')
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs("m", async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    args = EngineArgs("m", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
