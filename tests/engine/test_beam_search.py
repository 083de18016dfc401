"""Beam search (pagedkv/sched/beam.py, `LLM.beam_search`): the beams and their scores equal
transformers' `generate(num_beams=W)`; the beams share their common blocks (fewer blocks than W
separate sequences); the pool stays consistent every step and is whole again after, through
prefix caching, both preemption modes, aborts and the core process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.beam_search import BeamSearchOutput, beam_search_output
from pagedkv.sched.output import SchedulerOutput
from pagedkv.sched.request import RequestStatus
from pagedkv.utils import cdiv
from tests.engine.conftest import assert_pool_empty, make_prompts
from tests.tiny_models import load_hf_model

WIDTH, MAX_TOKENS = 3, 6
SCORE_TOLERANCE = 1e-3
_HF: dict[str, object] = {}


def hf_model(model_dir: Path):
    if str(model_dir) not in _HF:
        _HF[str(model_dir)] = load_hf_model(model_dir)
    return _HF[str(model_dir)]


def hf_beams(model_dir: Path, prompt: list[int], width: int = WIDTH,
             max_tokens: int = MAX_TOKENS, length_penalty: float = 1.0,
             early_stopping: bool | str = False) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (output tokens, up to and with the first eos) and scores."""
    model = hf_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=length_penalty,
                             early_stopping=early_stopping, output_scores=True,
                             return_dict_in_generate=True)
    beams = []
    for seq in out.sequences:
        tokens = seq[len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        beams.append(tokens[:end])
    return beams, out.sequences_scores.tolist()


def assert_equal_to_transformers(output: BeamSearchOutput, model_dir: Path, prompt: list[int],
                                 **kwargs) -> None:
    beams, scores = hf_beams(model_dir, prompt, **kwargs)
    ours = [s.tokens[len(prompt):] for s in output.sequences]
    assert ours == beams
    for seq, score in zip(output.sequences, scores, strict=True):
        assert seq.tokens[:len(prompt)] == prompt
        assert seq.score == pytest.approx(score, abs=SCORE_TOLERANCE)
        assert seq.cum_logprob == pytest.approx(sum(
            table[t] for t, table in zip(seq.tokens[len(prompt):], seq.logprobs, strict=True)))


def run_checked(llm: LLM, prompts: list[list[int]], params: BeamSearchParams
                ) -> tuple[list[BeamSearchOutput], int]:
    """Beam search stepped by hand: the pool's invariants checked after every step. Returns
    the outputs and the most blocks held at once."""
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    ids = [f"beam-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params.sampling_params())
    finished, held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        held = max(held, kv.num_usable_blocks - kv.num_free_blocks)
    assert_pool_empty(llm)
    return [beam_search_output(finished[i], params.length_penalty) for i in ids], held


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral",
                                   "tiny_gemma2", "tiny_gemma3", "tiny_qwen2_mixed"])
def test_beams_equal_transformers_every_architecture(request, make_llm, model):
    model_dir = request.getfixturevalue(model)
    prompt = make_prompts(seed=3, vocab=400, num=1, shared_prefix=0, lengths=(13, 13))[0]
    llm = make_llm(model_dir, block_size=4)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    (output,), _ = run_checked(llm, [prompt], params)
    assert len(output.sequences) == WIDTH
    assert_equal_to_transformers(output, model_dir, prompt)
    assert [s.score for s in output.sequences] == sorted((s.score for s in output.sequences),
                                                         reverse=True)


@pytest.fixture(scope="module")
def eos_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The tiny Llama with two more eos ids: tokens its beams often choose, so that beams end
    early (eos hypotheses, three candidates per beam). Returns the directory and a prompt."""
    prompt = make_prompts(seed=5, vocab=400, num=1, shared_prefix=0, lengths=(11, 11))[0]
    beams, _ = hf_beams(tiny_llama, prompt, width=4, max_tokens=8)
    extra = [beams[0][2], beams[1][4]]
    model_dir = tmp_path_factory.mktemp("beam_eos") / "model"
    shutil.copytree(tiny_llama, model_dir)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], *dict.fromkeys(extra)]
    config_path.write_text(json.dumps(config))
    return model_dir, prompt


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    llm = LLM(model=str(eos_model[0]), block_size=4, seed=0, kv_cache_memory_bytes=32 << 20,
              enable_prefix_caching=True)
    yield llm
    assert_pool_empty(llm)
    llm.shutdown()


@pytest.mark.parametrize("length_penalty, early_stopping", [
    (1.0, False), (2.0, True), (0.5, "never"), (-1.0, False), (0.0, "never"), (1.0, True)])
def test_eos_length_penalty_and_early_stopping_as_transformers(eos_model, eos_llm,
                                                               length_penalty, early_stopping):
    model_dir, prompt = eos_model
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    (output,), _ = run_checked(eos_llm, [prompt], params)
    assert_equal_to_transformers(output, model_dir, prompt, width=4, max_tokens=8,
                                 length_penalty=length_penalty, early_stopping=early_stopping)
    eos = set(eos_llm.llm_engine.tokenizer.eos_token_ids)
    ended = [s for s in output.sequences if s.tokens[-1] in eos]
    assert all(s.finish_reason == "stop" for s in ended)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 8
               for s in output.sequences if s not in ended)


def test_some_beams_end_with_eos(eos_model, eos_llm):
    """The eos model's search is the one above: it does file eos hypotheses."""
    model_dir, prompt = eos_model
    output = eos_llm.beam_search([{"prompt_token_ids": prompt}],
                                 BeamSearchParams(beam_width=4, max_tokens=8))[0]
    assert any(s.finish_reason == "stop" for s in output.sequences)


def test_beams_hold_fewer_blocks_than_separate_sequences(tiny_llama, make_llm):
    """W beams share the prompt's blocks and each other's common prefix: the most blocks they
    hold is at most the prompt's full blocks plus each beam's own tail, well under W
    separate sequences of the same length (prefix caching on: those get distinct prompts)."""
    width, max_tokens, block_size, length = 4, 12, 4, 30
    prompts = make_prompts(seed=7, vocab=400, num=width + 1, shared_prefix=0,
                           lengths=(length, length))
    llm = make_llm(tiny_llama, block_size=block_size)
    _, beams_held = run_checked(llm, prompts[:1],
                                BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    separate = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"sep-{i}", {"prompt_token_ids": prompt}, separate)
    separate_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        separate_held = max(separate_held, kv.num_usable_blocks - kv.num_free_blocks)
    # Between steps (the last step's blocks are freed as it finishes) a sequence holds at
    # most the K/V of length + max_tokens - 2 tokens.
    assert separate_held == width * cdiv(length + max_tokens - 2, block_size)
    own_tail = cdiv(length % block_size + max_tokens - 2, block_size)
    assert beams_held <= length // block_size + width * own_tail
    assert beams_held < separate_held


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_search_keeps_the_beams(tiny_llama, make_llm, mode):
    """Three searches in a pool too small for all their beams: beams are preempted (and
    forked while preempted); every search still equals transformers'."""
    prompts = make_prompts(seed=9, vocab=400, num=3, shared_prefix=0, lengths=(14, 18))
    extra = dict(swap_space=0.01) if mode == "swap" else {}
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=24,
                   preemption_mode=mode, **extra)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    outputs, _ = run_checked(llm, prompts, params)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_equal_to_transformers(output, tiny_llama, prompt)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_preempted_while_its_group_waits(tiny_llama, make_llm, mode):
    """A beam preempted after it sampled and before its group picks the next beams (what the
    scheduler does to a waiting beam when another request needs its blocks): its
    continuations are forked without device blocks to share (they recompute, or swap back
    in), and the search still equals transformers'."""
    extra = dict(swap_space=0.01) if mode == "swap" else {}
    llm = make_llm(tiny_llama, block_size=4, preemption_mode=mode, **extra)
    scheduler = llm.llm_engine.scheduler
    beams, swaps, parents = scheduler.beams, [], []
    calls = iter(range(1000))
    on_sample, schedule, fork = beams.on_sample, scheduler.schedule, beams._fork

    def on_sample_then_preempt(request, logprobs):
        on_sample(request, logprobs)
        if next(calls) in (4, 5, 8, 9):  # beams of the third and fourth rounds
            out = SchedulerOutput()
            scheduler._preempt(request, out)
            swaps.extend(out.blocks_to_swap_out)  # copied by the next step, before it runs

    def schedule_with_swaps():
        out = schedule()
        out.blocks_to_swap_out[:0] = swaps
        swaps.clear()
        return out

    def recording_fork(group, parent):
        parents.append(parent.status)
        return fork(group, parent)

    beams.on_sample, scheduler.schedule, beams._fork = (
        on_sample_then_preempt, schedule_with_swaps, recording_fork)
    prompt = make_prompts(seed=13, vocab=400, num=1, shared_prefix=0, lengths=(15, 15))[0]
    (output,), _ = run_checked(llm, [prompt], BeamSearchParams(beam_width=WIDTH,
                                                               max_tokens=MAX_TOKENS))
    assert_equal_to_transformers(output, tiny_llama, prompt)
    preempted = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED
    assert preempted in parents


def test_a_beam_that_never_fits_again_does_not_stall_the_search(tiny_llama, make_llm):
    """Without prefix caching a recomputed beam shares nothing: in a pool this small it can
    never be readmitted beside its sampled siblings. The step then runs nothing, and the
    group goes on with the beams that sampled: every search ends, the pool whole. (Budget-
    filling admission, `prefill_batching="fill"`, is what crowds the pool here.)"""
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=10,
                   enable_prefix_caching=False, max_num_batched_tokens=16,
                   prefill_batching="fill")
    beams, drops = llm.llm_engine.scheduler.beams, []
    drop = beams._drop_unsampled

    def recording_drop(group):
        drops.append(group.root.request_id)
        drop(group)

    beams._drop_unsampled = recording_drop
    prompts = make_prompts(seed=9, vocab=400, num=4, shared_prefix=0, lengths=(10, 18))
    outputs, _ = run_checked(llm, prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=8))
    assert drops
    for output in outputs:
        assert len(output.sequences) == WIDTH
        scores = [s.score for s in output.sequences]
        assert scores == sorted(scores, reverse=True)


def test_a_failing_step_ends_the_search_with_its_error(tiny_llama, make_llm):
    """A model step that raises mid-search ends the request (finish_reason "error", the
    fault named) and frees every beam; the engine searches on."""
    llm = make_llm(tiny_llama, block_size=4)
    engine = llm.llm_engine
    real_execute, calls = engine.runner.execute, [0]

    def execute(out):
        calls[0] += 1
        if calls[0] == 3:
            assert {r.request_id.split("#")[0] for r in out.scheduled} == {"a"}
            raise RuntimeError("injected fault")
        return real_execute(out)

    engine.runner.execute = execute
    prompts = make_prompts(seed=11, vocab=400, num=2, shared_prefix=0, lengths=(13, 13))
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params.sampling_params())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
    failed = finished["a"]
    assert failed.outputs[0].finish_reason == "error" and "injected fault" in failed.error
    assert_pool_empty(llm)
    engine.runner.execute = real_execute
    (output,), _ = run_checked(llm, prompts[1:], params)
    assert_equal_to_transformers(output, tiny_llama, prompts[1])


def test_abort_mid_search_frees_every_beam(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4)
    engine = llm.llm_engine
    prompt = make_prompts(seed=11, vocab=400, num=1, shared_prefix=0, lengths=(13, 13))[0]
    engine.add_request("a", {"prompt_token_ids": prompt},
                       BeamSearchParams(beam_width=4, max_tokens=20).sampling_params())
    for _ in range(4):
        engine.step()
        engine.check_invariants()
    assert len(engine.scheduler.requests) == 4  # the live beams
    engine.abort_request("a")
    engine.check_invariants()
    assert not engine.has_unfinished_requests()  # (make_llm checks the pool is whole)


def test_core_process_returns_the_same_beams(tiny_llama):
    prompts = make_prompts(seed=3, vocab=400, num=2, shared_prefix=0, lengths=(13, 20))
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    llm = LLM(model=str(tiny_llama), block_size=4, seed=0, kv_cache_memory_bytes=32 << 20,
              core_process=True)
    try:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        llm.llm_engine.check_invariants()
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_equal_to_transformers(output, tiny_llama, prompt)
        assert all(s.text for s in output.sequences)


def test_beams_beside_speculative_decoding(tiny_llama, make_llm):
    """With speculation on, beams are never speculated (their group picks every token) and a
    greedy request beside them still is: the beams equal transformers', the pool ends empty."""
    prompt = make_prompts(seed=3, vocab=400, num=1, shared_prefix=0, lengths=(13, 13))[0]
    llm = make_llm(tiny_llama, block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2})
    engine = llm.llm_engine
    engine.add_request("greedy", {"prompt_token_ids": prompt * 3},
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    (output,), _ = run_checked(llm, [prompt], BeamSearchParams(beam_width=WIDTH,
                                                                max_tokens=MAX_TOKENS))
    assert_equal_to_transformers(output, tiny_llama, prompt)
    assert engine.get_stats().spec_decode_num_drafts > 0  # the greedy request was speculated


@pytest.mark.parametrize("kwargs, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=4, length_penalty="long"), "length_penalty"),
])
def test_bad_beam_search_params_name_the_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**kwargs)


def test_extreme_length_penalties_still_score(tiny_llama, make_llm):
    """A penalty whose length ** penalty leaves the float range still ranks the beams."""
    llm = make_llm(tiny_llama, block_size=4)
    prompt = make_prompts(seed=3, vocab=400, num=1, shared_prefix=0, lengths=(13, 13))[0]
    for penalty in (1e6, -1e6):
        output = llm.beam_search([{"prompt_token_ids": prompt}],
                                 BeamSearchParams(beam_width=2, max_tokens=3,
                                                  length_penalty=penalty))[0]
        assert len(output.sequences) == 2


def test_what_beam_search_cannot_combine_with():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(n=2, use_beam_search=True, stop="x")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(n=2, use_beam_search=True, min_tokens=2)
