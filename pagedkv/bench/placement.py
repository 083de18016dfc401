"""Per-request records of a routed run: which backend served each request, what was queued on
it and on the other backends when it arrived, and what its TTFT was; and a summary that tells
contention (other backends' prefills slow this one down: they share cores) from placement (work
queued ahead on its own backend).

The inputs are the client's results (`RequestResult`, with the response id and send time) and
each backend's `pagedkv serve --request-log` rows. A row is joined to a result by the engine's
request id (`<response id>-<prompt index>`). Times in a record are seconds; `arrival` is from
the first request's arrival at any backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedkv.bench.metrics import RequestResult, percentile


@dataclass
class RequestRecord:
    """One request, as one backend served it, and the load it met there and elsewhere.

    `queued_here` / `queued_tokens_here`: the backend's other requests that had arrived and not
    yet produced their first token when this one arrived, and their prompt tokens still to
    compute (prompt - cached); `running_here`: its other unfinished requests; `queued_elsewhere`
    / `queued_tokens_elsewhere`: the same over the other backends (concurrent prefills)."""

    index: int
    backend: int
    arrival: float
    prompt_tokens: int
    cached_tokens: int
    ttft_client: float | None
    ttft_server: float
    queue_time: float | None
    running_here: int = 0
    queued_here: int = 0
    queued_tokens_here: int = 0
    queued_elsewhere: int = 0
    queued_tokens_elsewhere: int = 0

    @property
    def new_tokens(self) -> int:
        """Prompt tokens this request had to compute (not found in the cache)."""
        return self.prompt_tokens - self.cached_tokens


def read_request_log(path: str | Path) -> list[dict]:
    """The rows of one backend's request log (none when it wrote no file)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def join_records(results: Sequence[RequestResult],
                 logs: Sequence[Sequence[dict]]) -> list[RequestRecord]:
    """One record per request some backend logged (`logs[b]`: backend b's rows), in arrival
    order, with the load each met (see RequestRecord). Pure: mutates nothing."""
    by_id = {r.response_id: i for i, r in enumerate(results) if r.response_id}
    rows = [(b, row) for b, log in enumerate(logs) for row in log if row.get("ttft") is not None]
    if not rows:
        return []
    t0 = min(row["arrival"] for _, row in rows)
    records = []
    for b, row in rows:
        index = by_id.get(row["request_id"].rsplit("-", 1)[0], -1)
        records.append(RequestRecord(
            index=index, backend=b, arrival=row["arrival"] - t0,
            prompt_tokens=row["prompt_tokens"], cached_tokens=row["cached_tokens"],
            ttft_client=results[index].ttft if index >= 0 else None, ttft_server=row["ttft"],
            queue_time=row.get("queue_time")))
    spans = [(rec, rec.arrival + row["ttft"], rec.arrival + row["e2e"])
             for rec, (_, row) in zip(records, rows, strict=True)]
    for rec in records:
        _count_load(rec, spans)
    return sorted(records, key=lambda r: r.arrival)


def _count_load(rec: RequestRecord, spans: list[tuple[RequestRecord, float, float]]) -> None:
    """Fill `rec`'s load fields from every request's (record, first token, end) times."""
    t = rec.arrival
    for other, first_token, end in spans:
        if other is rec or not other.arrival <= t < end:
            continue
        prefilling = t < first_token
        if other.backend == rec.backend:
            rec.running_here += 1
            rec.queued_here += prefilling
            rec.queued_tokens_here += other.new_tokens if prefilling else 0
        elif prefilling:
            rec.queued_elsewhere += 1
            rec.queued_tokens_elsewhere += other.new_tokens


def write_records(path: str | Path, records: Sequence[RequestRecord]) -> None:
    """One JSON line per record (overwrites `path`)."""
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))


def _stats(records: Sequence[RequestRecord]) -> str:
    if not records:
        return "n=0"
    ttft = [r.ttft_server * 1000 for r in records]
    new = sum(r.new_tokens for r in records) / len(records)
    return (f"n={len(records)} TTFT mean {sum(ttft) / len(ttft):.0f} p99 "
            f"{percentile(ttft, 99):.0f} ms, new tokens {new:.0f}")


def summarize(records: Sequence[RequestRecord], num_backends: int) -> list[str]:
    """Lines that tell contention from placement (server-side TTFT; see the module docstring):
    per backend; the slowest 5% against all; requests with nothing queued on their own backend,
    with and without prefills elsewhere (contention); and with work queued ahead (placement)."""
    if not records:
        return ["no request-log records"]
    lines = [f"  backend {b}: {_stats([r for r in records if r.backend == b])}"
             for b in range(num_backends)]
    slow = sorted(records, key=lambda r: r.ttft_server)[-max(1, len(records) // 20):]
    for name, group in (("all", records), ("slowest 5%", slow)):
        n = len(group)
        lines.append(
            f"  {name}: {_stats(group)}; at arrival: here {sum(r.queued_here for r in group) / n:.2f}"
            f" queued ({sum(r.queued_tokens_here for r in group) / n:.0f} tokens), "
            f"{sum(r.running_here for r in group) / n:.2f} running; elsewhere "
            f"{sum(r.queued_elsewhere for r in group) / n:.2f} prefilling "
            f"({sum(r.queued_tokens_elsewhere for r in group) / n:.0f} tokens)")
    idle_here = [r for r in records if r.queued_here == 0]
    lines.append("  nothing queued here, nothing prefilling elsewhere: "
                 + _stats([r for r in idle_here if r.queued_elsewhere == 0]))
    lines.append("  nothing queued here, prefills elsewhere (contention): "
                 + _stats([r for r in idle_here if r.queued_elsewhere > 0]))
    lines.append("  work queued here (placement): "
                 + _stats([r for r in records if r.queued_here > 0]))
    client = [r.ttft_client - r.ttft_server for r in records if r.ttft_client is not None]
    if client:
        lines.append(f"  client TTFT - server TTFT (router + transport): mean "
                     f"{1000 * sum(client) / len(client):.1f} ms, p99 "
                     f"{1000 * percentile(client, 99):.1f} ms")
    return lines
