"""Speculative decoding (n-gram prompt lookup or a draft model, `speculative_config`) against
plain decoding on
the real model (SmolLM2-135M, `python -m pagedkv.testing.real_model`), on a workload where
prompt lookup pays: each prompt quotes a passage and asks for it back, so the answer quotes
its context.

For each batch size (default 1, 8, 32 requests at once, `max_num_seqs` = the batch) both
engines run the same greedy requests once, in alternating order; printed per batch: output
tokens per wall second of each and their ratio (spec / plain), the same per CPU second of this
process (all its threads: steadier than wall time when other processes share the cores), the acceptance rate (accepted / proposed draft
tokens), tokens per target forward (decode tokens a request gains per forward it takes part
in: 1 without speculation), whether the tokens are identical, and the load average. On a
shared machine only the ratios within one run mean anything.

With `--method draft_model` a draft model (`--draft DIR`, default: the target itself, whose
greedy drafts the target always accepts: a check of the machinery, acceptance 1.00) proposes
the `num_speculative_tokens` of `--spec` instead.

    PYTHONPATH=$PWD python benchmarks/bench_spec_decode.py [--batches 1 8 32] [--max-tokens 96]
        [--method draft_model [--draft DIR]]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time

PASSAGE_SOURCES = ("pagedkv.kv.allocation", "pagedkv.kv.manager", "pagedkv.sched.scheduler",
                   "pagedkv.sched.apply", "pagedkv.kv.block_pool", "pagedkv.kv.prefix_cache",
                   "pagedkv.engine.llm", "pagedkv.model.sampler")


def passages(count: int) -> list[str]:
    """`count` short passages of English (paragraphs of this package's docstrings)."""
    import importlib

    paragraphs = []
    for name in PASSAGE_SOURCES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if len(p) > 200]
    return [paragraphs[i % len(paragraphs)][:600] for i in range(count)]


def prompt_of(passage: str) -> str:
    return (f"Here is a passage:\n\n{passage}\n\nCopy the passage above exactly, word for "
            f"word.\n\nPassage:\n")


def run(llm, prompts: list[str], params) -> tuple[float, float, list[list[int]], dict]:  # noqa: ANN001
    """(output tokens per wall second, per CPU second, tokens, spec counters) of one
    generate call."""
    before = llm.llm_engine.get_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = llm.llm_engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    counts = {k: getattr(after, k) - getattr(before, k) for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens")}
    total = sum(len(t) for t in tokens)
    return total / elapsed, total / cpu, tokens, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the SmolLM2 GGUF")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft", default=None, help="draft_model: the draft model's directory "
                        "(default: the target)")
    args = parser.parse_args()

    from pagedkv import LLM, SamplingParams
    from pagedkv.bench.machine import cpu_name
    from pagedkv.testing.real_model import smollm2_gguf_path

    model = args.model or str(smollm2_gguf_path())
    if args.method == "draft_model":
        args.spec = json.dumps({"method": "draft_model", "model": args.draft or model,
                                "num_speculative_tokens":
                                    json.loads(args.spec)["num_speculative_tokens"]})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kw = dict(seed=0, block_size=16, kv_cache_memory_bytes=1 << 30, cpu_kernels="wait",
              max_num_seqs=max(args.batches), enable_prefix_caching=False)
    engines = {"plain": LLM(model=model, **kw),
               "spec": LLM(model=model, speculative_config=json.loads(args.spec), **kw)}
    print(f"{cpu_name()}; {os.path.basename(model)}; speculative_config {args.spec}; "
          f"greedy, max_tokens {args.max_tokens}; load average {os.getloadavg()[0]:.1f}")
    for i, batch in enumerate(args.batches):
        prompts = [prompt_of(p) for p in passages(batch)]
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        result = {name: run(engines[name], prompts, params) for name in order}
        (plain_tps, plain_cpu, plain_tokens, _), (spec_tps, spec_cpu, spec_tokens, counts) = \
            result["plain"], result["spec"]
        generated = sum(len(t) for t in spec_tokens)
        decode = generated - batch  # the first token of each request comes from its prefill
        forwards = decode - counts["spec_decode_num_accepted_tokens"]
        rate = counts["spec_decode_num_accepted_tokens"] / max(
            counts["spec_decode_num_draft_tokens"], 1)
        same = sum(a == b for a, b in zip(plain_tokens, spec_tokens, strict=True))
        print(f"batch {batch:>2}: plain {plain_tps:7.1f} tok/s, spec {spec_tps:7.1f} tok/s, "
              f"ratio {spec_tps / plain_tps:.2f}x; per CPU second {plain_cpu:.1f} / "
              f"{spec_cpu:.1f}, ratio {spec_cpu / plain_cpu:.2f}x; acceptance {rate:.2f} "
              f"({counts['spec_decode_num_accepted_tokens']}/"
              f"{counts['spec_decode_num_draft_tokens']} draft tokens, "
              f"{counts['spec_decode_num_drafts']} drafts); tokens per target forward "
              f"{decode / max(forwards, 1):.2f}; identical {same}/{batch}; "
              f"load {os.getloadavg()[0]:.1f}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
