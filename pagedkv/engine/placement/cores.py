"""CorePlacer: which of N data-parallel engine cores takes a request, by the router's kv-aware
policy over the front end's own books.

Every request reaches the cores through this one front end, so it knows exactly what each
core has: the requests it placed there and has not seen finish (`in_flight`), the blocks their
prompts still have to prefill (`queued_blocks`: each request's predicted new blocks until its
first token), and which prompt blocks each core computed (the prefix index: every placed
prompt's block hashes are recorded on its core, capped at the core's pool size, least recently
stored dropped first, as the core's own LRU eviction drops them). Each core's running / waiting
counts and KV usage come from its latest step (`update_load`). The policy is the router's
(`kv_aware.py`): prefix hits against load, ties to the less loaded core, then in rotation.

Pure: no engine, no clock of its own (the simulator drives it with its virtual one), so the
real front end (`pagedkv/engine/dp_client.py`) and `pagedkv simulate --data-parallel-size`
place by the very same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.engine.placement.base import Candidate, RouteRequest, RoutingPolicy
from pagedkv.engine.placement.kv_aware import KVAwarePolicy, KVAwareWeights, new_blocks
from pagedkv.engine.placement.prefix_index import PrefixIndex, PrefixMatch


@dataclass(frozen=True)
class CoreLoad:
    """A core's own gauges after its latest step."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass
class _Placed:
    core: int
    queued_blocks: float  # predicted prefill blocks, until the first token


class CorePlacer:
    """Places requests on `num_cores` cores (see the module docstring). `capacity_blocks`:
    each core's device pool size (caps its prefix record); `policy`: kv-aware by default."""

    def __init__(self, num_cores: int, *, capacity_blocks: int | None = None,
                 policy: RoutingPolicy | None = None,
                 weights: KVAwareWeights | None = None) -> None:
        if num_cores < 1:
            raise ValueError(f"num_cores must be >= 1, got {num_cores!r}")
        self.num_cores = num_cores
        self.weights = weights or KVAwareWeights()
        self.policy = policy or KVAwarePolicy(self.weights)
        self.index = PrefixIndex(shared_media=())
        for core in range(num_cores):
            self.index.set_capacity(str(core), capacity_blocks)
        self.loads = [CoreLoad()] * num_cores
        self.in_flight = [0] * num_cores
        self.queued_blocks = [0.0] * num_cores
        self.placed = [0] * num_cores  # requests placed on each core so far
        self._books: dict[str, _Placed] = {}

    def candidates(self, block_hashes: Sequence[bytes]) -> list[Candidate]:
        """Each core as the policy sees it for a prompt of these block hashes."""
        return [Candidate(name=str(core), in_flight=self.in_flight[core],
                          queued_blocks=self.queued_blocks[core],
                          running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
                          match=(self.index.match(str(core), block_hashes) if block_hashes
                                 else PrefixMatch()))
                for core, load in enumerate(self.loads)]

    def choose(self, prompt_tokens: int, block_hashes: Sequence[bytes]) -> int:
        """The core the policy picks for this prompt (nothing is booked)."""
        request = RouteRequest(prompt_tokens=prompt_tokens, block_hashes=tuple(block_hashes))
        return self.policy.choose(request, self.candidates(block_hashes))

    def place(self, request_id: str, prompt_tokens: int,
              block_hashes: Sequence[bytes]) -> int:
        """Choose a core for the request and book it there (its prompt blocks recorded on it);
        ValueError for an id already in flight."""
        if request_id in self._books:
            raise ValueError(f"request id {request_id!r} is already placed")
        hashes = tuple(block_hashes)
        request = RouteRequest(prompt_tokens=prompt_tokens, block_hashes=hashes)
        candidates = self.candidates(hashes)
        core = self.policy.choose(request, candidates)
        predicted = max(0.0, new_blocks(request, candidates[core], self.weights))
        self._books[request_id] = _Placed(core, predicted)
        self.in_flight[core] += 1
        self.queued_blocks[core] += predicted
        self.placed[core] += 1
        if hashes:
            self.index.store(str(core), hashes)
        return core

    def core_of(self, request_id: str) -> int | None:
        """The core a request in flight was placed on (None: unknown or finished)."""
        placed = self._books.get(request_id)
        return None if placed is None else placed.core

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its prefill is no longer queued work."""
        placed = self._books.get(request_id)
        if placed is not None and placed.queued_blocks:
            self.queued_blocks[placed.core] = max(
                0.0, self.queued_blocks[placed.core] - placed.queued_blocks)
            placed.queued_blocks = 0.0

    def finished(self, request_id: str) -> None:
        """Take the request off the books (idempotent)."""
        self.prefilled(request_id)
        placed = self._books.pop(request_id, None)
        if placed is not None:
            self.in_flight[placed.core] -= 1

    def update_load(self, core: int, load: CoreLoad) -> None:
        self.loads[core] = load

    def holder(self, block_hashes: Sequence[bytes]) -> int | None:
        """The core whose record holds the longest leading run of these blocks (None: none
        holds the first)."""
        best, best_run = None, 0
        for core in range(self.num_cores):
            run = self.index.match(str(core), block_hashes).device_blocks
            if run > best_run:
                best, best_run = core, run
        return best
