"""LLM: vLLM's offline entry point (`LLM(model=...).generate(prompts, sampling_params)`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_search import BeamSearchOutput, beam_search_output
from pagedkv.engine.llm_engine import LLMEngine, PromptType
from pagedkv.engine.outputs import RequestOutput
from pagedkv.kv.pins import PinInfo
from pagedkv.sched.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """Offline batched generation. Keyword arguments are `EngineArgs` fields (vLLM's names)."""

    def __init__(self, model: str, *, core_process: bool = False, **kwargs: Any) -> None:
        """`core_process=True` runs the engine core in a child process (as `pagedkv serve`
        does); the default keeps it in this one."""
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), core_process=core_process)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Free the engine's KV cache, CUDA graphs and weights (device memory goes back to the
        driver); later `generate` calls raise RuntimeError. Idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in input order.

        `prompts`: a string, a `{"prompt_token_ids": [...]}` dict, or a list of those (a flat list
        of ints is one tokenized prompt). `sampling_params`: one for all, or one per prompt.
        A prompt (or `n`) that can never fit in the KV cache, or any other bad value, raises
        ValueError before anything runs (nothing is left queued). A request whose model step
        failed comes back finished with `finish_reason == "error"` and `error` set, while the
        others complete.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        if engine.is_shut_down:
            raise RuntimeError("this LLM was shut down")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params,
                                   priority=0 if priority is None else priority[i])
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, `params.beam_width` beams, best first. The
        beams run in the engine as one request each (pagedkv/sched/beam.py): they share their
        common KV blocks, so W beams hold far fewer blocks than W separate sequences."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm)
        return [beam_search_output(o, params.length_penalty) for o in outputs]

    def pin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Pin `prompt`'s full blocks in the device prefix cache (never evicted until
        `unpin_prefix`), first running it (one generated token) when they are not all cached.
        ValueError as for `LLMEngine.pin_prefix` (nothing stays pinned then)."""
        engine = self.llm_engine
        if not engine.is_prefix_cached(prompt, cache_salt):
            request_id = f"pin-{next(self._counter)}"
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=1),
                               cache_salt=cache_salt)
            try:
                self._run([request_id], use_tqdm=False)
            except BaseException:
                engine.abort_request(request_id)
                raise
        return engine.pin_prefix(prompt, cache_salt)

    def unpin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Release `prompt`'s pin (`LLMEngine.unpin_prefix`)."""
        return self.llm_engine.unpin_prefix(prompt, cache_salt)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`, a Jinja template, as vLLM's
        argument) to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(chat_template)
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds any BOS token; don't add a second one.
        token_prompts = [{"prompt": p, "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)}
                         for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        generated = 0
        seen: dict[str, int] = {}
        while pending:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
            for output in engine.step():
                if output.request_id not in pending:
                    continue
                count = sum(c.num_tokens for c in output.outputs)
                generated += count - seen.get(output.request_id, 0)
                seen[output.request_id] = count
                if output.finished:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s", refresh=False)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]
