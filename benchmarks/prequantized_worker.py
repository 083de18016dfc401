"""One engine's side of `bench_prequantized.py`, run in that engine's interpreter: pagedkv (this
tree) or vLLM (`PYTHON` of a throwaway venv with vLLM's CPU build: this file then never imports
pagedkv). Loads the model once, runs the workloads and prints `RESULT {json}`.

    PYTHON prequantized_worker.py '{"engine": "vllm", "model": DIR, "threads": 2, ...}'

Workloads (greedy, ignore_eos, token ids in, the same ids for both engines):
- decode: one prompt of 32 tokens, `decode_tokens` output tokens, timed against the same prompt
  with one output token: decode tokens a second at batch 1 (the prefill taken out);
- batch: `batch_prompts` prompts of `batch_prompt_len` tokens, `batch_tokens` output tokens
  each, submitted at once: output tokens a second.
"""

from __future__ import annotations

import json
import random
import sys
import time


def requests(spec: dict, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, spec["vocab"]) for _ in range(length)] for _ in range(count)]


def make_engine(spec: dict):
    """(generate(prompts, max_tokens) -> token lists) for spec's engine."""
    if spec["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, seed=0,
                  block_size=32, max_num_batched_tokens=2048, max_model_len=2048)

        def generate(prompts, max_tokens):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                    detokenize=False)
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in out]
        return generate
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, block_size=32,
              cpu_threads=spec["threads"], cpu_kernels="wait", max_num_batched_tokens=2048,
              max_model_len=2048)

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]
    return generate


def timed(generate, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = generate(prompts, max_tokens)
    return time.perf_counter() - start, tokens


def main() -> None:
    spec = json.loads(sys.argv[1])
    generate = make_engine(spec)
    one = requests(spec, 1, 32, seed=1)
    batch = requests(spec, spec["batch_prompts"], spec["batch_prompt_len"], seed=2)
    generate(one, 8)  # warm-up: the kernels' first calls, the measured routes
    generate(batch[:4], 4)
    prefill = min(timed(generate, one, 1)[0] for _ in range(3))
    decode_s, decode_tokens = timed(generate, one, spec["decode_tokens"])
    batch_s, batch_tokens = timed(generate, batch, spec["batch_tokens"])
    result = {"decode_tok_s": (spec["decode_tokens"] - 1) / (decode_s - prefill),
              "batch_tok_s": spec["batch_prompts"] * spec["batch_tokens"] / batch_s,
              "decode_tokens": decode_tokens[0], "batch_tokens": batch_tokens}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
