"""`kv_transfer_params` in the server: prefill/decode disaggregation as vLLM's PD proxy drives it.

Producer (a request with `do_remote_decode: true`, `max_tokens` 1): once the prefill finished,
the engine hands the prompt's full blocks to the transport (`KVTransfer.start_handoff`: written
through to the shared tier, or pushed to the consumer; with tensor parallelism, each rank its
own KV heads' slice, and the answer waits, while the engine steps on, until every rank's
saved-through watermark covers the request's blocks) and the answer carries, as its top-level
`kv_transfer_params`, vLLM's keys (`do_remote_prefill: true`, `remote_engine_id`,
`remote_host`/`remote_port`: this engine's `kv_ip`/`kv_port`, `tp_size`) and pagedkv's:
`transport` ("store" or "push"), `block_hashes` (hex, the prompt's blocks transferred, leading
ones), `num_tokens` (the tokens they hold), `num_blocks` (the blocks sent: with KV cache groups,
every group's), `model_identity`, `kv_format`, `block_size`,
`cache_salt`, `transfer_bytes` (every rank's), `transfer_seconds` (the slowest rank's) and
`durable` (every rank's saves were written before its transfer: false only when a rank's
saves outlasted `transfer_timeout_s`; the counts above are what was transferred regardless).
The answer waits at most `transfer_timeout_s` + HANDOFF_MARGIN_S for the handoff (each rank's
job ends within `transfer_timeout_s` of its start, a push begun at that deadline within a grace
of it: store/transfer_rank.py): a router's prefill timeout above the prefill's own time plus
that never gives up on a handoff that completes. Past it the answer names no block (the decode
recomputes the prompt) and the job is abandoned.

Consumer (a request with `do_remote_prefill: true`, the producer's params copied in): the
params are checked against this engine (model identity, KV format, block size, salt, and the
block hashes against the prompt's own); on a mismatch the request is served by computing its
prompt (a warning says why); so is a `tp_size` other than this engine's (a block holds one
tensor-parallel rank's KV heads under that rank's keys, so only an engine of the same size reads
them; both of size N, each consumer rank loads its own rank's blocks: with the push transport,
producer rank r pushes to the consumer's `remote_port + r`, where consumer rank r listens). Otherwise, with the push transport, the request waits (at most
`transfer_timeout_s`) for the pushed blocks to arrive, then runs: the store's lookup loads the
blocks that arrived intact and the rest is computed. Either way the tokens are the ones a
single instance gives. Params of the wrong types are a 400 (protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pagedkv.http.errors import APIError
from pagedkv.http.protocol import KVTransferParams
from pagedkv.store.transfer import HashablePrompt
from pagedkv.store.transfer_config import KVTransferConfig, parse_kv_transfer_config

if TYPE_CHECKING:
    from pagedkv.server.serving import OpenAIServing

logger = logging.getLogger("pagedkv.server")

POLL_S = 0.002
HANDOFF_MARGIN_S = 2.0  # past transfer_timeout_s: a rank's push grace, the core's polls


def transfer_config(serving: OpenAIServing) -> KVTransferConfig | None:
    """The engine's parsed `kv_transfer_config`, or None (parsed once per server)."""
    if not hasattr(serving, "_kv_transfer_config"):
        serving._kv_transfer_config = parse_kv_transfer_config(
            serving.engine.engine.args.kv_transfer_config)
    return serving._kv_transfer_config


def check_params(params: KVTransferParams | None, num_prompts: int, stream: bool) -> None:
    """400 for params a request cannot carry: more than one prompt; a streamed prefill."""
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return
    if num_prompts != 1:
        raise APIError("kv_transfer_params takes a request of one prompt",
                       param="kv_transfer_params")
    if params.do_remote_decode and stream:
        raise APIError("a prefill for a remote decode (kv_transfer_params.do_remote_decode) "
                       "cannot stream", param="stream")


async def _describe(serving: OpenAIServing) -> dict:
    cached = getattr(serving, "_kv_transfer_description", None)
    if cached is None:
        cached = await serving.engine.call_utility("kv_transfer.describe")
        serving._kv_transfer_description = cached
    return cached


async def handoff(serving: OpenAIServing, params: KVTransferParams | None,
                  prompt: list[int], cache_salt: str | None) -> dict | None:
    """After a prefill for a remote decode: the answer's `kv_transfer_params` (None when the
    request asked for none or this engine is no producer)."""
    if params is None or not params.do_remote_decode:
        return None
    config = transfer_config(serving)
    if config is None or not config.is_producer:
        logger.warning("kv_transfer_params.do_remote_decode on an engine that is no kv "
                       "producer (kv_transfer_config): answered without transfer params")
        return None
    engine = serving.engine
    desc = await _describe(serving)
    job = await engine.call_utility("kv_transfer.start_handoff", list(prompt), cache_salt,
                                    params.remote_host, params.remote_port)
    deadline = time.monotonic() + config.transfer_timeout_s + HANDOFF_MARGIN_S
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        outcome = await engine.call_utility("kv_transfer.poll_handoff", job)
        if outcome is None:
            await asyncio.sleep(POLL_S)
    if outcome is None:
        logger.warning("kv transfer: the handoff did not finish in time; the decode recomputes")
        await engine.call_utility("kv_transfer.abandon_handoff", job)
        outcome = {"block_hashes": [], "num_tokens": 0, "transfer_bytes": 0,
                   "transfer_seconds": 0.0}
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": desc["engine_id"], "remote_block_ids": None,
            "remote_host": desc["kv_ip"], "remote_port": desc["kv_port"],
            "tp_size": serving.engine.engine.args.tensor_parallel_size,
            "transport": "push" if config.is_push else "store",
            "model_identity": desc["model_identity"], "kv_format": desc["kv_format"],
            "block_size": desc["block_size"], "cache_salt": cache_salt, **outcome}


def mismatch(params: KVTransferParams, desc: dict, own_hashes: list[str],
             cache_salt: str | None, push: bool, tp_size: int = 1) -> str | None:
    """Why `params` cannot serve this request on this engine of `tp_size` ranks (None: they
    can). A block of a tensor-parallel producer holds one rank's KV heads under that rank's
    keys: only a consumer of the same size reads them (`tp_size` absent: the identity decides)."""
    if params.tp_size is not None and params.tp_size != tp_size:
        return (f"tp_size {params.tp_size!r} is not this engine's {tp_size!r} (a transferred "
                f"block holds one tensor-parallel rank's KV heads: producer and consumer need "
                f"the same tensor_parallel_size)")
    checks = (("model identity", params.model_identity, desc["model_identity"]),
              ("KV format", params.kv_format, desc["kv_format"]),
              ("block size", params.block_size, desc["block_size"]),
              ("cache salt", params.cache_salt, cache_salt),
              ("transport", params.transport, "push" if push else "store"))
    for what, theirs, ours in checks:
        if theirs != ours:
            return f"{what} {theirs!r} is not this engine's {ours!r}"
    hashes = params.block_hashes or []
    if len(hashes) > len(own_hashes) or hashes != own_hashes[:len(hashes)]:
        return "block_hashes are not the prompt's"
    if params.num_tokens != len(hashes) * desc["block_size"]:
        return f"num_tokens {params.num_tokens!r} does not match {len(hashes)} blocks"
    most = len(hashes) * desc.get("num_groups", 1)
    if params.num_blocks is not None and params.num_blocks > most:
        return (f"num_blocks {params.num_blocks!r} is more than {len(hashes)} block hashes "
                f"name (at most {most})")
    return None


async def receive(serving: OpenAIServing, params: KVTransferParams | None,
                  prompt: list[int], cache_salt: str | None) -> dict | None:
    """Before a decode whose prefill ran elsewhere: check the params and, for the push
    transport, wait (bounded) for the blocks. (blocks named, blocks held, seconds waited), or
    None when the request carries no remote prefill."""
    if params is None or not params.do_remote_prefill:
        return None
    config = transfer_config(serving)
    if config is None or not config.is_consumer:
        logger.warning("kv_transfer_params.do_remote_prefill on an engine that is no kv "
                       "consumer (kv_transfer_config): the prompt is computed here")
        return None
    desc = await _describe(serving)
    hasher = serving.engine.engine.block_hasher()
    own = [h.hex() for h in hasher(HashablePrompt(list(prompt), cache_salt), [])]
    why = mismatch(params, desc, own, cache_salt, config.is_push,
                   serving.engine.engine.args.tensor_parallel_size)
    if why is not None:
        logger.warning("kv transfer: kv_transfer_params do not fit this request (%s); its "
                       "prompt is computed here", why)
        return {"blocks": 0, "held": 0, "wait_seconds": 0.0, "mismatch": why}
    num_hashes = len(params.block_hashes or [])
    wanted = num_hashes if params.num_blocks is None else params.num_blocks
    start = time.monotonic()
    held = await _wait_for_blocks(serving, prompt, cache_salt, num_hashes, wanted,
                                  start + config.transfer_timeout_s)
    waited = time.monotonic() - start
    if held < wanted:
        logger.warning("kv transfer: %d of %d pushed blocks arrived within %.1f s; the rest "
                       "is computed here", held, wanted, config.transfer_timeout_s)
    return {"blocks": wanted, "held": held, "wait_seconds": round(waited, 6)}


async def _wait_for_blocks(serving: OpenAIServing, prompt: list[int], cache_salt: str | None,
                           num_hashes: int, wanted: int, deadline: float) -> int:
    """Blocks held once all `wanted` arrived or at `deadline`, whichever is first."""
    while True:
        held = await serving.engine.call_utility("kv_transfer.held_blocks", list(prompt),
                                                 cache_salt, num_hashes, wanted)
        if held >= wanted or time.monotonic() >= deadline:
            return held
        await asyncio.sleep(POLL_S)

