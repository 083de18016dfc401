"""The tiered KV store: KV blocks kept by chained prefix hash outside the device pool.

`connector.py` is the engine's seam (vLLM's KVConnectorBase_V1 split: scheduler side and worker
side); `tiered.py` chains the tiers; each tier is one file (`host.py`, `disk.py`,
`redis_tier.py`) behind the `KVTier` interface of `tier.py`; `codec.py` is the stored value's
header and checksum; `identity.py` is the model part of every key. `config.py` is what a
store is built from (`StoreConfig`, plain data every tensor-parallel rank gets), `factory.py`
builds it and the connector's two sides, and `interfaces.py` says what the store needs of a
request, a step, a KV cache and a rank group (Protocols: the store imports only `kv/`,
`events/` and `config/`).
"""
