"""The KV-cache memory system: pure Python, no torch."""
