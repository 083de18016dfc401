"""Benchmark code that ships with the package: `pagedkv bench serve` (a server under load).

The one home for importable benchmark code is here; `benchmarks/` at the repository root holds
only runnable scripts (each compares against a baseline in the same run and prints a ratio),
and the random-weight model they build lives in `pagedkv.testing`.
"""
