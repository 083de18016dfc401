"""A request's structured-output constraint, from any of its three spellings: OpenAI's
`response_format`, vLLM's `structured_outputs`, and vLLM's older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`. More than one is a 400; so is a schema,
regex or grammar that the grammar engine rejects, is beyond the size limits or does not compile
in time (compiled here, in the grammar backend's own pool, so the engine later finds it in its
cache; a client that leaves while its compile is still queued costs no compile)."""

from __future__ import annotations

import asyncio
from typing import Any

from pagedkv.http.errors import APIError
from pagedkv.http.protocol import SamplingFields
from pagedkv.structured.params import StructuredOutputsParams


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError("response_format of type json_schema needs json_schema.schema",
                       param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def _from_structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                   grammar=so.grammar, json_object=so.json_object)


def _from_guided(req: SamplingFields) -> StructuredOutputsParams | None:
    fields = dict(json=req.guided_json, regex=req.guided_regex, choice=req.guided_choice,
                  grammar=req.guided_grammar)
    if all(v is None for v in fields.values()):
        return None
    return StructuredOutputsParams(**fields)


_SOURCES = (("response_format", _from_response_format),
            ("structured_outputs", _from_structured_outputs),
            ("guided_json", _from_guided))


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint (None without one); APIError 400 when it is malformed or
    given in more than one way."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    for param, build in _SOURCES:
        try:
            so = build(req)
        except ValueError as exc:
            raise APIError(str(exc), param=param) from exc
        if so is not None:
            found.append((param, so))
    if len(found) > 1:
        raise APIError("give one structured-output constraint, got "
                       f"{' and '.join(p for p, _ in found)}", param=found[1][0])
    return found[0][1] if found else None


async def compile_constraint(engine: Any, so: StructuredOutputsParams | None,
                             param: str = "structured_outputs") -> None:
    """Compile `so` with the engine's grammar backend (its own pool, cached there); APIError
    400 when the constraint is too large, does not compile within the timeout, or the grammar
    engine rejects it. Cancelling the caller releases its claim on the compile."""
    if so is None:
        return
    try:
        backend = engine.built_structured_output_backend
        if backend is None:  # built once, off the loop (importing xgrammar is slow)
            backend = await asyncio.to_thread(lambda: engine.structured_output_backend)
        await backend.compile_async(so)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc
