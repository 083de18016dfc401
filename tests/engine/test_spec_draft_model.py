"""Speculative decoding with a draft model (`speculative_config` method "draft_model"): greedy
tokens equal to no speculation (two architectures, a different draft model); the target as its
own draft accepts every draft; the draft's own KV pool back to fully free once requests finish,
are preempted or aborted (both pools' invariants checked every step); bad configs refused;
`pagedkv serve --speculative-config` with a draft model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.engine.draft_setup import check_draft_vocab
from pagedkv.spec import parse_speculative_config
from pagedkv.testing.random_model import build_random_model_dir
from tests.engine.test_spec_decode import check_every_step, generate, repeating_prompts, spec_stats
from tests.tiny_models import build_hf_model

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(block_size=4, num_gpu_blocks_override=120, max_model_len=128)


def draft_config(model_dir: Path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer llama of another seed over the same tokenizer (the same vocab)."""
    return build_hf_model(tmp_path_factory.mktemp("draft"), "llama", seed=11, num_layers=1)


def draft_kv(llm):  # noqa: ANN001, ANN201
    return llm.llm_engine.core.scheduler.proposer.kv


def check_draft_every_step(llm) -> None:  # noqa: ANN001
    """Both pools' invariants after every applied step."""
    check_every_step(llm)
    scheduler = llm.llm_engine.core.scheduler
    update = scheduler.update

    def checked(out, result):  # noqa: ANN001, ANN202
        changed = update(out, result)
        draft_kv(llm).check_invariants()
        return changed

    scheduler.update = checked


def assert_draft_pool_free(llm) -> None:  # noqa: ANN001
    kv = draft_kv(llm)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not llm.llm_engine.core.scheduler.proposer._seqs


def test_greedy_tokens_equal_no_speculation_with_a_small_draft(tiny_model, small_draft, make_llm):
    """Every architecture as the target, a one-layer llama over the same tokenizer as the draft."""
    model = tiny_model
    prompts = repeating_prompts(3, seed=4)
    expected = [o.token_ids for o in generate(make_llm(model, **KW), prompts, GREEDY)]
    spec = make_llm(model, speculative_config=draft_config(small_draft), **KW)
    check_draft_every_step(spec)
    assert [o.token_ids for o in generate(spec, prompts, GREEDY)] == expected
    stats = spec_stats(spec)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_draft_pool_free(spec)


def test_target_as_its_own_draft_accepts_every_draft(tiny_llama, make_llm):
    prompts = repeating_prompts(3, seed=5)
    expected = [o.token_ids for o in generate(make_llm(tiny_llama, **KW), prompts, GREEDY)]
    spec = make_llm(tiny_llama, speculative_config=draft_config(tiny_llama, k=4), **KW)
    check_draft_every_step(spec)
    assert [o.token_ids for o in generate(spec, prompts, GREEDY)] == expected
    stats = spec_stats(spec)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    # Every verifying step emits its drafts and one token more: 16 tokens in fewer steps.
    assert stats.spec_decode_num_drafts < 3 * (GREEDY.max_tokens - 1)
    assert_draft_pool_free(spec)
    proposer = spec.llm_engine.core.scheduler.proposer
    spec.shutdown()  # the draft's weights and KV cache go with the engine's
    assert proposer.runner.model is None and proposer.runner.kv_cache is None


def test_seeded_sampling_is_reproducible_with_a_draft(tiny_llama, small_draft, make_llm):
    prompts = repeating_prompts(2, seed=8)
    params = SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=16, ignore_eos=True,
                            n=2)
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_llama, speculative_config=draft_config(small_draft), **KW)
        check_draft_every_step(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        assert spec_stats(llm).spec_decode_num_draft_tokens > 0
        assert_draft_pool_free(llm)
    assert runs[0] == runs[1]
    assert all(len(t) == 16 for samples in runs[0] for t in samples)


def test_structured_outputs_and_stops_with_the_target_as_its_own_draft(tiny_llama, make_llm):
    prompts = repeating_prompts(3, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=r"(ab-|cd-){6}")),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    expected = generate(make_llm(tiny_llama, **KW), prompts, params)
    spec = make_llm(tiny_llama, speculative_config=draft_config(tiny_llama), **KW)
    check_draft_every_step(spec)
    got = generate(spec, prompts, params)
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == \
        [(e.token_ids, e.text, e.finish_reason) for e in expected]
    assert [[sorted(d) for d in g.logprobs] for g in got[1:2]] == \
        [[sorted(d) for d in e.logprobs] for e in expected[1:2]]
    stats = spec_stats(spec)
    assert 0 < stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_draft_pool_free(spec)


def test_preemption_and_abort_free_the_drafts_blocks(tiny_llama, small_draft, make_llm):
    prompts = [p for p in repeating_prompts(5, seed=6) for _ in range(2)]
    kw = dict(block_size=4, num_gpu_blocks_override=36, max_model_len=128,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in generate(make_llm(tiny_llama, **kw), prompts, params)]
    spec = make_llm(tiny_llama, speculative_config=draft_config(small_draft), **kw)
    check_draft_every_step(spec)
    assert [o.token_ids for o in generate(spec, prompts, params)] == expected
    assert spec_stats(spec).num_preemptions > 0
    assert_draft_pool_free(spec)
    engine = spec.llm_engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"a{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(30):
        engine.step()
        if draft_kv(spec).num_free_blocks < draft_kv(spec).num_usable_blocks \
                and spec_stats(spec).spec_decode_num_drafts > 0:
            break
    assert draft_kv(spec).num_free_blocks < draft_kv(spec).num_usable_blocks
    engine.abort_request(["a0", "a1", "a2"])
    assert_draft_pool_free(spec)


def test_bad_draft_configs_are_refused(tiny_llama, make_llm, tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(ValueError, match="no-such-draft"):
        make_llm(tiny_llama, speculative_config=draft_config(missing), **KW)
    with pytest.raises(ValueError, match="speculative_config.model"):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        parse_speculative_config({"method": "draft_model", "model": "d",
                                  "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    with pytest.raises(ValueError, match=r"'small'.*1000.*'big'.*2000"):
        check_draft_vocab("small", 1000, "big", 2000)
    check_draft_vocab("a", 5, "b", 5)
    other_vocab = build_random_model_dir(tmp_path / "other-vocab", num_layers=1, vocab_size=704)
    with pytest.raises(ValueError, match=r"other-vocab.*vocab_size 704.*640"):
        make_llm(tiny_llama, speculative_config=draft_config(other_vocab), **KW)
    assert parse_speculative_config(draft_config(missing, k=2)).model == str(missing)


def metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name)]
    assert lines, name
    return float(lines[0].rsplit(" ", 1)[1])


def test_served_with_the_target_as_its_own_draft(tiny_llama):
    from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, wait_for_idle_pool

    prompt = "one two three four one two three four one two"
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS)
    try:
        expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                           ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
    finally:
        offline.shutdown()
    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS), "--speculative-config",
                         json.dumps(draft_config(tiny_llama))).start()
    try:
        answer = httpx.post(proc.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert answer["choices"][0]["text"] == expected
        wait_for_idle_pool(proc.url)
        info = httpx.get(proc.url + "/kv_cache_info", timeout=10).json()
        assert info["draft_num_gpu_blocks"] == info["num_gpu_blocks"] > 0
        text = httpx.get(proc.url + "/metrics", timeout=10).text
        drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        assert drafted > 0
        assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == drafted
    finally:
        assert proc.stop()


def test_the_kv_budget_is_shared_with_the_draft(tiny_llama, small_draft, make_llm):
    budget = 1 << 20
    plain = make_llm(tiny_llama, block_size=4, kv_cache_memory_bytes=budget, max_model_len=128)
    spec = make_llm(tiny_llama, block_size=4, kv_cache_memory_bytes=budget, max_model_len=128,
                    speculative_config=draft_config(small_draft))
    target_page = plain.llm_engine.core.kv_setup.spec.page_size_bytes
    proposer = spec.llm_engine.core.scheduler.proposer
    assert plain.llm_engine.core.kv_setup.num_blocks == budget // target_page
    assert spec.llm_engine.core.kv_setup.num_blocks == proposer.num_blocks == \
        budget // (target_page + proposer.block_bytes)
    # The one-layer draft's blocks are half the two-layer target's.
    assert proposer.block_bytes * 2 == target_page


def test_rejected_drafts_are_rolled_back_to_what_a_fresh_draft_proposes(small_draft):
    from pagedkv.engine.draft_proposer import DraftModelProposer
    from pagedkv.kv.factory import make_kv_cache_manager
    from pagedkv.model.runner import ModelRunner

    def proposer() -> DraftModelProposer:
        runner = ModelRunner(small_draft, block_size=4, num_blocks=64, dtype="float32",
                             device="cpu", cpu_threads=1)
        return DraftModelProposer(runner, make_kv_cache_manager(
            runner.kv_cache_spec, num_blocks=64, enable_caching=False), k=3)

    used, fresh = proposer(), proposer()
    tokens = repeating_prompts(1, seed=10)[0]
    tokens = tokens[:len(tokens) // 4 * 4 - 1]  # 3 past a block boundary
    drafts = used.propose_batch([("r", tokens, 8)])[0]
    assert len(drafts) == 3
    kv = used.kv
    assert len(kv.get_block_ids("r")) == (len(tokens) + 1) // 4 + 1  # tokens and 2 drafts
    # The target rejects the first draft: the drafts' KV and their block are given back.
    later = tokens + [(drafts[0] + 1) % 300]
    assert used.propose_batch([("r", later, 1)])[0] == fresh.propose_batch([("r", later, 1)])[0]
    assert used._seqs["r"].num_computed_tokens == len(later)
    assert len(kv.get_block_ids("r")) == len(later) // 4
    # Then accepts one of two: the same drafts as a draft that never saw the rejected ones.
    two = used.propose_batch([("r", later, 2)])[0]
    again = later + [two[0], (two[1] + 1) % 300]
    assert used.propose_batch([("r", again, 3)])[0] == fresh.propose_batch([("r", again, 3)])[0]
    assert used._seqs["r"].num_computed_tokens == len(again) + 2
    kv.check_invariants()
    used.forget("r")
    used.forget("unknown")
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants()
