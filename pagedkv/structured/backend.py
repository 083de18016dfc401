"""The grammar backend: xgrammar (vLLM's default), compiling each constraint once per tokenizer.

xgrammar compiles a JSON schema, regex or EBNF grammar against the tokenizer's vocabulary into
a `CompiledGrammar` (the expensive part: a per-token mask precomputation), then hands out cheap
per-request `GrammarMatcher`s. Compiled grammars are kept in a bounded LRU keyed by the
constraint (`StructuredOutputsParams.key`), so a schema is compiled once however many requests
use it. Thread-safe: the server compiles ahead (`compile_async`, to answer a bad schema with a
400 before queueing), the engine thread then finds the grammar cached.

Every compile runs in the backend's own `CompilePool` (never asyncio's default executor), after
the constraint passed its size limits (`StructuredOutputsLimits`), and each waiter waits at most
`compile_timeout_s`; a waiter that leaves (timeout, client gone) releases its claim, so a compile
nobody waits for any more never starts. A grammar that allows no output at all is refused at
compile time ("unsatisfiable"). Error messages carry no grammar-library build paths.

JSON whitespace is bounded (`any_whitespace=False`: the compact separators only), so even a
random-weight model cannot spend its tokens on spaces and newlines. Compact JSON never holds a
raw control character (U+0000..U+001F), yet xgrammar's rule for a string with `maxLength` lets
them through; JSON grammars therefore also forbid every token whose bytes include one.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from pagedkv.structured.compile_pool import CompilePool, Ticket
from pagedkv.structured.errors import clean_grammar_error
from pagedkv.structured.grammar import StructuredOutputGrammar
from pagedkv.structured.limits import CompileTimeoutError, StructuredOutputsLimits
from pagedkv.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256


class XGrammarBackend:
    """Compiles constraints for one tokenizer (`pagedkv.model.tokenizer.Tokenizer`) and a model
    vocabulary of `vocab_size` ids (>= the tokenizer's; padding ids are never allowed), within
    `limits` (default `StructuredOutputsLimits()`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 limits: StructuredOutputsLimits | None = None) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # xgrammar reads the vocabulary and its encoding (byte-level BPE, byte fallback, raw)
        # from a transformers fast tokenizer; ours wraps the same `tokenizers` object.
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            fast, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.limits = limits or StructuredOutputsLimits()
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2,
                                             cache_enabled=False)
        self.pool = CompilePool(self.limits.compile_threads)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compilations = 0  # cache misses, for tests and stats
        self._no_control_chars: Any = None  # bitmask row, built on first JSON use

    def close(self) -> None:
        """Stop the compile pool's idle threads (see CompilePool.close)."""
        self.pool.close()

    def cached(self, params: StructuredOutputsParams) -> Any | None:
        """The compiled grammar of `params` when cached (marks it recently used), else None."""
        with self._lock:
            compiled = self._cache.get(params.key)
            if compiled is not None:
                self._cache.move_to_end(params.key)
            return compiled

    def _submit(self, params: StructuredOutputsParams) -> Ticket:
        self.limits.check(params)
        return self.pool.submit(params.key, lambda: self._compile_and_cache(params),
                                cost=len(params.key[1]))

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """The xgrammar `CompiledGrammar` of `params` (cached), compiled in the pool and
        waited for at most `timeout` s (default `limits.compile_timeout_s`). ValueError when
        the constraint is too large (ConstraintTooLargeError), does not compile in time
        (CompileTimeoutError), or xgrammar rejects it."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        ticket = self._submit(params)
        timeout = self.limits.compile_timeout_s if timeout is None else timeout
        try:
            return ticket.future.result(timeout)
        except FutureTimeoutError:
            raise self._timeout_error(params, timeout) from None
        finally:
            self.pool.release(ticket)

    async def compile_async(self, params: StructuredOutputsParams,
                            timeout: float | None = None) -> Any:
        """`compile` for the event loop: the loop never blocks, and a caller cancelled while
        waiting (its client went away) releases its claim: a compile nobody waits for is
        dropped before it starts."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        ticket = self._submit(params)
        timeout = self.limits.compile_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ticket.future)),
                                          timeout)
        except asyncio.TimeoutError:
            raise self._timeout_error(params, timeout) from None
        finally:
            self.pool.release(ticket)

    def _timeout_error(self, params: StructuredOutputsParams, timeout: float) -> ValueError:
        return CompileTimeoutError(
            f"structured_outputs.{params.kind} did not compile within {timeout:g} s "
            "(structured_outputs_compile_timeout_s, --structured-outputs-compile-timeout-s); "
            "simplify the constraint")

    def _compile_and_cache(self, params: StructuredOutputsParams) -> Any:
        """Runs on a pool thread: compile, refuse an unsatisfiable grammar, cache. A grammar
        already cached is returned as is: a caller that missed the cache just before another
        task for the same constraint finished submits a new task after it (the pool no longer
        knows the finished one), and that task must not compile it again."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compile(params)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors
            raise ValueError(f"invalid structured_outputs.{params.kind}: "
                             f"{clean_grammar_error(exc)}") from None
        self._check_satisfiable(params, compiled)
        with self._lock:
            self.num_compilations += 1
            self._cache[params.key] = compiled
            self._cache.move_to_end(params.key)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _check_satisfiable(self, params: StructuredOutputsParams, compiled: Any) -> None:
        """ValueError when the grammar allows no first token at all (not even its stop
        token): no output can ever satisfy it with this vocabulary."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if params.kind in ("json", "json_object"):
            bitmask[0] &= self._json_token_mask()
        if not bool(bitmask.any()):
            raise ValueError(f"structured_outputs.{params.kind} is unsatisfiable: no output "
                             "can match it (its grammar allows no token at the start)")

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler
        kind = params.kind
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if "::=" in params.grammar:  # EBNF / GBNF, vLLM's usual spelling
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_lark(params.grammar)

    def grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh per-request grammar state for `params` (compiling it on a cache miss)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(params))
        extra = self._json_token_mask() if params.kind in ("json", "json_object") else None
        return StructuredOutputGrammar(matcher, self.vocab_size, extra)

    def _json_token_mask(self) -> Any:
        """Bitmask row (xgrammar's layout: bit i % 32 of word i // 32) allowing every token
        except those whose bytes hold a control character."""
        with self._lock:
            if self._no_control_chars is None:
                import torch

                words = [-1] * ((self.vocab_size + 31) // 32)  # all bits set
                for token_id, raw in enumerate(self.tokenizer_info.decoded_vocab):
                    if any(b < 0x20 for b in raw):
                        words[token_id // 32] &= ~(1 << (token_id % 32))
                self._no_control_chars = torch.tensor(
                    [w - (1 << 32) if w >= (1 << 31) else w for w in (x & 0xFFFFFFFF for x in words)],
                    dtype=torch.int32)
            return self._no_control_chars
