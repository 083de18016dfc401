"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's request fields): `n`
beams (the beam width; all `n` come back as the choices, best first), `length_penalty`,
`early_stopping`. The beams run in the engine (pagedkv/sched/beam.py); vLLM does not stream
beam search, nor does this server (400)."""

from __future__ import annotations

from dataclasses import replace

from pagedkv.http.errors import APIError
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.server.serving import OpenAIServing
from pagedkv.structured.params import StructuredOutputsParams


def beam_search_params(serving: OpenAIServing, req, *, max_tokens: int,  # noqa: ANN001
                       logprobs: int | None,
                       structured_outputs: StructuredOutputsParams | None = None
                       ) -> SamplingParams:
    """The SamplingParams of a `use_beam_search` request; APIError (400) for a stream or a
    field beam search cannot honour (echo, stop strings, min_tokens, prompt logprobs, a
    structured output)."""
    if req.stream:
        raise APIError("use_beam_search cannot be combined with stream: the beams are returned "
                       "when the search ends", param="stream")
    if getattr(req, "echo", False):
        raise APIError("use_beam_search cannot be combined with echo", param="echo")
    # `n` > 1 with greedy sampling is refused for sampling, not for beams: build it with n=1.
    base = serving.sampling_params(req.model_copy(update={"n": 1, "temperature": 0.0}),
                                   max_tokens=max_tokens, logprobs=logprobs,
                                   structured_outputs=structured_outputs)
    try:
        return replace(base, n=req.n, use_beam_search=True, length_penalty=req.length_penalty,
                       early_stopping=req.early_stopping)
    except ValueError as exc:
        raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
