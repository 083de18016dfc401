"""bench_offline.py's KV cache format flags take their choices from the one format table
(pagedkv/config/dtypes.py) and refuse unknown names before any engine starts."""

import sys
from pathlib import Path

import pytest

from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_offline  # noqa: E402


@pytest.mark.parametrize("argv, bad", [
    (["--kv-cache-dtype", "int9"], "int9"),
    (["--compare-kv-cache-dtypes", "auto,int9"], "int9"),
    (["--compare-kv-cache-dtypes", "auto,int8", "--compare-workloads", "mixed,shared"],
     "shared"),
])
def test_unknown_formats_and_workloads_are_refused(argv, bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_offline.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert bad in err
    if "workloads" not in argv[-2]:
        assert all(name in err for name in KV_CACHE_DTYPE_CHOICES)  # int8 among them
