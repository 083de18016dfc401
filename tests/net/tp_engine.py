"""Node 0 of a two-host tensor-parallel engine, run inside a namespace host by the tests.

`python -m tests.net.tp_engine MODEL MASTER_ADDR MASTER_PORT TIMEOUT_S PROMPT_JSON MAX_TOKENS
[BACKEND]` (BACKEND: mp, the default, or ray: then MASTER_PORT 0 lets the executor pick) prints one JSON line {"up_s", "tokens"} once the engine (rank 0 here, rank 1 on the other
host) answered the greedy prompt, then waits for a line on stdin; after it, generates until
the engine fails and prints {"fail_s", "error", "kind"}: how long from then to the error.
"""

from __future__ import annotations

import json
import sys
import time

from pagedkv import LLM, SamplingParams
from pagedkv.config.errors import EngineFatalError


def main(model: str, master_addr: str, port: str, timeout_s: str, prompt: str,
         max_tokens: str, backend: str = "mp") -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    request = {"prompt_token_ids": json.loads(prompt)}
    start = time.monotonic()
    llm = LLM(model=model, tensor_parallel_size=2, nnodes=2, master_addr=master_addr,
              master_port=int(port) or None, distributed_executor_backend=backend,
              distributed_timeout_s=float(timeout_s), block_size=4,
              cpu_kernels="off", dtype="float32", kv_cache_memory_bytes=1 << 20)
    out = llm.generate(request, greedy, use_tqdm=False)[0]
    runner = llm.llm_engine.runner
    nodes = runner.node_ips() if hasattr(runner, "node_ips") else None
    print(json.dumps({"up_s": time.monotonic() - start, "tokens": out.outputs[0].token_ids,
                      "nodes": nodes}), flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    result = {"error": None, "kind": None}
    try:
        for _ in range(10_000):
            llm.generate(request, greedy, use_tqdm=False)
    except EngineFatalError as exc:
        result = {"error": str(exc), "kind": type(exc).__name__}
    print(json.dumps({"fail_s": time.monotonic() - start, **result}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
