"""KV-cache events on the wire: vLLM's `KVEventBatch` format, shared by publisher and router."""
