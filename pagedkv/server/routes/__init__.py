"""The server's routes, one `APIRouter` per area, each a module-level `router` whose handlers
read the app's state (`request.app.state`: `serving`, `async_engine`, `metrics`, `engine_facts`,
`stall_timeout_s`, set by `create_app`):

- `health`: GET /health, GET|POST /ping (liveness)
- `tokens`: POST /tokenize, POST /detokenize
- `ops`: GET /version, GET /kv_cache_info, GET /metrics
- `openai`: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, /v1/chat/completions,
  /v1/responses
- `pins`: POST /v1/pin, POST /v1/unpin

The dashboard's routes are `pagedkv.server.dashboard.routes`.
"""

from __future__ import annotations

from typing import Any

from pagedkv.http.protocol import ErrorResponse

# The error answers a route documents in the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
