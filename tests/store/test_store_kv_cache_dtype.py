"""The offload tiers' keys carry the KV cache dtype and the fp8 scales: an fp8 block is never
served to a cache of another dtype, and is served to a later fp8 engine of the same model."""

from __future__ import annotations

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


def test_int8_blocks_round_trip_through_disk_with_their_scales(tiny_llama, tmp_path):
    """An int8 block's row carries its per-token scales: a later int8 engine reads every full
    block back (the same tokens as the writer), and a cache of another format never does."""
    prompt = with_suffix(make_prefixes(seed=8, num=1)[0], seed=3)
    full_blocks = (len(prompt) - 1) // 4 * 4
    writer = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype="int8")
    int8_tokens, cached = run_one(writer, prompt)
    assert cached == 0 and writer.llm_engine.kv_store.snapshot_stats()[0].blocks_written > 0
    writer.shutdown()

    for other in ("auto", "fp8"):
        llm = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype=other)
        assert run_one(llm, prompt)[1] == 0, other
        llm.shutdown()

    reader = store_llm(tiny_llama, "disk", tmp_path, kv_cache_dtype="int8")
    tokens, cached = run_one(reader, prompt)
    assert cached == full_blocks
    assert tokens == int8_tokens
    reader.shutdown()
