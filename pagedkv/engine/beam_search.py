"""BeamSearchSequence and BeamSearchOutput: what `LLM.beam_search` returns (vLLM's shapes,
`vllm/beam_search.py`), made from the engine's finished beam-search `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.outputs import RequestOutput
from pagedkv.sched.beam import beam_score


@dataclass
class BeamSearchSequence:
    """One returned beam: `tokens` are the prompt's and the output's; `logprobs` has one table
    per output token (the candidates it was chosen among); `cum_logprob` sums the chosen
    tokens' logprobs and `score` is `cum_logprob / output length ** length_penalty` (the length
    counts an ending eos token, as transformers does). `text` is the output's text."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0


@dataclass
class BeamSearchOutput:
    """One prompt's beams, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_output(output: RequestOutput, length_penalty: float) -> BeamSearchOutput:
    """The beams of a finished beam-search request (its samples, best first). ValueError with
    the engine's message for a request that failed."""
    if output.error is not None:
        raise ValueError(output.error)
    sequences = []
    for comp in output.outputs:
        tokens = list(comp.token_ids)
        cum = comp.cumulative_logprob or 0.0
        sequences.append(BeamSearchSequence(
            tokens=[*output.prompt_token_ids, *tokens], logprobs=list(comp.logprobs or []),
            cum_logprob=cum, score=beam_score(cum, len(tokens), length_penalty),
            text=comp.text, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
            num_output_tokens=len(tokens)))
    return BeamSearchOutput(sequences)
