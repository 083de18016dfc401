"""The offload tiers' keys carry the KV cache dtype and the fp8 scales: a block of one format
(model dtype, fp8 e4m3 / e5m2, int8 with its scales) is never served to a cache of another, and
is served to a later engine of the same format and model; the host tier gives each format's
blocks back to its own engine."""

from __future__ import annotations

import pytest

from tests.store.conftest import make_prefixes, run_one, store_llm, with_suffix


def test_disk_blocks_are_shared_only_between_caches_of_the_same_dtype(tiny_llama, tmp_path):
    prompt = with_suffix(make_prefixes(seed=7, num=1)[0], seed=2)
    full_blocks = (len(prompt) - 1) // 4 * 4
    writer = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype="fp8")
    fp8_tokens, cached = run_one(writer, prompt)
    assert cached == 0 and writer.llm_engine.kv_store.snapshot_stats()[0].blocks_written > 0
    writer.shutdown()

    for other in ("auto", "fp8_e5m2"):  # same directory, another cache dtype: no hit
        llm = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype=other)
        assert run_one(llm, prompt)[1] == 0, other
        assert llm.llm_engine.kv_store.snapshot_stats()[0].hits == 0
        llm.shutdown()

    for same in ("fp8", "fp8_e4m3"):  # the same bytes and scales: every full block from disk
        llm = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype=same)
        tokens, cached = run_one(llm, prompt)
        assert cached == full_blocks, same
        assert tokens == fp8_tokens  # the stored fp8 blocks read back exactly
        llm.shutdown()


def test_fp8_blocks_saved_under_other_scales_are_refused(tiny_llama, tmp_path, monkeypatch):
    """Same model, same fp8 dtype, other scales (as another calibration would give): the
    blocks on disk mean other values, so none is loaded, and the tokens are the engine's own."""
    from pagedkv.model import kv_calibration
    from pagedkv.model.kv_quant import KVScales

    prompt = with_suffix(make_prefixes(seed=8, num=1)[0], seed=3)
    writer = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype="fp8")
    run_one(writer, prompt)
    assert writer.llm_engine.kv_store.snapshot_stats()[0].blocks_written > 0
    writer.shutdown()

    real = kv_calibration.calibrate_kv_scales

    def times(scale, factor):  # per-layer (a float) or per-head (a tuple) scales
        return tuple(x * factor for x in scale) if isinstance(scale, tuple) else scale * factor

    def other_scales(*args, **kwargs):
        return [KVScales(times(s.k_scale, 2.0), times(s.v_scale, 0.5))
                for s in real(*args, **kwargs)]

    monkeypatch.setattr(kv_calibration, "calibrate_kv_scales", other_scales)
    own = store_llm(tiny_llama, "none", tmp_path, kv_cache_dtype="fp8")
    own_tokens, _ = run_one(own, prompt)
    own.shutdown()
    reader = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype="fp8")
    tokens, cached = run_one(reader, prompt)
    assert cached == 0 and reader.llm_engine.kv_store.snapshot_stats()[0].hits == 0
    assert tokens == own_tokens
    reader.shutdown()


FORMATS = ("auto", "fp8", "fp8_e5m2", "int8")


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_each_format_reads_back_its_own_blocks_and_no_other_formats(tiny_llama, tmp_path, tier,
                                                                   request):
    """One shared tier, each format in turn: an engine of that format finds none of the blocks
    the earlier formats left there (the format is in the key, both ways: every pair meets), then
    a second engine of the same format reads every full block back (int8 with its scales) and
    yields the first one's tokens."""
    url = request.getfixturevalue("redis_server").url if tier == "redis" else None
    prompt = with_suffix(make_prefixes(seed=9, num=1)[0], seed=4)
    full_blocks = (len(prompt) - 1) // 4
    for fmt in FORMATS:
        writer = store_llm(tiny_llama, tier, tmp_path, url, kv_cache_dtype=fmt)
        tokens, cached = run_one(writer, prompt)
        assert cached == 0, fmt
        assert writer.llm_engine.kv_store.snapshot_stats()[0].hits == 0, fmt
        writer.shutdown()
        reader = store_llm(tiny_llama, tier, tmp_path, url, kv_cache_dtype=fmt)
        again, cached = run_one(reader, prompt)
        assert cached == 4 * full_blocks, fmt
        assert reader.llm_engine.kv_store.snapshot_stats()[0].hits == full_blocks, fmt
        assert again == tokens, fmt
        reader.shutdown()


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
def test_quantized_blocks_come_back_from_the_host_tier(tiny_llama, tmp_path, fmt):
    """Each request evicts the previous one's blocks from the device pool; the second round gets
    every prefix back from host memory (bytes, and int8's scales, restored) and yields the first
    round's tokens."""
    llm = store_llm(tiny_llama, "host", tmp_path, kv_cache_dtype=fmt)
    prompts = [with_suffix(p, seed=i) for i, p in enumerate(make_prefixes(seed=10, num=3))]
    first = [run_one(llm, p) for p in prompts]
    assert all(cached == 0 for _, cached in first)
    second = [run_one(llm, p) for p in prompts]
    full = [(len(p) - 1) // 4 * 4 for p in prompts]
    assert [cached for _, cached in second] == full
    assert [tokens for tokens, _ in second] == [tokens for tokens, _ in first]
    engine = llm.llm_engine
    assert engine.scheduler.prefix_cache_hits == 0  # every hit came from the host tier
    assert engine.kv_store.snapshot_stats()[0].hits == sum(full) // 4
    engine.check_invariants()
    llm.shutdown()


def _logprobs_run(llm, prompt: list[int]) -> tuple[list[int], list[dict[int, float]], int]:
    """Greedy tokens, their top-5 logprobs and num_cached_tokens of one request run alone."""
    from pagedkv import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=4, temperature=0.0, logprobs=5),
                       use_tqdm=False)[0]
    llm.llm_engine.check_invariants()
    llm.llm_engine.kv_store.flush()
    return list(out.outputs[0].token_ids), out.outputs[0].logprobs, out.num_cached_tokens


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_restarted_engine_reads_its_quantized_blocks_back_with_identical_logits(
        tiny_llama, tmp_path, fmt):
    """The disk tier outlives the engine: a restarted engine of the same format and weights
    dtype loads every full block and its logprobs equal the first run's within float32
    summation order (the bytes, and int8's scales, come back as written). The same cache format over weights of another
    dtype computes other K/V: its blocks are others (the weights dtype is in the key)."""
    prompt = with_suffix(make_prefixes(seed=11, num=1)[0], seed=5)
    full = (len(prompt) - 1) // 4 * 4
    runs = []
    for _ in range(2):
        llm = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype=fmt, dtype="float32")
        runs.append(_logprobs_run(llm, prompt))
        llm.shutdown()
    assert [r[2] for r in runs] == [0, full]
    assert runs[1][0] == runs[0][0]  # the same tokens, and the same logprobs up to the order
    # of float32 sums (the restarted run attends its tail after a loaded prefix, the first run
    # the whole prompt fresh: other kernels); a wrong block or scale moves them by far more
    for loaded, fresh in zip(runs[1][1], runs[0][1], strict=True):
        assert loaded.keys() == fresh.keys()
        assert all(abs(loaded[t] - fresh[t]) < 1e-5 for t in fresh), (loaded, fresh)
    other = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype=fmt, dtype="bfloat16")
    assert _logprobs_run(other, prompt)[2] == 0
    assert other.llm_engine.kv_store.snapshot_stats()[0].hits == 0
    other.shutdown()
