"""Router: the backends, the prefix index and the policy, and the books kept per request.

`route` snapshots the up backends that serve the request's model and are not ejected, matches
the request's block hashes against the index (within that model, for policies that read
prefixes) and asks the policy. `begin` counts the request in flight on the
chosen backend and records its prompt blocks there (the router's own record, with a TTL: the
engine will cache them once prefilled); the returned `Ticket` undoes the count when the request
ends. `mark_down` drops a backend's prefix entries (a restarted instance has an empty cache);
`eject` keeps a backend that failed a request (no answer in time, a garbled answer) out of
rotation for a while, however healthy its /health says it is: a wedged engine still answers it.
All of it runs on the event loop; nothing here blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from pagedkv.events.wire import MEDIUM_DEVICE
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.router.backend import Backend
from pagedkv.router.decisions import RoutingDecisions
from pagedkv.router.kv_info import read_kv_info
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.policies import Candidate, RouteRequest, RoutingPolicy
from pagedkv.router.policies.kv_aware import KVAwareWeights, new_blocks
from pagedkv.router.prefix_index import PrefixIndex, PrefixMatch
from pagedkv.router.prompt import PromptHasher
from pagedkv.router.token_chains import TokenChains

logger = logging.getLogger("pagedkv.router")

DEFAULT_RECORD_TTL_S = 120.0
DEFAULT_HASH_ALGO = "sha256"  # when the block size is learned from events (any algo would do)
DEFAULT_EJECT_S = 5.0  # the first ejection; each further failure in a row doubles it
MAX_EJECT_S = 120.0


class Ticket:
    """One request in flight on `backend`; `end()` (idempotent) takes it off the books."""

    def __init__(self, router: Router, backend: Backend, queued_blocks: float) -> None:
        self.router = router
        self.backend = backend
        self.queued_blocks = queued_blocks
        self.open = True

    def end(self) -> None:
        if not self.open:
            return
        self.open = False
        self.backend.in_flight -= 1
        self.backend.queued_blocks = max(0.0, self.backend.queued_blocks - self.queued_blocks)
        self.router.metrics.in_flight.labels(self.backend.name).set(self.backend.in_flight)


class Router:
    """Places requests on backends. `hash_settings` is (block_size, hash algorithm) when given
    by flags; otherwise the first backend's /kv_cache_info answer sets it, or else the block
    size of the first KV events (vLLM has no /kv_cache_info). Without `tokenizer` prompts are
    tokenized on a backend (`tokenizer_backend`, remote_tokens.py). A backend with the same
    block size but not the same hashes (another algorithm, or vLLM's own) is matched by the
    token ids of its KV events (`token_chains`)."""

    def __init__(self, backends: Sequence[Backend], policy: RoutingPolicy, *,
                 tokenizer: Tokenizer | None = None,
                 hash_settings: tuple[int, str] | None = None,
                 record_ttl_s: float = DEFAULT_RECORD_TTL_S,
                 shared_media: Collection[str] = ("REDIS",),
                 weights: KVAwareWeights | None = None,
                 eject_s: float = DEFAULT_EJECT_S) -> None:
        if not backends:
            raise ValueError("the router needs at least one --backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate backend URLs in {names}")
        if record_ttl_s <= 0:
            raise ValueError(f"record_ttl_s must be positive, got {record_ttl_s!r}")
        if not eject_s > 0:
            raise ValueError(f"eject_s must be positive, got {eject_s!r}")
        self.eject_s = eject_s
        self.backends = list(backends)
        self.policy = policy
        self.tokenizer = tokenizer
        self.record_ttl_s = record_ttl_s
        self.weights = weights or KVAwareWeights()
        self.index = PrefixIndex(shared_media=shared_media)
        self.metrics = RouterMetrics(policy.name)
        self.decisions = RoutingDecisions()  # recent decisions, for GET /dashboard
        self.hash_settings: tuple[int, str] | None = None
        self.hasher: PromptHasher | None = None  # once the hash settings are known
        self.token_chains: TokenChains | None = None  # likewise
        self.shared_media = frozenset(shared_media)
        self._tokenize_turn = 0
        if hash_settings is not None:
            self._set_hash_settings(*hash_settings)
        for backend in self.backends:
            self.metrics.backend_up.labels(backend.name).set(0)
            self.metrics.in_flight.labels(backend.name).set(0)

    # ---- placing requests ---------------------------------------------------------------

    @property
    def needs_prompt_hashes(self) -> bool:
        """True when requests should be tokenized and hashed before `route`."""
        return self.policy.needs_prefix and self.hasher is not None

    def knows_model(self, model: str | None) -> bool | None:
        """Whether some backend serves `model`: True, False (every backend's models are known
        and none has it: a 404), or None (not every backend's models are known yet)."""
        if model is None or any(b.serves(model) for b in self.backends):
            return True
        return False if all(b.models is not None for b in self.backends) else None

    def route(self, request: RouteRequest, exclude: Collection[str] = (),
              policy: RoutingPolicy | None = None) -> tuple[Backend, Candidate] | None:
        """The backend the policy (`policy`, else the router's) picks among the up, not
        ejected ones that serve the request's model and are not in `exclude` (names), with the
        snapshot it saw; None when there is none."""
        policy = self.policy if policy is None else policy
        now = time.monotonic()
        backends = [b for b in self.backends if b.up and b.name not in exclude
                    and not b.ejected(now) and b.serves(request.model)]
        if not backends:
            return None
        use_prefix = policy.needs_prefix and bool(request.block_hashes)
        window = self.weights.turnover_window_s
        candidates = [b.candidate(self.index.match(b.name, request.block_hashes,
                                                   self.index_model(b, request))
                                  if use_prefix and b.hash_compatible else PrefixMatch(),
                                  b.turnover(now, window))
                      for b in backends]
        chosen = policy.choose(request, candidates)
        self.decisions.record(policy, request, candidates, chosen)
        self.metrics.routed.labels(backends[chosen].name, policy.name).inc()
        return backends[chosen], candidates[chosen]

    def begin(self, backend: Backend, request: RouteRequest, candidate: Candidate) -> Ticket:
        """Count `request` in flight on `backend` and record its prompt blocks there (and the
        blocks it will write, for the backend's turnover)."""
        predicted = max(0.0, new_blocks(request, candidate, self.weights))
        backend.in_flight += 1
        backend.queued_blocks += predicted
        backend.record_written(predicted, time.monotonic(), self.weights.turnover_window_s)
        self.metrics.in_flight.labels(backend.name).set(backend.in_flight)
        if request.block_hashes and backend.hash_compatible:
            self.metrics.prompt_blocks.labels(backend.name).inc(request.prompt_blocks)
            self.metrics.predicted_hit_blocks.labels(backend.name).inc(
                candidate.match.device_blocks)
            self.index.store(backend.name, request.block_hashes, MEDIUM_DEVICE,
                             ttl_s=self.record_ttl_s, model=self.index_model(backend, request))
        return Ticket(self, backend, predicted)

    @staticmethod
    def index_model(backend: Backend, request: RouteRequest) -> str | None:
        """The model whose prefix entries `request` reads and writes on `backend`: the one it
        names, else the one the backend serves."""
        return request.model if request.model is not None else backend.only_model

    # ---- backend state ------------------------------------------------------------------

    def backend(self, name: str) -> Backend:
        """The backend called `name` (ValueError when there is none)."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise ValueError(f"no backend {name!r}; backends: {[b.name for b in self.backends]}")

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take `backend` out of rotation and drop its prefix entries (until it is healthy)."""
        if backend.up:
            logger.warning("backend %s is down: %s", backend.name, reason)
        backend.up = False
        backend.last_error = reason
        backend.kv_info = None
        self.forget_blocks(backend)
        self.metrics.backend_up.labels(backend.name).set(0)

    def eject(self, backend: Backend, reason: str) -> float:
        """Keep `backend` out of rotation after a request it failed (no first byte in time, a
        garbled answer): DEFAULT_EJECT_S, doubled for each further failure in a row, at most
        MAX_EJECT_S. Its prefix entries stay (its cache is intact). Returns the seconds."""
        backend.consecutive_failures += 1
        seconds = min(self.eject_s * 2 ** (backend.consecutive_failures - 1), MAX_EJECT_S)
        backend.ejected_until = time.monotonic() + seconds
        backend.last_error = reason
        self.metrics.ejections.labels(backend.name).inc()
        logger.warning("backend %s ejected for %.0f s: %s", backend.name, seconds, reason)
        return seconds

    def record_success(self, backend: Backend) -> None:
        """`backend` answered a request: its run of failures ends."""
        backend.consecutive_failures = 0

    def set_models(self, backend: Backend, cards: list[Any]) -> None:
        """Apply a backend's /v1/models cards; when its models changed (another model behind
        the same URL), its prefix entries are dropped."""
        old = backend.models
        backend.model_cards = list(cards)
        if old is not None and old != backend.models:
            logger.warning("backend %s now serves %s (was %s)", backend.name,
                           sorted(backend.models or ()), sorted(old))
            self.forget_blocks(backend)

    def mark_up(self, backend: Backend) -> None:
        if not backend.up:
            logger.info("backend %s is up", backend.name)
        backend.up = True
        backend.last_error = None
        self.metrics.backend_up.labels(backend.name).set(1)

    def forget_blocks(self, backend: Backend) -> None:
        """Drop every block the index (and the token-id map) holds for `backend`."""
        self.index.clear(backend.name)
        if self.token_chains is not None:
            self.token_chains.clear(backend.name)

    def set_kv_info(self, backend: Backend, info: object) -> None:
        """Apply a backend's /kv_cache_info answer (None: it has no such route, as vLLM): its
        block size must equal the router's, and prefix caching be on, for its prefixes to
        count; with the router's hash algorithm too its events' hashes are the router's
        (`native_hashes`), else they are matched by their token ids. Its pool size caps the
        router's record of it. An odd answer (kv_info.py) leaves it routable with no prefix
        credit, `kv_problem` saying why. Applied every health round: an answer that changed (a
        backend restarted with other settings, prefix caching turned off) drops its prefix
        entries. Never raises."""
        old = backend.kv_info
        backend.kv_info = info if isinstance(info, dict) else None
        if old is not None and backend.kv_info != old:
            self.forget_blocks(backend)
        if info is None:
            backend.kv_problem = None
            backend.hash_compatible = self.hash_settings is not None
            backend.native_hashes = False
            return
        try:
            parsed = read_kv_info(info)
        except ValueError as exc:
            self.kv_info_unusable(backend, str(exc))
            return
        backend.kv_problem = None
        settings = (parsed.block_size, parsed.hash_algo)
        if self.hash_settings is None:
            self._set_hash_settings(*settings)
        ours = self.hash_settings or settings
        was_compatible = backend.hash_compatible if old is not None else True
        backend.native_hashes = settings == ours
        backend.hash_compatible = settings[0] == ours[0] and parsed.prefix_caching
        if not backend.hash_compatible and was_compatible:
            logger.warning("backend %s has block size %d (router: %d, prefix caching %s); "
                           "its prefixes are not counted", backend.name, settings[0], ours[0],
                           parsed.prefix_caching)
        # Keyed twice when not native: the hashes its events carry, and the router's own.
        cap = parsed.num_gpu_blocks * (1 if backend.native_hashes else 2)
        self.index.set_capacity(backend.name, cap)

    def kv_info_unusable(self, backend: Backend, problem: str) -> None:
        """`backend` answered /kv_cache_info oddly: routable, no prefix credit, its entries
        dropped, the problem logged once (until it changes) and kept for the fleet view."""
        if backend.kv_problem != problem:
            logger.warning("backend %s: %s; routing to it without prefix credit",
                           backend.name, problem)
        backend.kv_problem = problem
        backend.hash_compatible = backend.native_hashes = False
        self.forget_blocks(backend)

    def adopt_block_size(self, block_size: int) -> None:
        """With no hash settings yet (no flags, no /kv_cache_info), take `block_size` from a
        backend's KV events: prompts are then hashed with DEFAULT_HASH_ALGO and matched by
        the events' token ids. Mutates the router's hasher and its backends' compatibility."""
        if self.hash_settings is not None or not isinstance(block_size, int) or block_size <= 0:
            return
        logger.info("block size %d learned from KV events", block_size)
        self._set_hash_settings(block_size, DEFAULT_HASH_ALGO)
        for backend in self.backends:
            if backend.kv_info is None:
                backend.hash_compatible = True

    def token_chains_for(self, backend: Backend) -> TokenChains | None:
        """The token-id map to apply `backend`'s events through; None when its events'
        hashes are the router's own (or no block size is known yet)."""
        return None if backend.native_hashes else self.token_chains

    def _set_hash_settings(self, block_size: int, hash_algo: str) -> None:
        self.hash_settings = (block_size, hash_algo)
        self.hasher = PromptHasher(self.tokenizer, block_size=block_size, hash_algo=hash_algo)
        self.token_chains = TokenChains(block_size, hash_algo, shared_media=self.shared_media)

    def tokenizer_backend(self, model: str | None) -> Backend | None:
        """A backend to tokenize a request for `model` on (when the router has no tokenizer
        of its own): the up, not ejected ones serving it, in turn; None when there is none."""
        now = time.monotonic()
        usable = [b for b in self.backends
                  if b.up and not b.ejected(now) and b.serves(model)]
        if not usable:
            return None
        self._tokenize_turn += 1
        return usable[self._tokenize_turn % len(usable)]
