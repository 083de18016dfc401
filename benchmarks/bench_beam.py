"""Beam search on the paged cache: blocks held by W beams against W separate sequences, and
time against transformers' beam search, on the real model (SmolLM2-135M, Q4_1 GGUF).

    PYTHONPATH=$PWD python benchmarks/bench_beam.py [--widths 2,4,8] [--prompt-len 128]
        [--max-tokens 64] [--block-size 16] [--no-transformers]

Blocks: for each width W, one `LLM.beam_search` of W beams, stepped by hand, and the most
KV blocks held at once between steps; then W separate greedy sequences of the same prompt
length and output length (distinct prompts, so nothing is shared; `ignore_eos`), measured the
same way. Beams share the prompt's blocks and their common prefix by reference count and copy
only the block they diverge in, so they hold far fewer.

Time: the same search (`num_beams=W`, `max_new_tokens`, greedy) by transformers'
`generate` (float32, eager attention, the GGUF's weights dequantized) against pagedkv's, wall
time each, one run after an untimed warm-up of each; beam tokens/s = W * max_tokens / seconds (both run the same number of
beam steps unless a search stops early, which the table says). Prints whether the best beams
agree (quantized weights: pagedkv may keep them quantized, so they can differ late).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path


def held_blocks(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]]
                ) -> tuple[int, dict]:
    """Run `requests` stepping by hand; the most blocks held at once and the finished outputs."""
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    held, finished = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        held = max(held, kv.num_usable_blocks - kv.num_free_blocks)
    return held, finished


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def blocks_table(llm: LLM, widths: list[int], prompt_len: int, max_tokens: int) -> None:
    vocab = llm.llm_engine.vocab_size
    print(f"{'W':>3} {'beams':>7} {'separate':>9} {'ratio':>6}")
    for width in widths:
        prompts = prompts_of(width + 1, prompt_len, vocab, seed=width)
        beam = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        beams_held, _ = held_blocks(llm, [("beam", prompts[0], beam.sampling_params())])
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        separate_held, _ = held_blocks(llm, [(f"s{i}", p, greedy)
                                             for i, p in enumerate(prompts[1:])])
        print(f"{width:>3} {beams_held:>7} {separate_held:>9} "
              f"{beams_held / separate_held:>6.2f}")


def time_table(llm: LLM, path, widths: list[int], prompt_len: int,  # noqa: ANN001
               max_tokens: int) -> None:
    from pagedkv.testing.hf_reference import transformers_model

    hf = transformers_model(path)
    vocab = llm.llm_engine.vocab_size
    warm = prompts_of(1, prompt_len, vocab, seed=1)[0]  # first calls build caches: untimed
    llm.beam_search([{"prompt_token_ids": warm}], BeamSearchParams(beam_width=2, max_tokens=2))
    with torch.no_grad():
        hf.generate(torch.tensor([warm]), num_beams=2, do_sample=False, max_new_tokens=2,
                    attention_mask=torch.ones(1, len(warm), dtype=torch.long))
    print(f"{'W':>3} {'pagedkv s':>10} {'hf s':>8} {'pagedkv tok/s':>14} {'hf tok/s':>9} "
          f"{'speedup':>8} {'best beam equal':>16}")
    for width in widths:
        prompt = prompts_of(1, prompt_len, vocab, seed=100 + width)[0]
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        start = time.perf_counter()
        ours = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), num_beams=width, num_return_sequences=1,
                do_sample=False, max_new_tokens=max_tokens)
        hf_s = time.perf_counter() - start
        equal = ours.sequences[0].tokens == theirs[0].tolist()[:len(ours.sequences[0].tokens)]
        tokens = width * max_tokens
        print(f"{width:>3} {ours_s:>10.2f} {hf_s:>8.2f} {tokens / ours_s:>14.1f} "
              f"{tokens / hf_s:>9.1f} {hf_s / ours_s:>8.2f} {str(equal):>16}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="2,4,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit(f"the real model is not installed: {INSTALL}")
    widths = [int(w) for w in args.widths.split(",")]
    print(f"model {path.name}; cpu {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    llm = LLM(str(path), dtype="float32", block_size=args.block_size, seed=0,
              max_model_len=args.prompt_len + args.max_tokens + 16,
              kv_cache_memory_bytes=256 << 20)
    print(f"\nKV blocks held at most (block size {args.block_size}, prompt {args.prompt_len}, "
          f"{args.max_tokens} tokens each)")
    blocks_table(llm, widths, args.prompt_len, args.max_tokens)
    if not args.no_transformers:
        print(f"\nBeam search time (prompt {args.prompt_len}, {args.max_tokens} new tokens)")
        time_table(llm, path, widths, args.prompt_len, args.max_tokens)
    llm.shutdown()


if __name__ == "__main__":
    main()
