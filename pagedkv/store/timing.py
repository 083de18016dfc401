"""The KV store connector's timing constants (torch-free: `pagedkv simulate` reads them too)."""

DEFAULT_LOAD_TIMEOUT_S = 10.0
# An idle step waits at most this long for a load, so the engine loop still takes new requests
# and aborts while a slow load runs.
IDLE_WAIT_S = 0.05
