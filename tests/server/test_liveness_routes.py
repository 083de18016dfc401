"""/health and /ping answer as vLLM's (200 with an empty body; 503 while shutting down, here
with a JSON error) and the OpenAPI schema says exactly that (issue 43): schemathesis' response
checks (status code, content type, schema conformance) pass on each answer."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app

ROUTES = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")]


def _validate(app, client: TestClient, method: str, path: str, status: int) -> None:
    """The answer's status and body, and schemathesis' checks of it against the schema."""
    answer = client.request(method, path)
    assert answer.status_code == status
    if status == 200:
        assert answer.content == b""
    else:
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["type"] == "server_unavailable"
    schemathesis = pytest.importorskip("schemathesis")
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)[path][method]
    # a 503 is the answer asked for here, not a server error
    excluded = [] if status == 200 else [schemathesis.checks.not_a_server_error]
    operation.Case().call_and_validate(excluded_checks=excluded)


@pytest.mark.timeout(120, method="thread")
def test_liveness_answers_match_their_schema(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=64, num_gpu_blocks_override=64))
    app = create_app(engine, served_model_name="m")
    responses = app.openapi()["paths"]["/health"]["get"]["responses"]
    assert "content" not in responses["200"]  # an empty body, documented as one
    assert "ErrorResponse" in str(responses["503"]["content"]["application/json"])
    try:
        with TestClient(app) as client:
            for method, path in ROUTES:
                _validate(app, client, method, path, 200)
            app.state.async_engine.begin_drain()
            for method, path in ROUTES:
                _validate(app, client, method, path, 503)
    finally:
        engine.shutdown()
