"""Subcommands of the `pagedkv` CLI, one module each."""
