"""The simulator's prefill/decode split (pagedkv/sim/disagg.py): token timing against the
mixed case, the transfer's time from bytes over the link, placement, and conservation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pagedkv.sim.config import SimConfig
from pagedkv.sim.disagg import Split, simulate_split, transfer_bytes
from pagedkv.sim.latency import FunctionLatency
from pagedkv.sim.simulator import simulate
from pagedkv.sim.traces import TraceRequest
from tests.sim.workloads import shared_prefix_trace, simulate_cli_without_torch

STEP = 0.010  # every step takes 10 ms, whatever it runs
BLOCK_BYTES = 1 << 20
CONFIG = SimConfig(num_blocks=200, block_size=8, max_model_len=512, vocab_size=640,
                   block_bytes=BLOCK_BYTES)
LATENCY = FunctionLatency(lambda shape: STEP)


def check_books(result) -> None:
    for inst in result.instances:
        inst.scheduler.check_invariants()
        assert inst.kv.num_free_blocks == inst.kv.num_usable_blocks  # every block came back


def spaced(lengths, output=6, gap=1.0) -> list[TraceRequest]:
    return [TraceRequest(arrival=i * gap, input_length=n, output_length=output)
            for i, n in enumerate(lengths)]


def test_an_instant_link_without_contention_times_tokens_as_mixed_plus_one_step():
    """Each request alone: mixed makes its first token in its prefill step; split makes it in
    the decode instance's first step, one step after the prefill ends (the last prompt token
    and the first sample), then the same step per token."""
    trace = spaced([20, 45, 9, 70])
    mixed = simulate(trace, CONFIG, LATENCY).records
    result = simulate_split(trace, CONFIG, LATENCY, Split(1, 1, math.inf))
    check_books(result)
    for m, s in zip(mixed, result.records, strict=True):
        assert s.status == m.status == "length" and s.num_tokens == m.num_tokens == 6
        assert m.ttft == pytest.approx(STEP) and s.ttft == pytest.approx(2 * STEP)
        assert s.tpot == pytest.approx(m.tpot) and s.tpot == pytest.approx(STEP)
        assert s.e2e == pytest.approx(m.e2e + STEP)
        assert s.instance == 1  # the decode instance (after the one prefill instance)
    assert result.extra["split"]["transfer_seconds_max"] == 0.0


@pytest.mark.parametrize("gbps", [1.0, 4.0])
def test_the_transfer_takes_the_prompt_kv_bytes_over_the_link(gbps):
    lengths = [8, 16, 40, 41]  # 1, 2, 5 and 6 blocks
    result = simulate_split(spaced(lengths), CONFIG, LATENCY, Split(1, 1, gbps))
    check_books(result)
    for n, r in zip(lengths, result.records, strict=True):
        blocks = -(-n // CONFIG.block_size)
        assert transfer_bytes(n, CONFIG.block_size, BLOCK_BYTES) == blocks * BLOCK_BYTES
        link = blocks * BLOCK_BYTES * 8 / (gbps * 1e9)
        assert r.ttft == pytest.approx(2 * STEP + link)
    split = result.extra["split"]
    assert split["transfers"] == 4 and split["transfer_bytes"] == 14 * BLOCK_BYTES


def test_one_instances_transfers_queue_on_its_link():
    """Two prompts prefilled in the same step on one prefill instance: the second's KV waits
    for the first's on the link; with two prefill instances each has its own link."""
    trace = [TraceRequest(arrival=0.0, input_length=40, output_length=4) for _ in range(2)]
    one_link = 5 * BLOCK_BYTES * 8 / 1e9
    queued = simulate_split(trace, CONFIG, LATENCY, Split(1, 2, 1.0))
    assert queued.extra["split"]["transfer_seconds_max"] == pytest.approx(2 * one_link)
    assert sorted(r.ttft for r in queued.records) == pytest.approx(
        [2 * STEP + one_link, 2 * STEP + 2 * one_link])
    apart = simulate_split(trace, CONFIG, LATENCY, Split(2, 2, 1.0))
    assert apart.extra["split"]["transfer_seconds_max"] == pytest.approx(one_link)
    assert {r.instance for r in apart.records} == {2, 3}  # decodes spread by load
    check_books(queued)
    check_books(apart)


def test_the_answer_leaves_a_busy_producer_at_the_step_ends_its_server_waits_for():
    """Three prompts, one prefill step each on a busy producer: the server starts a handoff
    and polls it by utility calls, which the engine loop runs only between steps. The first
    prompt's handoff starts at the end of the second step (the loop went straight on) and
    its poll is answered at the end of the third; the second's starts at the end of the third
    and finds the engine idle; the third's runs at once. All three answers leave together,
    so the idle decode instance admits them together, waits for their loads (no step time)
    and computes their last prompt tokens in one step."""
    config = dataclasses.replace(CONFIG, max_num_batched_tokens=40)
    trace = [TraceRequest(arrival=0.0, input_length=40, output_length=4) for _ in range(3)]
    result = simulate_split(trace, config, LATENCY, Split(1, 1, math.inf))
    check_books(result)
    split = result.extra["split"]
    assert split["handoff_seconds_max"] == pytest.approx(2 * STEP)  # prefilled at 1, sent at 3
    assert split["handoff_seconds_mean"] == pytest.approx((2 + 1 + 0) * STEP / 3)
    assert [r.first_token for r in result.records] == pytest.approx([4 * STEP] * 3)
    assert all(r.status == "length" and r.num_tokens == 4 for r in result.records)


def test_the_producer_pays_for_staging_each_block_and_the_decode_side_has_its_own_cost():
    """A producer copies every block it computes out to its staging tier (the step's
    `saved_blocks`); the decode instances step at `decode_latency`'s cost."""
    prefill = FunctionLatency(lambda s: STEP + 1e-3 * s.saved_blocks)
    decode = FunctionLatency(lambda s: 3 * STEP)
    result = simulate_split(spaced([40]), CONFIG, prefill, Split(1, 1, math.inf),
                            decode_latency=decode)
    check_books(result)
    (record,) = result.records
    assert record.ttft == pytest.approx(STEP + 5e-3 + 3 * STEP)  # 5 blocks staged, 1 decode step
    assert record.tpot == pytest.approx(3 * STEP)
    staging = result.instances[0].store.tiers[0]
    assert staging.spec.name == "staging" and staging.blocks_written == 5


def test_every_request_finishes_once_under_load():
    trace = shared_prefix_trace(num=40, gap=0.002)
    too_long = TraceRequest(arrival=trace[-1].arrival, input_length=600, output_length=3)
    trace = [*trace, too_long]
    result = simulate_split(trace, CONFIG, FunctionLatency(lambda s: 1e-3 + 1e-5 * s.num_tokens),
                            Split(2, 3, 25.0))
    check_books(result)
    records = result.records
    assert [r.index for r in records] == list(range(len(trace)))
    assert records[-1].status == "rejected" and records[-1].first_token is None
    done = records[:-1]
    assert all(r.status == "length" for r in done)
    assert [r.num_tokens for r in done] == [t.output_length for t in trace[:-1]]
    prefill, decode = result.instances[:2], result.instances[2:]
    assert sum(len(i.finished) for i in prefill) == len(trace)  # each prefilled (or refused) once
    finished = [r.index for i in decode for r in i.finished]
    assert sorted(finished) == list(range(len(trace) - 1))  # each decoded once
    assert result.extra["split"]["transfers"] == len(trace) - 1
    assert all(r.first_scheduled <= r.first_token <= r.finish for r in done)


def test_bad_splits_are_value_errors():
    with pytest.raises(ValueError, match="decode_instances"):
        Split(1, 0, 1.0)
    with pytest.raises(ValueError, match="link_gbps"):
        Split(1, 1, 0.0)
    with pytest.raises(ValueError, match="block_bytes"):
        simulate_split(spaced([9]), SimConfig(num_blocks=50, block_size=8), LATENCY,
                       Split(1, 1, 1.0))


def test_the_cli_compares_the_split_with_mixed_instances():
    out = simulate_cli_without_torch("--prefill-instances", "1", "--decode-instances", "1",
                                     "--kv-link-gbps", "100", "--compare-mixed")
    assert out.returncode == 0, out.stderr
    assert "split: 1 prefill + 1 decode instances" in out.stdout
    assert "mixed: 2 instances" in out.stdout
    bad = simulate_cli_without_torch("--prefill-instances", "1")
    assert bad.returncode == 2 and "--decode-instances" in bad.stderr
    assert "Traceback" not in bad.stderr
    swept = simulate_cli_without_torch("--sweep", "split=1:1,2", "--slo", "ttft=1")
    assert swept.returncode == 0, swept.stderr
    assert "1P+1D" in swept.stdout and "2 mixed" in swept.stdout
    searched = simulate_cli_without_torch("--search", "split", "--slo", "ttft=1,tpot=0.05",
                                          "--target", "0.5", "--split-max-instances", "3")
    assert searched.returncode == 0, searched.stderr
    assert "smallest split meeting" in searched.stdout
    assert "fewest mixed instances meeting" in searched.stdout


def test_the_cli_gives_the_decode_instances_their_own_latency_model(tmp_path):
    """Decode instances whose every step takes 50 ms (a fitted model's JSON): the split's
    TPOT is theirs, not `--latency`'s."""
    from pagedkv.sim.latency import FittedLatency

    FittedLatency({"intercept": 0.05}).save(tmp_path / "decode.json")
    out = tmp_path / "out.json"
    ran = simulate_cli_without_torch("--prefill-instances", "1", "--decode-instances", "1",
                                     "--decode-latency", str(tmp_path / "decode.json"),
                                     "--json", str(out))
    assert ran.returncode == 0, ran.stderr
    tpot = json.loads(out.read_text())["split"]["latency"]["tpot"]
    assert tpot["p50"] == pytest.approx(0.05) and tpot["p99"] == pytest.approx(0.05)
    bad = simulate_cli_without_torch("--decode-latency", str(tmp_path / "decode.json"))
    assert bad.returncode == 2 and "--decode-latency needs" in bad.stderr


def test_split_search_answers_the_smallest_fleet_meeting_the_slo():
    from pagedkv.sim.disagg import split_search
    from pagedkv.sim.results import SLO

    config = SimConfig(num_blocks=400, block_size=8, max_model_len=512, vocab_size=640,
                       block_bytes=BLOCK_BYTES, max_num_batched_tokens=256)
    trace = [TraceRequest(arrival=0.0, input_length=200, output_length=4) for _ in range(8)]
    slo = SLO.parse(f"ttft={4.5 * STEP}")
    found = split_search(trace, config, LATENCY, slo, link_gbps=math.inf, target=0.99,
                         max_instances=8)
    p, d = found["value"]
    assert found["summary"]["goodput"]["fraction"] >= 0.99
    smaller = [s for key, s in found["tried"].items() if sum(map(int, key.split(":"))) < p + d]
    assert smaller and all(s["goodput"]["fraction"] < 0.99 for s in smaller)
    assert p >= 2  # one prefill instance queues eight 200-token prompts past the bound
    never = split_search(trace, config, LATENCY, SLO.parse(f"ttft={STEP}"),
                         link_gbps=math.inf, max_instances=3)
    assert never["value"] is None and sorted(never["tried"]) == ["1:1", "1:2", "2:1"]
