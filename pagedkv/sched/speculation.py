"""The scheduler's side of speculative decoding (`speculative_config`).

After a step changes a request's tokens, the proposer (pagedkv/spec) proposes up to k draft
tokens to follow them (`propose_drafts`). When the request next decodes, it is scheduled with
its next token and the drafts (1 + k tokens), the KV manager making room for the drafts'
lookahead slots (`allocate_slots(..., num_lookahead_tokens=k)`); when they do not fit (the
step's budget, the cache) it decodes one token as usual: speculation never preempts. The
runner verifies the drafts in that one forward pass and returns the run it emits (the accepted
drafts and the target's own next token); `apply_verified` keeps the KV of the accepted
positions only: `num_computed_tokens` counts them, the blocks past the new length are given
back, and only blocks full of accepted tokens are ever cached (their hashes come from the
request's tokens, which never hold a rejected draft). A run is cut at the first token that
ends the request (eos, a stop token, max_tokens, max_model_len).

A structured-output request's drafts are cut at the first token its grammar refuses (or
after the one that completes it); the runner masks every verified position with the grammar
state after the drafts before it, and the grammar advances per accepted token as the run is
appended. Requests not speculated (they decode one token a step): bad words and requests
below `min_tokens` (their per-position bans would depend on the drafts), beam-search beams
(their group picks every token from the step's logprobs), and any request while its outputs
are within one token of `max_tokens` or `max_model_len`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.sched.request import Request, RequestStatus
from pagedkv.spec import Proposer, RequestProposer, build_proposer, parse_speculative_config
from pagedkv.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from pagedkv.kv.interface import KVCacheManagerAPI
    from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
    from pagedkv.structured.grammar import StructuredOutputGrammar


def grammar_prefix(grammar: StructuredOutputGrammar, drafts: list[int]) -> list[int]:
    """The leading drafts `grammar` accepts, up to the one that completes it (on a fork: the
    request's own state is unchanged)."""
    state = grammar.fork()
    for i, token_id in enumerate(drafts):
        if not state.accept_token(token_id):
            return drafts[:i]
        if state.is_terminated():
            return drafts[:i + 1]
    return drafts


class SpeculationMixin:
    """What the Scheduler does for speculative decoding (see the module docstring)."""

    kv_cache_manager: KVCacheManagerAPI
    proposer: Proposer | RequestProposer | None
    spec_stats: SpecDecodeStats | None

    def _init_speculation(self, speculative_config: str | dict | None,
                          proposer: RequestProposer | None = None) -> None:
        """`proposer`: the engine-built one (a draft model), else built from the config."""
        spec = parse_speculative_config(speculative_config)
        if spec is not None and proposer is None:
            proposer = build_proposer(spec)
        self.proposer = proposer if spec is not None else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None

    def _max_drafts(self, request: Request) -> int:
        """How many draft tokens `request` may verify now: 0 with bad words, below min_tokens or
        for a beam, and never past max_tokens or max_model_len (the run adds one token more)."""
        params = request.sampling_params
        if request.bad_words_token_ids or request.num_output_tokens < params.min_tokens or \
                params.use_beam_search:
            return 0
        room = self.config.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return room

    def propose_drafts(self, requests: list[Request]) -> None:
        """Propose the draft tokens of the running requests among `requests` (those whose
        tokens just changed); a request ended or not eligible gets none."""
        proposer = self.proposer
        rooms = [self._max_drafts(r) if r.status == RequestStatus.RUNNING else 0
                 for r in requests]
        if isinstance(proposer, RequestProposer):
            asked = [(r, room) for r, room in zip(requests, rooms, strict=True) if room > 0]
            found = iter(proposer.propose_batch([(r.request_id, r.all_token_ids, room)
                                                 for r, room in asked]) if asked else [])
            proposals = [next(found) if room > 0 else [] for room in rooms]
        else:
            proposals = [proposer.propose(r.all_token_ids, room) if room > 0 else []
                         for r, room in zip(requests, rooms, strict=True)]
        for request, drafts in zip(requests, proposals, strict=True):
            if drafts and request.structured_output is not None:
                drafts = grammar_prefix(request.structured_output, drafts)
            request.spec_token_ids = drafts

    def forget_drafts(self, request: Request) -> None:
        """Drop the proposer's state for `request` (a draft model's KV blocks): it ended or
        was preempted."""
        if isinstance(self.proposer, RequestProposer):
            self.proposer.forget(request.request_id)

    def _schedule_speculative(self, request: Request, budget: int,
                              out: SchedulerOutput) -> int:
        """Schedule a decoding `request` with its draft tokens when they fit the budget and
        the cache: the tokens it takes (0: not scheduled, nothing changed)."""
        drafts = request.spec_token_ids[:min(budget, self._step_cap) - 1]
        if not drafts:
            return 0
        if self.kv_cache_manager.allocate_slots(request, 1, delay_cache_blocks=True,
                                                num_lookahead_tokens=len(drafts)) is None:
            return 0
        self._schedule(request, 1, out, drafts)
        return 1 + len(drafts)

    def apply_verified(self, request: Request, scheduled: ScheduledRequest,
                       tokens: list[int], logprobs: list[dict[int, float]] | None) -> None:
        """Apply a verifying step's emitted run `tokens` (accepted drafts, then the target's
        token): keep the accepted positions' KV, give back the rest, append the run up to
        the first token that ends the request, cache the full blocks, then finish it if so."""
        kv = self.kv_cache_manager
        request.num_tokens_ahead -= len(scheduled.token_ids)
        request.num_placeholders -= 1
        num_drafts = len(scheduled.spec_token_ids)
        self.spec_stats.observe(num_drafts, len(tokens) - 1)
        kept = 0
        for i, token_id in enumerate(tokens):
            self._append_token(request, token_id, logprobs[i] if logprobs else None)
            kept += 1
            if self._stop_status(request) is not None:
                break
        # Inputs were the last token and the drafts: the first `kept` of them are now valid.
        request.num_computed_tokens += kept
        kv.trim_blocks(request, request.num_tokens)
        if kv.enable_caching:
            kv.cache_blocks(request, request.num_computed_tokens)
        self._check_stop(request)
