import subprocess
import sys

import pagedkv
from pagedkv.sched import SamplingParams


def test_cli_without_command_prints_usage_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "plan" in proc.stdout


def test_sampling_params_rejects_bad_values_by_name():
    import pytest

    for kwargs, name in [({"n": 0}, "n"), ({"temperature": -1}, "temperature"),
                         ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                         ({"stop": [1]}, "stop"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert pagedkv.SamplingParams is SamplingParams
