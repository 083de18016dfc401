"""vLLM's spec_decode_* counters, rendered from an EngineStats snapshot (absent without
speculative decoding)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pagedkv.engine.stats import EngineStats
from pagedkv.server.vllm_metrics import engine_families


def exposition(stats: EngineStats) -> str:
    class Collector:
        def collect(self):  # noqa: ANN202
            return engine_families("vllm", ["model_name"], ["m"], stats, 16, {}, 1.0)

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


def test_spec_decode_counters_as_vllms():
    text = exposition(EngineStats(spec_decode_num_drafts=7, spec_decode_num_draft_tokens=20,
                                  spec_decode_num_accepted_tokens=9,
                                  spec_decode_accepted_per_pos=(6, 2, 1, 0)))
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    for position, count in enumerate((6, 2, 1, 0)):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{position}"}} {count:.1f}') in text


def test_absent_without_speculative_decoding():
    assert "spec_decode" not in exposition(EngineStats())
