"""Memory sizes: moved to `pagedkv.config.sizes` (an engine option parses them); the names stay
importable from here."""

from pagedkv.config.sizes import GiB, format_size, parse_size

__all__ = ["GiB", "format_size", "parse_size"]
