"""Streamed chunks written from a template (`ChunkTemplate`) are the same bytes as the chunk
models' own SSE events, for completions and chat, every kind of text included; a template
whose placeholder is not found exactly once in the rendering is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedkv.http.chunk_template import INT_PLACEHOLDER, ChunkTemplate
from pagedkv.http.protocol import (
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
)
from pagedkv.server import serving_chat, serving_completion
from pagedkv.server.response_extras import ResponseExtras

from .test_sse_chunk_json import TEXTS

SERVING = SimpleNamespace(model_name="m\u00e9 \x7f")
EXTRAS = ResponseExtras("chatcmpl-\"q\"", "fp_1", None, True)


def _completion(created: int, index: int, text: str) -> str:
    return serving_completion._chunk_event(CompletionResponse(
        id=EXTRAS.id, model=SERVING.model_name, system_fingerprint=EXTRAS.fingerprint,
        created=created, choices=[CompletionChoice(index=index, text=text)]))


def _chat(created: int, index: int, text: str) -> str:
    return serving_chat._chunk(SERVING, EXTRAS, ChatStreamChoice(
        index=index, delta=ChatDelta(content=text)), created=created)


@pytest.mark.parametrize("module, reference", [(serving_completion, _completion),
                                               (serving_chat, _chat)])
def test_template_chunks_equal_the_models_events(module, reference):
    template = module._plain_template(SERVING, EXTRAS)
    assert template is not None
    for created, index in ((1795939558, 0), (1795939559, 17)):
        for text in TEXTS:
            assert template.event(created, index, text) == reference(created, index, text)


def test_holes_in_any_order_and_a_placeholder_found_twice_gives_no_template():
    template = ChunkTemplate.make(lambda c, i, t: f"{{a{i}b{json.dumps(t)}c{c}}}")
    assert template.event(7, 5, "x\u00e9{}") == '{a5b"x\\u00e9{}"c7}'
    clashing = ResponseExtras(f"cmpl-{INT_PLACEHOLDER}", None, None, True)
    assert serving_completion._plain_template(SERVING, clashing) is None
    assert ChunkTemplate.make(lambda c, i, t: f"{c} {c} {i} {json.dumps(t)}") is None
    assert ChunkTemplate.make(lambda c, i, t: f"{c} {i} {t}") is None  # text not as JSON
