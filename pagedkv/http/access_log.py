"""uvicorn's logging for `pagedkv serve` and `pagedkv router`: pagedkv's line format (time,
level, logger) on uvicorn's lines too, and the scrapes at DEBUG in its access log: a router or
Prometheus polls /health and /metrics every second, which buried the real requests at INFO.

`uvicorn_log_config()` is the `log_config` to give `uvicorn.Config`. Its access logger carries
`ScrapesAtDebug`: a line for a SCRAPE_PATHS route is dropped unless that logger is enabled for
DEBUG (`--log-level debug`), and then goes out labelled DEBUG; every other request stays at
INFO.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

ACCESS_LOGGER = "uvicorn.access"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ACCESS_FORMAT = '%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" ' \
    "%(status_code)s"

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


class ShownAs(logging.Filter):
    """Shows a logger's records under another name (uvicorn logs its start and stop lines as
    "uvicorn.error", which reads like an error)."""

    def __init__(self, shown_name: str) -> None:
        super().__init__()
        self.shown_name = shown_name

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = self.shown_name
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's default logging config with LOG_FORMAT's fields (no colours),
    `ScrapesAtDebug` on its access logger and its "uvicorn.error" lines shown as "uvicorn"."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"].update(fmt=LOG_FORMAT, use_colors=False)
    config["formatters"]["access"].update(fmt=_ACCESS_FORMAT, use_colors=False)
    config["filters"] = {"scrapes": {"()": ScrapesAtDebug},
                         "shown_as_uvicorn": {"()": ShownAs, "shown_name": "uvicorn"}}
    config["loggers"][ACCESS_LOGGER]["filters"] = ["scrapes"]
    config["loggers"]["uvicorn.error"]["filters"] = ["shown_as_uvicorn"]
    return config
