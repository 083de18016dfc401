"""The HTTP surface `pagedkv serve` and `pagedkv router` share: OpenAI's wire protocol
(`protocol.py`, vLLM's extra request fields in `request_fields.py`), OpenAI-style error bodies and
their handlers (`errors.py`), the API-key check (`auth.py`) and the dashboard's session access
(`dashboard_access.py`), the request-size limit (`body_limit.py`), Server-Sent Events framing
(`sse.py`), uvicorn's log format (`access_log.py`), and prompts to token ids (`prompt_render.py`).

Both the server and the router import this package; the router never imports `pagedkv.server`.
Nothing here needs an engine or torch.
"""
