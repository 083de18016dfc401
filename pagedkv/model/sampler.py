"""Sampler: penalties, greedy / temperature / min-p / top-k / top-p sampling, top-N logprobs.

One row of logits per request; a request with `num_samples = n` draws n tokens from its row,
sample i with its own generator. Order (vLLM v1): penalties on the raw logits; greedy rows take
the argmax; other rows divide by the temperature, drop tokens below `min_p * max_prob`, keep the
`top_k` largest, keep the smallest set whose probability reaches `top_p`, and draw from the
renormalised distribution with the exponential-race trick (argmax of p / Exp(1) noise), which
uses exactly one noise vector per sample from that sample's generator.

Seeds: a request with `seed` draws sample i (i = 0..n-1) with a generator seeded `seed + i`,
created on first use and kept until the request finishes, so its tokens do not depend on what
else is in the batch. Sample i >= 1's generator is filed under the id the scheduler gives that
sample's child request (`child_request_id`), so the child continues the same stream; a request
seen without one (e.g. a child whose parent ran elsewhere) starts at `seed + sample_index`.
Unseeded requests share one generator seeded from the runner's seed, so a whole run is
reproducible.

`banned_token_ids` (eos and stop tokens below `min_tokens`) are never sampled, greedy included;
nor are the tokens a structured-output request's grammar forbids (one bitmask for the batch).

Speculative decoding (`verify`): a request verifying k draft tokens has k + 1 rows, each
processed as above (penalties counting the drafts before it as output, the grammar's mask after
them), and emits the run pagedkv/spec/rejection.py accepts, from the request's generator.

Logprobs: log-softmax of the raw model logits, before penalties and temperature (vLLM's default
"raw_logprobs" mode). Each sample reports the top-N tokens plus the sampled token.
"""

from __future__ import annotations

import torch

from pagedkv.sched.output import ScheduledRequest
from pagedkv.sched.request import child_request_id
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.spec.rejection import accept_greedy, accept_sampled
from pagedkv.structured.bitmask import apply_grammar_bitmask
from pagedkv.structured.grammar import StructuredOutputGrammar


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    prompt_ids: list[list[int]], output_ids: list[list[int]]) -> torch.Tensor:
    """Penalised copy of `logits` [R, V] (vLLM semantics): repetition over prompt + output
    (positive logits divided, negative multiplied), frequency and presence over output counts."""
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
           and p.frequency_penalty == 0.0 for p in params):
        return logits
    r, v = logits.shape
    dev = logits.device
    counts = _token_counts(output_ids, v, dev)
    seen = (_token_counts(prompt_ids, v, dev) + counts) > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    return out - freq * counts - pres * (counts > 0).to(out.dtype)


def _token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] float counts of each token id in each row of `ids`."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            padded[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    counts = torch.zeros(len(ids), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab].to(device)


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """Copy of `logits` [R, V] with row r's `banned[r]` token ids at -inf (`logits` when none)."""
    pairs = [(r, t) for r, ids in enumerate(banned) for t in ids if 0 <= t < logits.shape[-1]]
    if not pairs:
        return logits
    rows, cols = zip(*pairs, strict=True)
    out = logits.clone()
    out[list(rows), list(cols)] = float("-inf")
    return out


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Copy of `logits` [R, V] with row r's `biases[r]` (token id -> bias) added; `logits`
    itself when no row has one. Ids beyond the vocabulary are ignored."""
    entries = [(r, t, b) for r, bias in enumerate(biases) if bias
               for t, b in bias.items() if 0 <= t < logits.shape[-1]]
    if not entries:
        return logits
    rows, cols, values = zip(*entries, strict=True)
    out = logits.clone()
    out[list(rows), list(cols)] += torch.tensor(values, dtype=out.dtype, device=out.device)
    return out


def keep_allowed_tokens(logits: torch.Tensor,
                        allowed: list[list[int] | torch.Tensor | None]) -> torch.Tensor:
    """Copy of `logits` [R, V] where row r keeps only `allowed[r]` (None: every token)."""
    if all(a is None for a in allowed):
        return logits
    keep = torch.ones_like(logits, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        if ids is not None:
            index = torch.as_tensor(ids, dtype=torch.long)
            keep[r] = False
            keep[r, index[(index >= 0) & (index < logits.shape[-1])].to(logits.device)] = True
    return logits.masked_fill(~keep, float("-inf"))


def allowed_index(params: SamplingParams) -> torch.Tensor | None:
    """`params.allowed_token_ids` as a tensor, made once per params object (the list is
    sorted and distinct already: SamplingParams reduces it), so a long list costs each step
    one indexing, not a list conversion."""
    ids = params.allowed_token_ids
    if ids is None:
        return None
    cached = params.__dict__.get("_allowed_index")
    if cached is None:
        cached = torch.tensor(ids, dtype=torch.long)
        params.__dict__["_allowed_index"] = cached
    return cached


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf where prob < min_p * max prob (per row; min_p [N], 0 disables)."""
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (ties at the k-th value kept; k >= V disables),
    then the smallest set of the largest whose probability reaches `top_p`; others -> -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = top_k.clamp(1, vocab)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Samples tokens for a batch; holds per-request generators until `forget` is called."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._default = torch.Generator(self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop the generator of a finished request."""
        self._generators.pop(request_id, None)

    def _generator(self, req: ScheduledRequest, i: int) -> torch.Generator:
        """Sample i's generator of `req` (created on first use; mutates the registry)."""
        seed = req.sampling_params.seed
        if seed is None:
            return self._default
        key = req.request_id if i == 0 else child_request_id(req.request_id, i)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(self.device)
            gen.manual_seed(seed + req.sample_index + i)
            self._generators[key] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[ScheduledRequest]
                 ) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """Tokens (and logprobs when asked) for `requests`, row r of `logits` [R, V] being
        request r's. Returns (tokens[r] with num_samples ids, logprobs[r] or None)."""
        if all(_plain_greedy(r) for r in requests):  # fast path: one argmax, no bookkeeping
            return [[t] for t in logits.argmax(-1).tolist()], [None] * len(requests)
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = apply_penalties(logits, params, [r.prompt_token_ids for r in requests],
                                 [r.output_token_ids for r in requests])
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        logits = keep_allowed_tokens(logits, [allowed_index(p) for p in params])
        unbanned = logits
        logits = ban_tokens(logits, [r.banned_token_ids for r in requests])
        logits = apply_grammar_bitmask(logits, [r.grammar for r in requests], unbanned)
        counts = [max(r.num_samples, 1) for r in requests]
        rows = torch.repeat_interleave(torch.arange(len(requests), device=logits.device),
                                       torch.tensor(counts, device=logits.device))
        logits = logits[rows]
        row_params = [p for p, c in zip(params, counts, strict=True) for _ in range(c)]
        tokens = logits.argmax(-1)
        random_rows = [i for i, p in enumerate(row_params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(logits[idx], [row_params[i] for i in random_rows],
                                   [(req, i) for req, c in zip(requests, counts, strict=True)
                                    for i in range(c)], random_rows)
            tokens[idx] = sampled
        token_list = tokens.tolist()
        out_tokens, out_logprobs, start = [], [], 0
        for req, c in zip(requests, counts, strict=True):
            toks = token_list[start:start + c]
            out_tokens.append(toks)
            n = req.sampling_params.logprobs
            if n is None:
                out_logprobs.append(None)
            else:
                out_logprobs.append(_top_logprobs(raw_logprobs[len(out_tokens) - 1], toks, n))
            start += c
        return out_tokens, out_logprobs

    def verify(self, logits: torch.Tensor, requests: list[ScheduledRequest]
               ) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """Verify each request's draft tokens (`spec_token_ids`, k of them) against its k + 1
        rows of `logits` (after its last token and after each draft, requests in turn): the
        run each emits (pagedkv/spec/rejection.py), with logprobs per emitted token when asked.
        The target distribution of row j is the sampler's own (penalties counting drafts
        before j as output, bias, allowed tokens, the grammar's mask after the drafts before
        j, temperature, min-p, top-k, top-p)."""
        counts = [len(r.spec_token_ids) + 1 for r in requests]
        starts = [sum(counts[:i]) for i in range(len(requests))]
        if all(_plain_greedy(r) for r in requests):
            argmax = logits.argmax(-1).tolist()
            return ([accept_greedy(argmax[s:s + c], r.spec_token_ids)
                     for r, s, c in zip(requests, starts, counts, strict=True)],
                    [None] * len(requests))
        rows = [(r, j) for r, c in zip(requests, counts, strict=True) for j in range(c)]
        params = [r.sampling_params for r, _ in rows]
        raw_logprobs = logits.log_softmax(-1) if any(p.logprobs is not None for p in params) \
            else None
        logits = apply_penalties(logits, params, [r.prompt_token_ids for r, _ in rows],
                                 [r.output_token_ids + r.spec_token_ids[:j] for r, j in rows])
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        logits = keep_allowed_tokens(logits, [allowed_index(p) for p in params])
        logits = apply_grammar_bitmask(logits, [g for r in requests for g in _row_grammars(r)])
        argmax = logits.argmax(-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = None
        if random_rows:
            probs = torch.zeros_like(logits)
            idx = torch.tensor(random_rows, device=logits.device)
            probs[idx] = self._probs(logits[idx], [params[i] for i in random_rows])
        out_tokens, out_logprobs = [], []
        for r, s, c in zip(requests, starts, counts, strict=True):
            if r.sampling_params.greedy:
                toks = accept_greedy(argmax[s:s + c], r.spec_token_ids)
            else:
                toks = accept_sampled(probs[s:s + c], r.spec_token_ids, self._generator(r, 0))
            out_tokens.append(toks)
            n = r.sampling_params.logprobs
            out_logprobs.append(None if n is None else [
                _top_logprobs(raw_logprobs[s + i], [t], n)[0] for i, t in enumerate(toks)])
        return out_tokens, out_logprobs

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then min-p, top-k, top-p."""
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
        logits = logits / temp[:, None]
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=dev))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            vocab = logits.shape[-1]
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(-1)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                row_owner: list[tuple[ScheduledRequest, int]], rows: list[int]) -> torch.Tensor:
        probs = self._probs(logits, params)
        noise = torch.empty_like(probs)
        for j, row in enumerate(rows):
            req, i = row_owner[row]
            noise[j].exponential_(generator=self._generator(req, i))
        return (probs / noise).argmax(-1)


def _row_grammars(req: ScheduledRequest) -> list[StructuredOutputGrammar | None]:
    """The grammar state at each verified position of `req`: its own, then forks advanced
    past each draft (the scheduler proposed only drafts its grammar accepts)."""
    drafts = req.spec_token_ids
    if req.grammar is None:
        return [None] * (len(drafts) + 1)
    states = [req.grammar]
    for token_id in drafts:
        state = states[-1].fork()
        state.accept_token(token_id)
        states.append(state)
    return states


def _plain_greedy(req: ScheduledRequest) -> bool:
    """True when `req` takes one argmax of its raw logits: greedy, one sample, no penalties,
    banned tokens or logprobs (the general path gives the same token, with more work)."""
    p = req.sampling_params
    return (p.temperature == 0.0 and req.num_samples <= 1 and p.logprobs is None
            and not req.banned_token_ids and req.grammar is None and p.logit_bias is None
            and p.allowed_token_ids is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


def _top_logprobs(logprobs: torch.Tensor, sampled: list[int], n: int) -> list[dict[int, float]]:
    top = logprobs.topk(n) if n > 0 else None
    base = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else {}
    out = []
    for tok in sampled:
        d = dict(base)
        d[tok] = float(logprobs[tok])
        out.append(d)
    return out


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], n: int) -> list[dict[int, float]]:
    """Per row of `logits` [R, V]: the top-`n` tokens and `target_ids[row]` (the prompt's next
    token) with their log-probabilities (log-softmax of the raw logits, as vLLM reports them)."""
    logprobs = logits.float().log_softmax(-1)
    out = []
    top = logprobs.topk(n) if n > 0 else None
    targets = logprobs.gather(1, torch.tensor(target_ids, device=logits.device)[:, None])
    target_values = targets[:, 0].tolist()
    top_ids = top.indices.tolist() if top is not None else [[] for _ in target_ids]
    top_values = top.values.tolist() if top is not None else [[] for _ in target_ids]
    for ids, values, target, value in zip(top_ids, top_values, target_ids, target_values,
                                          strict=True):
        entry = dict(zip(ids, values, strict=True))
        entry[target] = value
        out.append(entry)
    return out
