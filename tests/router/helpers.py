"""A real `pagedkv router` process in front of real `pagedkv serve` processes."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from tests.server.helpers import ServerProcess


class RouterProcess(ServerProcess):
    """`pagedkv router --backend URL ... --model MODEL_DIR`; `url` is its base URL."""

    def __init__(self, model_dir: Path, backends: list[str], *args: str) -> None:
        super().__init__(model_dir, *args)
        self.backends = backends

    def command(self) -> list[str]:
        flags = [f for url in self.backends for f in ("--backend", url)]
        return [sys.executable, "-m", "pagedkv.cli", "router", *flags, "--model",
                str(self.model_dir), "--port", str(self.port), "--log-level", "warning",
                *self.args]


def router_metric(url: str, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key == f"{name}{{{want}}}":
                return float(value)
    return 0.0
