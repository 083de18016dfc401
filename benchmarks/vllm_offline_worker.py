"""vLLM's side of `bench_offline.py --vs-vllm PYTHON`: run in that interpreter (a throwaway venv
with vLLM's CPU build; this file never imports pagedkv). It loads the model once, prints READY,
then runs each workload named on stdin (bench_offline.WORKLOADS) and prints `RESULT {json}`.

    PYTHON vllm_offline_worker.py '{"model": DIR, "dtype": "float32", "vocab": 640, ...}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_offline import WORKLOADS, worker_loop  # plain Python: the same requests
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, seed=0,
              block_size=spec["block_size"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=True)

    def run(name: str) -> dict:
        requests = WORKLOADS[name](spec["vocab"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for _, n in requests]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return dict(seconds=elapsed, tokens=[list(o.outputs[0].token_ids) for o in outputs])

    run("warmup")
    worker_loop(run)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
