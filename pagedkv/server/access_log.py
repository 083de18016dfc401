"""uvicorn's access log with the scrapes at DEBUG: a router or Prometheus polls /health and
/metrics every second, which buried the real requests at INFO.

`quiet_scrapes()` (after uvicorn configured its loggers, i.e. after `uvicorn.Config(...)`)
puts a filter on the "uvicorn.access" logger: a line for a SCRAPE_PATHS route is dropped
unless that logger is enabled for DEBUG, and then goes out labelled DEBUG; every other request
stays at INFO. `pagedkv serve` and `pagedkv router` (with --access-log) install it.
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"

# Health checks, metric scrapes, the router's cache-settings probe and the dashboards' feeds
# (polled or reconnected by the page): no client's work.
SCRAPE_PATHS = frozenset({"/health", "/ping", "/metrics", "/kv_cache_info", "/version",
                          "/dashboard/events", "/dashboard/fleet"})


def request_path(record: logging.LogRecord) -> str | None:
    """The path (no query) of a uvicorn access-log record, whose args are (client, method,
    path with query, HTTP version, status); None for any other record."""
    args = record.args
    if not isinstance(args, tuple) or len(args) != 5 or not isinstance(args[2], str):
        return None
    return args[2].split("?", 1)[0]


class ScrapesAtDebug(logging.Filter):
    """See the module docstring."""

    def filter(self, record: logging.LogRecord) -> bool:
        if request_path(record) not in SCRAPE_PATHS:
            return True
        if not logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def quiet_scrapes() -> None:
    """Install `ScrapesAtDebug` on uvicorn's access logger (once per process)."""
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ScrapesAtDebug) for f in access.filters):
        access.addFilter(ScrapesAtDebug())
