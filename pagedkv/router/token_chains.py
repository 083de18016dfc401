"""A backend's KV events in the router's own hash space, by their token ids.

A backend whose block hashes are not the router's (a vLLM server: its own hash function and
seed; a pagedkv server with another hash algorithm) publishes hashes no prompt hashed by the
router will ever equal. Its `BlockStored` events also carry the blocks' token ids and block size
(vLLM's do), so the router re-hashes them: the key of each block is `hash_block_tokens` of its
parent's key and its tokens, exactly the chain `PromptHasher` computes for a prompt, and a prompt
is then matched by its tokens. Keys stay chained: a block gets a key only when its parent has
one (the start of a prompt, or a block of this backend already keyed), so a block matches only
if every block before it matched.

Per backend the map remembers each foreign hash's key and the media holding it, so a
`BlockRemoved` (hashes only) or a tier's `BlockStored` without tokens (vLLM's offloading
connector sends none) is translated too. Blocks the router cannot re-hash get no key (and stop
their chain): another block size, a LoRA adapter, extra keys other than a first block's
`cache_salt` (multimodal inputs, prompt embeddings), token ids that do not fill the blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pagedkv.events.wire import MEDIUM_DEVICE, BlockRemoved, BlockStored, ExternalBlockHash
from pagedkv.kv.hashing import BlockHash, get_hash_fn, hash_block_tokens

DEFAULT_MAX_BLOCKS = 1 << 19  # per backend (some 200 MiB): past it the oldest mappings go


@dataclass
class _Mapped:
    """The router's key of one foreign block hash, and the media that hold the block."""

    key: BlockHash
    media: set[str] = field(default_factory=set)


class _Unplaceable(Exception):
    """A block whose key the router cannot compute."""


class _UnknownParent:
    """The parent of a chain the router has no key for (its blocks get none either)."""


UNKNOWN_PARENT = _UnknownParent()


def _block_extra_keys(event: BlockStored, i: int) -> tuple | None:
    """Block `i`'s extra keys in the router's form (raises _Unplaceable for any but a first
    block's cache_salt). vLLM publishes them untagged: a lone string in a request's first
    block is its cache_salt."""
    keys = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
    if not keys:
        return None
    first = event.parent_block_hash is None and i == 0
    if first and len(keys) == 1 and isinstance(keys[0], str):
        return (("salt", keys[0]),)
    raise _Unplaceable


class TokenChains:
    """Foreign block hash -> the router's key, per backend, for one block size and hash
    algorithm (the router's). Not thread-safe: the router's event loop owns it."""

    def __init__(self, block_size: int, hash_algo: str, *, shared_media: Collection[str] = (),
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size!r}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks!r}")
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)
        self.shared_media = frozenset(shared_media)
        self.max_blocks = max_blocks
        self._maps: dict[str, OrderedDict[ExternalBlockHash, _Mapped]] = {}

    def num_blocks(self, backend: str) -> int:
        """Foreign hashes of `backend` mapped to a key."""
        return len(self._maps.get(backend, ()))

    def stored(self, backend: str, event: BlockStored) -> list[BlockHash]:
        """The router's keys of the leading blocks of `event` it can place, in order (stops
        at the first it cannot). Mutates `backend`'s map: each placed block's foreign hash
        is mapped to its key, with the event's medium."""
        mapping = self._maps.setdefault(backend, OrderedDict())
        medium = event.medium or MEDIUM_DEVICE
        parent = self._parent_key(mapping, event.parent_block_hash)
        keys: list[BlockHash] = []
        for i, foreign in enumerate(event.block_hashes):
            mapped = mapping.get(foreign)
            if mapped is None:
                key = self._block_key(event, i, parent)
                if key is None:
                    break
                mapped = mapping[foreign] = _Mapped(key)
            mapped.media.add(medium)
            keys.append(mapped.key)
            parent = mapped.key
        while len(mapping) > self.max_blocks:
            mapping.popitem(last=False)
        return keys

    def removed(self, backend: str, event: BlockRemoved) -> list[BlockHash]:
        """The router's keys of the blocks `event` removes from its medium. Mutates
        `backend`'s map: a foreign hash no medium holds any more is forgotten."""
        mapping = self._maps.get(backend, {})
        medium = event.medium or MEDIUM_DEVICE
        keys = []
        for foreign in event.block_hashes:
            mapped = mapping.get(foreign)
            if mapped is None:
                continue
            keys.append(mapped.key)
            mapped.media.discard(medium)
            if not mapped.media:
                del mapping[foreign]
        return keys

    def clear(self, backend: str) -> None:
        """Forget `backend`'s blocks on its own media (all its blocks were dropped, or it
        restarted); blocks on a shared tier stay mapped until that tier removes them."""
        mapping = self._maps.get(backend, {})
        for foreign in list(mapping):
            mapped = mapping[foreign]
            mapped.media &= self.shared_media
            if not mapped.media:
                del mapping[foreign]

    @staticmethod
    def _parent_key(mapping: dict[ExternalBlockHash, _Mapped],
                    parent: ExternalBlockHash | None) -> BlockHash | None | _UnknownParent:
        if parent is None:
            return None  # hash_block_tokens' root
        mapped = mapping.get(parent)
        return UNKNOWN_PARENT if mapped is None else mapped.key

    def _block_key(self, event: BlockStored, i: int,
                   parent: BlockHash | None | _UnknownParent) -> BlockHash | None:
        """Block `i`'s key chained to `parent`; None when it cannot be computed."""
        bs = self.block_size
        if (isinstance(parent, _UnknownParent) or event.block_size != bs
                or event.lora_name is not None
                or len(event.token_ids) != bs * len(event.block_hashes)):
            return None
        tokens: Sequence[int] = event.token_ids[i * bs:(i + 1) * bs]
        try:
            return hash_block_tokens(self.hash_fn, parent, tokens, _block_extra_keys(event, i))
        except (_Unplaceable, ValueError):  # ValueError: a token id past int64, an odd key
            return None
