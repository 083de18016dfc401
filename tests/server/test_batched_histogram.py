"""The inter-token latency histogram counts its observations in batches (`BatchedHistogram`):
/metrics shows the same bucket counts as observing every value one by one, the same sum up to
float rounding, whether it is read after a few observations or after many flushes."""

from __future__ import annotations

import random

import pytest

from pagedkv.server import batched_histogram
from pagedkv.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.render().decode().splitlines()
            if "inter_token_latency" in line and not line.startswith("#")
            and "_created" not in line}


@pytest.mark.parametrize("count", [3, 2_500])
def test_batched_itl_equals_one_by_one(monkeypatch, count: int):
    monkeypatch.setattr(batched_histogram, "FLUSH_EVERY", 1000)  # several flushes at 2,500
    batched, reference = ServerMetrics("m"), ServerMetrics("m")
    rng = random.Random(count)
    for _ in range(count):
        gap, num_tokens = rng.choice([0.0, 0.001, 0.3, 7.0, rng.random()]), rng.choice([1, 2, 5])
        batched.observe_inter_token(gap, num_tokens)
        for child in reference.itl.children:
            for _ in range(num_tokens):
                child.observe(gap / num_tokens)
    got, want = _samples(batched), _samples(reference)
    assert got.keys() == want.keys() and len(got) > 10
    for name, value in want.items():
        if name.split("{")[0].endswith("_sum"):
            assert got[name] == pytest.approx(value, rel=1e-9)
        else:
            assert got[name] == value, name
    assert any(v > 0 for k, v in got.items() if k.split("{")[0].endswith("_count"))
