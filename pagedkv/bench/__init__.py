"""Benchmark clients: `pagedkv bench serve` (an OpenAI-compatible server under load)."""
