"""eos stopping in the scheduler: a request stops at its first eos token (finish "stop",
no stop_reason), unless `ignore_eos`; below `min_tokens` eos is banned from sampling (the
scheduler hands the runner eos in `banned_token_ids`) and never stops the request."""

from __future__ import annotations

from pagedkv.kv.manager import KVCacheManager
from pagedkv.sched import Request, RequestStatus, SamplingParams
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.fake_runner import FakeRunner, reference_continuation

VOCAB = 1000
PROMPT = [11, 22, 33, 44, 55, 66, 77]


def _eos_at(index: int) -> tuple[int, list[int]]:
    ref = reference_continuation(PROMPT, 40, VOCAB)
    assert ref[index] not in ref[:index]
    return ref[index], ref


def _run(params: SamplingParams, eos: int) -> tuple[Request, list[tuple[int, tuple[int, ...]]]]:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=512), kv)
    runner = FakeRunner(64, 0, 4, VOCAB)
    request = Request("r", PROMPT, params, eos_token_ids=(eos,))
    sched.add_request(request)
    bans = []  # (number of output tokens, banned ids) of each sampling step
    while sched.has_unfinished_requests():
        out = sched.schedule()
        bans += [(request.num_output_tokens, s.banned_token_ids) for s in out.scheduled
                 if s.num_samples]
        sched.update(out, runner.execute(out))
        sched.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
    return request, bans


def test_eos_stops_the_request():
    eos, ref = _eos_at(5)
    request, bans = _run(SamplingParams(max_tokens=30), eos)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
    assert request.output_token_ids == ref[:6]
    assert all(banned == () for _, banned in bans)


def test_ignore_eos_runs_to_max_tokens():
    eos, ref = _eos_at(5)
    request, _ = _run(SamplingParams(max_tokens=30, ignore_eos=True), eos)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == ref[:30]


def test_min_tokens_bans_eos_until_reached():
    eos, ref = _eos_at(5)
    later = next((i for i in range(9, 40) if ref[i] == eos), None)
    request, bans = _run(SamplingParams(max_tokens=30, min_tokens=9), eos)
    # The fake runner ignores bans, so eos is drawn at index 5 yet must not stop the request.
    assert request.output_token_ids[:9] == ref[:9]
    if later is not None and later < 30:
        assert request.status == RequestStatus.FINISHED_STOPPED
        assert request.output_token_ids == ref[:later + 1]
    else:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == ref[:30]
    assert [banned for count, banned in bans if count < 9] == [(eos,)] * 9
    assert all(banned == () for count, banned in bans if count >= 9)
