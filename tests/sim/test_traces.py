"""Trace readers: Mooncake block ids become token runs whose chained hashes share exactly the
trace's shared prefixes; Azure CSVs; scaling; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.sim.traces import TraceRequest, load_trace, prompt_token_ids, scale_trace

DATA = Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_conversation_head40.jsonl"
AZURE = DATA / "azure_llm_2023_conv_head30.csv"


class _P:
    cache_salt = None
    lora_name = None

    def __init__(self, ids):
        self.all_token_ids = ids


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("block_size", [16, 512])
def test_mooncake_sharing_is_reproduced_by_chained_hashes(block_size):
    trace = load_trace(MOONCAKE)
    assert len(trace) == 40 and trace[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(trace, trace[1:], strict=False))
    ids = [prompt_token_ids(t, 32000, i) for i, t in enumerate(trace)]
    assert [len(x) for x in ids] == [t.input_length for t in trace]
    assert all(0 <= tok < 32000 for x in ids for tok in x)
    hasher = RequestBlockHasher("sha256", block_size)
    hashes = [hasher(_P(x), []) for x in ids]
    for i in range(len(trace)):
        for j in range(i + 1, len(trace)):
            a, b = trace[i], trace[j]
            shared_ids = _common_prefix(a.block_ids, b.block_ids)
            shared_tokens = _common_prefix(ids[i], ids[j])
            # Equal leading ids give equal tokens; the first different id differs at once.
            assert min(512 * shared_ids, a.input_length, b.input_length) <= shared_tokens
            assert shared_tokens < 512 * shared_ids + 1 or shared_tokens == min(
                a.input_length, b.input_length)
            assert _common_prefix(hashes[i], hashes[j]) == shared_tokens // block_size, (i, j)
    assert any(_common_prefix(hashes[0], h) for h in hashes[1:])  # the slice does share


def test_last_block_holds_the_remainder_and_unshared_tails_differ():
    a = TraceRequest(0.0, 1000, 5, block_ids=(7, 8))
    b = TraceRequest(0.0, 1000, 5, block_ids=(7, 9))
    c = TraceRequest(0.0, 700, 5, block_ids=())
    ta, tb = prompt_token_ids(a, 1000, 0), prompt_token_ids(b, 1000, 1)
    assert len(ta) == 1000 and ta[:512] == tb[:512] and ta[512:] != tb[512:]
    tc0, tc1 = prompt_token_ids(c, 1000, 0), prompt_token_ids(c, 1000, 1)
    assert len(tc0) == 700 and tc0[:4] != tc1[:4]
    assert prompt_token_ids(a, 1000, 0) == ta  # deterministic


def test_scaling_keeps_sharing_and_scales_time():
    trace = load_trace(MOONCAKE, scale_lengths=1 / 16, time_scale=0.5)
    raw = load_trace(MOONCAKE)
    for s, r in zip(trace, raw, strict=True):
        assert s.block_tokens == 32 and s.block_ids == r.block_ids
        assert s.input_length == max(1, round(r.input_length / 16))
        assert s.arrival == pytest.approx(r.arrival * 0.5)
    with pytest.raises(ValueError, match="scale_lengths"):
        scale_trace(raw, scale_lengths=0)


def test_azure_csv():
    trace = load_trace(AZURE)
    assert len(trace) == 30 and trace[0].arrival == 0.0
    assert (trace[0].input_length, trace[0].output_length) == (374, 44)
    assert trace[1].arrival == pytest.approx(4.314579, abs=1e-6)
    assert all(t.block_ids == () for t in trace)


def test_limit_and_start():
    trace = load_trace(MOONCAKE, limit=5, start=10)
    raw = load_trace(MOONCAKE)
    assert [t.input_length for t in trace] == [t.input_length for t in raw[10:15]]
    assert trace[0].arrival == 0.0


@pytest.mark.parametrize(("limit", "start", "named"), [(0, 0, "limit"), (-5, 0, "limit"),
                                                     (3, -1, "start"), (True, 0, "limit")])
def test_bad_limit_or_start_is_refused(limit, start, named):
    # a negative limit once read the whole trace (a slice [0:-5]); a negative start said
    # "no requests"
    with pytest.raises(ValueError, match=f"{named} must be .*got {start if named == 'start' else limit!r}"):
        load_trace(MOONCAKE, limit=limit, start=start)


def test_bad_request_log_rows_are_named(tmp_path):
    import json

    good = {"arrival": 100.0, "prompt_tokens": 40, "output_tokens": 3, "block_size": 16,
            "prefix_block_hashes": ["ab01", "cd02"]}
    for change, says in (({"output_tokens": -3}, "output length must be >= 0, got -3"),
                         ({"arrival": float("nan")}, "arrival must be a finite"),
                         ({"block_size": 0}, "block_tokens must be an integer >= 1"),
                         ({"prompt_tokens": -1}, "input_length must be an integer >= 0"),
                         ({"prefix_block_hashes": "abc"}, "must be a list of hex strings"),
                         ({"prefix_block_hashes": ["zz"]}, "'zz' is not hex")):
        log = tmp_path / "log.jsonl"
        log.write_text(json.dumps(good) + "\n" + json.dumps(good | change) + "\n")
        with pytest.raises(ValueError, match=f"log.jsonl:2: .*{says}"):
            load_trace(log, "request-log")
    aborted = tmp_path / "aborted.jsonl"  # no output: one token, as max_tokens is at least 1
    aborted.write_text(json.dumps(good | {"output_tokens": 0}) + "\n")
    assert load_trace(aborted)[0].output_length == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": -1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*output length must be >= 0"):
        load_trace(bad)


def test_bad_traces(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(bad)
    odd = tmp_path / "odd.txt"
    odd.write_text("hello\n")
    with pytest.raises(ValueError, match="trace format"):
        load_trace(odd)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(bad, "parquet")
