"""The grammar backend: xgrammar (vLLM's default), compiling each constraint once per tokenizer.

xgrammar compiles a JSON schema, regex or EBNF grammar against the tokenizer's vocabulary into
a `CompiledGrammar` (the expensive part: a per-token mask precomputation), then hands out cheap
per-request `GrammarMatcher`s. Compiled grammars are kept in a bounded LRU keyed by the
constraint (`StructuredOutputsParams.key`), so a schema is compiled once however many requests
use it. Thread-safe: the server compiles on worker threads (to answer a bad schema with a 400
before queueing), the engine thread then finds the grammar cached.

JSON whitespace is bounded (`any_whitespace=False`: the compact separators only), so even a
random-weight model cannot spend its tokens on spaces and newlines. Compact JSON never holds a
raw control character (U+0000..U+001F), yet xgrammar's rule for a string with `maxLength` lets
them through; JSON grammars therefore also forbid every token whose bytes include one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from pagedkv.structured.grammar import StructuredOutputGrammar
from pagedkv.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256


class XGrammarBackend:
    """Compiles constraints for one tokenizer (`pagedkv.model.tokenizer.Tokenizer`) and a model
    vocabulary of `vocab_size` ids (>= the tokenizer's; padding ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # xgrammar reads the vocabulary and its encoding (byte-level BPE, byte fallback, raw)
        # from a transformers fast tokenizer; ours wraps the same `tokenizers` object.
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            fast, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2,
                                             cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compilations = 0  # cache misses, for tests and stats
        self._no_control_chars: Any = None  # bitmask row, built on first JSON use

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The xgrammar `CompiledGrammar` of `params` (cached). ValueError when xgrammar
        rejects the schema, regex or grammar."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        # Compiled outside the lock, so a long compile on a server thread never stalls the
        # engine thread's cache hits (two threads may compile the same constraint once each).
        try:
            compiled = self._compile(params)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors
            raise ValueError(f"invalid structured_outputs.{params.kind}: {exc}") from exc
        with self._lock:
            self.num_compilations += 1
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

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
