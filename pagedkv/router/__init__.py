"""`pagedkv router`: an OpenAI-compatible front that spreads requests over several
`pagedkv serve` instances, sending each where its prompt's prefix is cached unless that
backend is too busy (see `policies/kv_aware.py` for the score).

    prefix_index.py   which backend holds which chained block hash, on which medium
    prompt.py         a request body -> prompt token ids -> the engine's block hashes
    remote_tokens.py  prompt token ids from a backend's /tokenize (a router without --model)
    kv_events.py      ZMQ subscriber of the backends' KV events (pagedkv.events.wire)
    backend.py        one backend's state: up/down, load scraped from its /metrics, in flight
    health.py         the health-check and load-scrape loop
    policies/         round-robin, least-load, session, kv-aware (one file each)
    router.py         Router: picks a backend, keeps the books (in flight, own record)
    proxy.py          forwarding: model check, timeouts, retries, ejection
    upstream.py       the seam to the backends' HTTP (UpstreamError; httpx for mock transports)
    raw_upstream.py   HTTP/1.1 on asyncio streams + httptools, keep-alive pools (what runs)
    relay.py          a backend's stream to the client, always ending with data: [DONE]
    forward_app.py    the forwarded routes as plain ASGI: key, body, answer, disconnects
    metrics.py        the router's own Prometheus metrics
    pd.py             prefill/decode mode: the prefill hop, then the decode hop (or a fallback)
    pd_wire.py        the hand-off's bodies: vLLM's kv_transfer_params contract
    pd_decode.py      decode-room: a decode instance by load and KV room
    pd_metrics.py     the prefill/decode metrics (hops, fallbacks, prefill latency)
    app.py            the FastAPI app (its other routes) with forward_app.py in front
"""
