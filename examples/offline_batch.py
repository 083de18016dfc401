"""Offline batch generation: many prompts that share a system prompt, through the paged KV cache.

    python examples/offline_batch.py                   # the bundled SmolLM2 model
    python examples/offline_batch.py --model random    # a tiny random-weight model (gibberish)
    python examples/offline_batch.py --model path/to/model-dir-or.gguf

The shared system prompt is computed once: later requests report it as cached tokens.
"""

from __future__ import annotations

import argparse
import time

from common import resolve_model

from pagedkv import LLM, SamplingParams

SYSTEM = ("You are a concise assistant. Answer in one short sentence, in plain English, without "
          "lists or markdown. If you do not know, say so.\n\n")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "What do bees make?", "How many legs does a spider have?",
             "What is water made of?", "Who wrote Hamlet?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="path, .gguf, HF id, or 'random'")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(model=resolve_model(args.model), max_num_seqs=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([SYSTEM + QUESTIONS[0]], params, use_tqdm=False)  # warms the prefix cache with the system prompt
    start = time.perf_counter()
    outputs = llm.generate([SYSTEM + q for q in QUESTIONS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for question, out in zip(QUESTIONS, outputs, strict=True):
        print(f"{question}\n  -> {out.outputs[0].text.strip()!r} "
              f"({out.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens cached)")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {generated} tokens in {seconds:.2f} s")
    llm.shutdown()


if __name__ == "__main__":
    main()
