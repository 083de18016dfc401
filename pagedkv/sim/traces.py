"""Request traces for the simulator: Mooncake JSONL, Azure LLM inference CSVs, pagedkv's own
request log (`pagedkv serve --request-log`), each read into one list of `TraceRequest`.

A trace holds no text: arrival times, lengths and (Mooncake, the request log) prefix-block ids.
`prompt_token_ids` turns a request's block ids into deterministic token runs, so pagedkv's own
chained hashing sees the same sharing as the trace: two requests with the same leading block
ids get the same leading tokens. Each id becomes `block_tokens` tokens (Mooncake: 512, scaled by
`scale_lengths`); the last block holds what the input length leaves.

Readers are looked up by format name in `TRACE_READERS` (a new format is a new function there);
`load_trace` sniffs the format from the file when none is given.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pagedkv.jsonl import jsonl_rows, numbered_lines, parse_json_line

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
# Each block's run starts with its id as base-`vocab` digits (unique ids => unique runs).
_ID_DIGITS = 4


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: `arrival` in seconds from the trace's start, token counts, and the
    ids of its prompt's blocks of `block_tokens` tokens (empty: no sharing is known)."""

    arrival: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    session: str | None = None

    def __post_init__(self) -> None:
        if self.session is not None and not isinstance(self.session, str):
            raise ValueError(f"session_id must be a string, got {self.session!r}")
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, (int, float)) \
                or not math.isfinite(self.arrival):
            raise ValueError(f"arrival must be a finite number of seconds, got {self.arrival!r}")
        for name, least in (("input_length", 0), ("output_length", 1), ("block_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


# What a malformed field of a row raises (OverflowError: float() of a 400-digit integer).
ROW_ERRORS = (KeyError, TypeError, ValueError, OverflowError)


def _integer(value: object, name: str) -> int:
    """A row's whole number: an int, an integral finite float or a decimal string."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r}"[:200])


def _output_length(value: object) -> int:
    """A trace row's output length: 0 (a request that produced nothing, e.g. aborted) is one
    token, as the engine's max_tokens is at least one; below 0 is an error."""
    n = _integer(value, "output length")
    if n < 0:
        raise ValueError(f"output length must be >= 0, got {value!r}")
    return max(n, 1)


def _block_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"hash_ids must be a list of integers, got {value!r}"[:200])
    return tuple(_integer(h, "a hash id") for h in value)


def _run(block_id: int, length: int, vocab_size: int, filler: list[int]) -> list[int]:
    """`length` tokens for block `block_id`: its id's digits, then a fixed filler."""
    digits = []
    value = block_id + 1  # never all zeros: block 0 differs from an unshared run
    for _ in range(_ID_DIGITS):
        digits.append(value % vocab_size)
        value //= vocab_size
    if length <= _ID_DIGITS:
        return digits[:length]
    return digits + filler[_ID_DIGITS:length]


def prompt_token_ids(request: TraceRequest, vocab_size: int, unique_id: int) -> list[int]:
    """Deterministic prompt tokens for `request` (all ids < `vocab_size`). Blocks with the same
    id get the same tokens; tokens past the known blocks (or all, without block ids) form a run
    unique to `unique_id` (the request's index), so they share nothing."""
    if vocab_size < 16:
        raise ValueError(f"vocab_size must be at least 16, got {vocab_size}")
    size = request.block_tokens
    filler = [(7 * j + 3) % vocab_size for j in range(max(size, 1))]
    tokens: list[int] = []
    remaining = request.input_length
    for block_id in request.block_ids:
        if remaining <= 0:
            break
        n = min(size, remaining)
        tokens += _run(block_id, n, vocab_size, filler)
        remaining -= n
    if remaining > 0:  # unshared tail: seeded by the request, never by a block id
        tail_filler = [(11 * j + 5) % vocab_size for j in range(remaining)]
        tokens += _run(-(unique_id + 2) % (vocab_size ** _ID_DIGITS), remaining, vocab_size,
                       tail_filler)
    return tokens


# ---- readers ------------------------------------------------------------------------------

def read_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake FAST'25 JSONL: timestamp (ms), input_length, output_length, hash_ids."""
    out = []
    for line_no, row in jsonl_rows(path):
        try:
            out.append(TraceRequest(
                arrival=float(row["timestamp"]) / 1000.0,
                input_length=_integer(row["input_length"], "input_length"),
                output_length=_output_length(row["output_length"]),
                block_ids=_block_ids(row.get("hash_ids", [])),
                session=row.get("session_id")))
        except ROW_ERRORS as exc:
            raise ValueError(f"{path}:{line_no}: not a Mooncake trace row: {exc}") from None
    return out


def _azure_time(text: object) -> float:
    if not isinstance(text, str):
        raise ValueError(f"TIMESTAMP is missing, got {text!r}")
    date, _, frac = text.strip().partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def read_azure(path: str | Path) -> list[TraceRequest]:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens (no prefixes).
    A field longer than csv's limit (131,072 characters) is a malformed row."""
    out = []
    line_no = 0  # the last line csv read (a quoted field may span lines)

    def lines() -> Iterator[str]:
        nonlocal line_no
        for line_no, line in numbered_lines(path):  # noqa: B007 (read by the handlers)
            yield line

    reader = csv.DictReader(lines())
    start = None
    try:
        for row in reader:
            try:
                t = _azure_time(row["TIMESTAMP"])
                start = t if start is None else start
                out.append(TraceRequest(
                    arrival=t - start,
                    input_length=_integer(row["ContextTokens"], "ContextTokens"),
                    output_length=_output_length(row["GeneratedTokens"])))
            except ROW_ERRORS as exc:
                raise ValueError(f"{path}:{line_no}: not an Azure trace row: {exc}") from None
    except csv.Error as exc:
        raise ValueError(f"{path}:{line_no}: not an Azure trace row: {exc}") from None
    return out


def read_request_log(path: str | Path) -> list[TraceRequest]:
    """pagedkv's request log (`pagedkv serve --request-log`): arrival (s), prompt_tokens,
    output_tokens, block_size, prefix_block_hashes (hex). Hashes become small ids in order of
    first appearance: chained hashes, so equal ids mean an equal prefix."""
    ids: dict[str, int] = {}
    out = []
    for line_no, row in jsonl_rows(path):
        try:
            hashes = row.get("prefix_block_hashes", [])
            if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
                raise ValueError(f"prefix_block_hashes must be a list of hex strings, got "
                                 f"{hashes!r}")
            for h in hashes:
                try:
                    bytes.fromhex(h)
                except ValueError:
                    raise ValueError(f"prefix block hash {h!r} is not hex") from None
            block_ids = tuple(ids.setdefault(h, len(ids)) for h in hashes)
            out.append(TraceRequest(
                arrival=float(row["arrival"]),
                input_length=_integer(row["prompt_tokens"], "prompt_tokens"),
                output_length=_output_length(row["output_tokens"]), block_ids=block_ids,
                block_tokens=_integer(row.get("block_size", 16), "block_size")))
        except ROW_ERRORS as exc:
            raise ValueError(f"{path}:{line_no}: not a pagedkv request-log row: {exc}") from None
    if out:
        start = min(r.arrival for r in out)
        out = sorted((_shift(r, start) for r in out), key=lambda r: r.arrival)
    return out


def _shift(request: TraceRequest, start: float) -> TraceRequest:
    return TraceRequest(request.arrival - start, request.input_length, request.output_length,
                        request.block_ids, request.block_tokens, request.session)


TRACE_READERS: dict[str, Callable[[str | Path], list[TraceRequest]]] = {
    "mooncake": read_mooncake,
    "azure": read_azure,
    "request-log": read_request_log,
}


def sniff_format(path: str | Path) -> str:
    """The format of a trace file from its first line; ValueError when none fits."""
    first = next((line.strip() for _, line in numbered_lines(path)), "")
    if first.startswith("TIMESTAMP") or "ContextTokens" in first:
        return "azure"
    if first.startswith("{"):
        row = parse_json_line(path, 1, first)
        if not isinstance(row, dict):
            raise ValueError(f"{path}:1: not a JSON object")
        if "hash_ids" in row or "input_length" in row:
            return "mooncake"
        if "prompt_tokens" in row:
            return "request-log"
    raise ValueError(f"cannot tell the trace format of {str(path)!r}; give --trace-format "
                     f"({', '.join(TRACE_READERS)})")


def scale_trace(requests: list[TraceRequest], *, scale_lengths: float = 1.0,
                time_scale: float = 1.0) -> list[TraceRequest]:
    """Lengths times `scale_lengths` (block runs too, so sharing keeps its shape; at least one
    token each) and arrival times times `time_scale` (0.5: twice the rate)."""
    for name, value in (("scale_lengths", scale_lengths), ("time_scale", time_scale)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if scale_lengths == 1.0 and time_scale == 1.0:
        return requests
    out = []
    for r in requests:
        block = max(1, round(r.block_tokens * scale_lengths))
        out.append(TraceRequest(
            arrival=r.arrival * time_scale,
            input_length=max(1, round(r.input_length * scale_lengths)),
            output_length=max(1, round(r.output_length * scale_lengths)),
            block_ids=r.block_ids, block_tokens=block, session=r.session))
    return out


def load_trace(path: str | Path, trace_format: str | None = None, *, scale_lengths: float = 1.0,
               time_scale: float = 1.0, limit: int | None = None,
               start: int = 0) -> list[TraceRequest]:
    """Read a trace (format sniffed when None), take rows [start, start + limit), rebase the
    arrivals to 0, and scale it. Sorted by arrival."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of requests, got {limit!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a request index >= 0, got {start!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    trace_format = trace_format or sniff_format(path)
    reader = TRACE_READERS.get(trace_format)
    if reader is None:
        raise ValueError(f"unknown trace format {trace_format!r}; choose one of "
                         f"{list(TRACE_READERS)}")
    requests = sorted(reader(path), key=lambda r: r.arrival)
    if start or limit is not None:
        requests = requests[start:None if limit is None else start + limit]
    if requests and requests[0].arrival:
        requests = [_shift(r, requests[0].arrival) for r in requests]
    return scale_trace(requests, scale_lengths=scale_lengths, time_scale=time_scale)


