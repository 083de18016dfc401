"""KV cache groups and sub-block prefix hits (issue 24), two measurements:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_groups.py [--part memory|chat|all]
        [--rounds 2] [--json]

1. memory: a small random Gemma 3 (6 layers: 5 sliding over 256 tokens, 1 full; hidden 256,
   4 heads, 2 KV heads of 64, float32) under a fixed 48 MiB KV budget, 16 requests with
   1,500-2,000-token prompts and 16 output tokens (ignore_eos): KV cache groups (the default)
   against the all-full layout (`disable_hybrid_kv_cache_manager`), alternating, `--rounds`
   each. Prints the most sequences running at once, output tokens/s and wall time, and the
   ratios of the medians. Built with transformers (a test dependency).
2. chat: a multi-turn chat workload on a small random Llama (`--chat-model llama`, default),
   or part 1's Gemma 3 (`--chat-model gemma3`: KV cache groups, where a sub-block hit needs a
   partial block in every group). `--workload trace` (default): the first 8 conversations of 4 turns in Mooncake's
   conversation trace (`--trace`, the shared traces folder; a request continues an earlier one when
   that one's full 512-token blocks lead its block ids), lengths scaled by 1/16: the first
   prompt's tokens follow its block ids (the system prompt's block is shared by all), each turn
   answers the trace's output length (ignore_eos) and the next prompt = prompt + answer + a
   question as long as the trace's input grew beyond them. `--workload synthetic`: 8 x 4 turns,
   first prompts 100-300 tokens, questions 20-80, answers 32-64. Turn k of every conversation
   is submitted together once turn k-1 finished. For block sizes 16, 32, 128: prefix-hit tokens
   and mean time to first token without and with `prefix_match_unit=1`, against an ideal
   token-granular cache (a prompt's longest common prefix with any sequence an earlier turn
   computed: its prompt and answer but the last answer token); TTFT over turns 2-4 (median of
   `--rounds` runs, alternating with and without) and its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.datasets import shared_trace
from pagedkv.bench.machine import cpu_name
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sim.traces import prompt_token_ids, read_mooncake, scale_trace
from pagedkv.testing.random_model import (
    build_random_model_dir,
    build_tokenizer_files,
    hf_config_dict,
    tokenizer_vocab_size,
)


def build_gemma3(model_dir: Path) -> Path:
    """The random Gemma 3 of part 1 (transformers initialises and saves it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (model_dir / "config.json").exists():
        return model_dir
    build_tokenizer_files(model_dir)
    cfg = hf_config_dict("gemma3_text", hidden_size=256, intermediate_size=512, num_layers=6,
                         num_heads=4, num_kv_heads=2, head_dim=64,
                         vocab_size=tokenizer_vocab_size(model_dir),
                         max_position_embeddings=4096, sliding_window=256,
                         tie_word_embeddings=True, dtype="float32", rope_scaling=None)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def run_memory(model_dir: Path, hybrid: bool) -> dict:
    rng = random.Random(1)
    args = EngineArgs(model=str(model_dir), block_size=16, kv_cache_memory_bytes=48 << 20,
                      max_num_seqs=32, max_num_batched_tokens=1024, seed=0,
                      disable_hybrid_kv_cache_manager=not hybrid)
    engine = LLMEngine(args)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(16):
        prompt = [rng.randrange(4, 400) for _ in range(rng.randint(1500, 2000))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    start, peak, tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        peak = max(peak, engine.get_stats().num_running)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    return {"layout": "groups" if hybrid else "all-full", "num_blocks": stats.num_blocks,
            "peak_running": peak, "output_tok_s": tokens / wall, "wall_s": wall,
            "preemptions": stats.num_preemptions}


def part_memory(rounds: int, out: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_gemma3(Path(tmp) / "gemma3")
        runs = {True: [], False: []}
        for _ in range(rounds):
            for hybrid in (False, True):  # alternate: the machine is shared and noisy
                r = run_memory(model_dir, hybrid)
                runs[hybrid].append(r)
                out.append(r)
                print(f"  {r['layout']:>8}: {r['num_blocks']:>5} blocks, peak running "
                      f"{r['peak_running']:>2}, {r['output_tok_s']:.1f} out tok/s, "
                      f"{r['wall_s']:.1f} s, {r['preemptions']} preemptions", flush=True)
        med = {h: statistics.median(r["output_tok_s"] for r in runs[h]) for h in runs}
        print(f"  groups / all-full: peak running {runs[True][0]['peak_running']} / "
              f"{runs[False][0]['peak_running']}, output tok/s x{med[True] / med[False]:.2f} "
              "(medians)")


# Mooncake's conversation trace (kvcache-ai/Mooncake, FAST'25; Apache-2.0: see its README),
# lengths scaled by 1/16 for a CPU (a 512-token block id becomes 32 tokens).
TRACE = shared_trace("mooncake_conversation_trace.jsonl")
TRACE_SCALE = 1 / 16

Conversation = tuple[list[int], list[list[int]], list[int]]  # first prompt, questions, answers


def synthetic_conversations(seed: int = 2) -> list[Conversation]:
    """8 conversations x 4 turns: first prompts 100-300 tokens, questions 20-80, answers 32-64."""
    rng = random.Random(seed)
    return [([rng.randrange(4, 400) for _ in range(rng.randint(100, 300))],
             [[rng.randrange(4, 400) for _ in range(rng.randint(20, 80))] for _ in range(3)],
             [rng.randint(32, 64) for _ in range(4)]) for _ in range(8)]


def trace_conversations(path: Path, num: int = 8, turns: int = 4,
                        scale: float = TRACE_SCALE) -> list[Conversation]:
    """The first `num` conversations of `turns` turns in Mooncake's conversation trace: a
    request continues an earlier one when the earlier one's full 512-token blocks (all its
    block ids but the last) lead its own block ids (at least 2: id 0, the system prompt, is
    everyone's). Lengths times `scale`; the first prompt's tokens follow its block ids
    (`prompt_token_ids`: id 0's run is shared by every conversation), each later question is
    the growth of the next turn's input beyond the previous input and answer (at least 1)."""
    rows = read_mooncake(path)
    by_blocks: dict[tuple[int, ...], int] = {}
    child: dict[int, int] = {}
    is_child: set[int] = set()
    for i, r in enumerate(rows):
        ids = r.block_ids
        for k in range(len(ids), 1, -1):
            j = by_blocks.get(ids[:k])
            if j is not None:
                child.setdefault(j, i)  # the earliest continuation
                is_child.add(i)
                break
        if len(ids) > 2:
            by_blocks.setdefault(ids[:-1], i)
    out: list[Conversation] = []
    for root in range(len(rows)):
        chain = [root]
        while len(chain) < turns and chain[-1] in child:
            chain.append(child[chain[-1]])
        if root in is_child or len(chain) < turns:
            continue
        turns_ = scale_trace([rows[i] for i in chain], scale_lengths=scale)
        raw = [rows[i] for i in chain]
        questions = [_filler(max(1, round((b.input_length - a.input_length - a.output_length)
                                           * scale)), seed=chain[k + 1])
                     for k, (a, b) in enumerate(zip(raw, raw[1:], strict=False))]
        out.append((prompt_token_ids(turns_[0], 400, root), questions,
                    [t.output_length for t in turns_]))
        if len(out) == num:
            break
    return out


def _filler(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 400) for _ in range(n)]


def run_chat(model_dir: Path, conversations: list[Conversation], block_size: int,
             unit: int | None) -> dict:
    """Turn k of every conversation together once turn k-1 finished. Hits and TTFT over turns
    2..; the ideal token-granular cache's hit of a prompt: its longest common prefix with any
    sequence an earlier turn computed (prompt and answer but the answer's last token), at most
    the prompt less one token."""
    llm = LLM(model=str(model_dir), block_size=block_size, prefix_match_unit=unit, seed=0,
              kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=2048)
    prompts = [list(c[0]) for c in conversations]
    computed: list[list[int]] = []
    hits = ideal = 0
    ttfts = []
    num_turns = len(conversations[0][2])
    for turn in range(num_turns):
        params = [SamplingParams(temperature=0.0, max_tokens=c[2][turn], ignore_eos=True)
                  for c in conversations]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            if turn:  # turns 2..: the ones a previous turn's cache can shorten
                m = out.metrics
                ttfts.append(m["first_token_time"] - m["arrival_time"])
                hits += out.num_cached_tokens
                ideal += min(len(prompt) - 1,
                             max(len(os.path.commonprefix([prompt, seq])) for seq in computed))
        computed += [p + list(o.outputs[0].token_ids)[:-1]
                     for p, o in zip(prompts, outs, strict=True)]
        if turn + 1 < num_turns:
            prompts = [p + list(o.outputs[0].token_ids) + c[1][turn]
                       for p, o, c in zip(prompts, outs, conversations, strict=True)]
    llm.llm_engine.shutdown()
    return {"block_size": block_size, "prefix_match_unit": unit, "hit_tokens": hits,
            "ideal_hit_tokens": ideal, "of_ideal": hits / ideal,
            "mean_ttft_ms": 1000 * statistics.mean(ttfts)}


def part_chat(rounds: int, out: list, workload: str, trace: Path, model: str) -> None:
    conversations = (synthetic_conversations() if workload == "synthetic"
                     else trace_conversations(trace))
    tokens = sum(len(c[0]) + sum(map(len, c[1])) + sum(c[2]) for c in conversations)
    print(f"  {len(conversations)} conversations x {len(conversations[0][2])} turns, "
          f"{tokens} prompt + answer tokens ({workload})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_gemma3(Path(tmp) / "gemma3") if model == "gemma3" else \
            build_random_model_dir(Path(tmp) / "llama", hidden_size=256,
                                   intermediate_size=512, num_layers=4, num_heads=4,
                                   num_kv_heads=2)
        for block_size in (16, 32, 128):
            runs: dict[int | None, list[dict]] = {None: [], 1: []}
            for _ in range(rounds):
                for unit in (None, 1):
                    runs[unit].append(run_chat(model_dir, conversations, block_size, unit))
            for unit in (None, 1):
                r = {**runs[unit][0], "workload": workload, "model": model,
                     "mean_ttft_ms": statistics.median(x["mean_ttft_ms"] for x in runs[unit])}
                out.append(r)
                print(f"  block {block_size:>3}, unit {str(unit):>4}: hit {r['hit_tokens']:>6} of "
                      f"ideal {r['ideal_hit_tokens']} tokens ({100 * r['of_ideal']:.2f}%), "
                      f"mean TTFT {r['mean_ttft_ms']:.1f} ms", flush=True)
            ttft = {u: statistics.median(x["mean_ttft_ms"] for x in runs[u]) for u in runs}
            print(f"  block {block_size:>3}: TTFT with / without sub-block hits "
                  f"x{ttft[1] / ttft[None]:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("memory", "chat", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", choices=("trace", "synthetic"), default="trace",
                        help="chat: conversations from the Mooncake trace or synthetic ones")
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help="Mooncake conversation trace (JSONL) for --workload trace")
    parser.add_argument("--chat-model", choices=("llama", "gemma3"), default="llama",
                        help="chat: a random Llama, or the random Gemma 3 (KV cache groups)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: list = []
    if args.part in ("memory", "all"):
        print("memory: tiny Gemma 3, 48 MiB KV, 16 x 1,500-2,000-token prompts")
        part_memory(args.rounds, results)
    if args.part in ("chat", "all"):
        print(f"chat: prefix-hit tokens vs an ideal token-granular cache ({cpu_name()}; a "
              "shared machine's TTFT is noisy)")
        part_chat(args.rounds, results, args.workload, args.trace, args.chat_model)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
