"""`bench_offline.py --device cuda`: the 1B-shape workloads on one GPU, pagedkv vs transformers.

Model: a random-weight Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 8192, vocab 32064), bfloat16. Workloads (greedy, ignore_eos):
  A. 128 requests x 512-token prompts x 64 output tokens: pagedkv and transformers `generate`
     (static batches of 64, sdpa, left-padded) in the same run; tok/s and the ratio.
  B. 256 requests, prompts 128-1024, outputs 64-512: pagedkv tok/s (transformers with
     --transformers-mixed; it is slow).
  C. Decode step of 128 requests at 576 tokens of context: median step time against the
     memory-bandwidth floor (weights + KV read once at the copy bandwidth measured in this
     run), and a breakdown of one step from the torch profiler: attention kernels, linear
     layers (GEMMs), other GPU kernels, and host time the GPU is idle (Python overhead).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

SHAPE_1B = dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, vocab_size=32064, max_position_embeddings=4096)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device bytes/s, counting bytes read plus written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def fixed_workload(seed: int, vocab: int, n: int, prompt: int, out: int):
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(prompt)], out) for _ in range(n)]


def mixed_workload(seed: int, vocab: int):
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(128, 1024))],
             rng.randint(64, 512)) for _ in range(256)]


def run_pagedkv(llm, requests) -> dict:
    from pagedkv import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(seconds=elapsed, output_tokens=generated, tokens_per_s=generated / elapsed)


def run_transformers(model_dir: Path, requests, batch_size: int = 64) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()

    def run_batch(batch):
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in batch], device="cuda")
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch],
                            device="cuda")
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    run_batch(requests[:2])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        run_batch(requests[i:i + batch_size])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(n for _, n in requests)
    return dict(seconds=elapsed, output_tokens=generated, tokens_per_s=generated / elapsed)


def _category(name: str) -> str:
    n = name.lower()
    if "paged_attention" in n or "store_kv" in n:
        return "attention"
    if "argmax" in n:
        return "sampler"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "sm90", "xmma", "matmul")):
        return "linear"
    return "other"


def decode_step(llm, vocab: int, batch: int = 128, context: int = 576, steps: int = 20) -> dict:
    """Median wall time of decode steps of `batch` requests at about `context` tokens, and a
    profiler breakdown of a few of them (ms per step)."""
    from pagedkv import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(3)
    params = SamplingParams(temperature=0, max_tokens=steps + 12, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}",
                           {"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(context)]},
                           params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids)
              for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gpu = gpu_breakdown(engine, 3)
    host = host_phases(engine, 5)
    while engine.has_unfinished_requests():
        engine.step()
    step_ms = statistics.median(times) * 1e3
    busy = sum(gpu.values())
    return dict(step_ms=step_ms, gpu_ms=gpu, gpu_busy_ms=busy, host_ms=host,
                host_idle_ms=max(step_ms - busy, 0.0), batch=batch, context=context)


def gpu_breakdown(engine, steps: int) -> dict:
    """GPU kernel ms per step by category, from the torch profiler over `steps` engine steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    gpu = {"attention": 0.0, "linear": 0.0, "sampler": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and t:
            gpu[_category(evt.key)] += t / 1e3 / steps
    return gpu


def prefill_step(llm, vocab: int, batch: int = 16, prompt: int = 512) -> dict:
    """Wall time and GPU breakdown of one step prefilling `batch` prompts of `prompt` tokens
    (one token each to generate, so the step samples too)."""
    from pagedkv import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(5)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def add(tag):
        for i in range(batch):
            ids = [rng.randrange(4, vocab) for _ in range(prompt)]
            engine.add_request(f"prefill-{tag}-{i}", {"prompt_token_ids": ids}, params)

    add("warm")
    while engine.has_unfinished_requests():
        engine.step()
    add("timed")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    add("profiled")
    gpu = gpu_breakdown(engine, 1)
    while engine.has_unfinished_requests():
        engine.step()
    return dict(step_ms=wall, gpu_ms=gpu, tokens=batch * prompt)


HOST_PHASES = {"schedule": "scheduler.py", "execute": "runner.py", "update": "scheduler.py",
               "_process": "llm_engine.py", "describe_step": "runner.py",
               "replay": "cuda_graphs.py", "compute_logits": "llama.py",
               "__call__": "sampler.py"}


def host_phases(engine, steps: int) -> dict:
    """Cumulative ms per step of the engine's phases under cProfile (inflated by the profiler;
    read as proportions). `execute` includes waiting for the GPU (the sampled tokens)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    out = {}
    for (path, _, func), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():
        if func in HOST_PHASES and path.endswith(HOST_PHASES[func]):
            out[func] = out.get(func, 0.0) + cum * 1e3 / steps
    return out


def main(args) -> int:
    from pagedkv import LLM
    from pagedkv.testing import build_random_model_dir

    report: dict = {"device": torch.cuda.get_device_name()}
    base = Path(args.model_dir or "/tmp/pagedkv-bench")
    model_dir = base / "llama-1b-shape-bfloat16"
    if not (model_dir / "model.safetensors").exists():
        build_random_model_dir(model_dir, dtype="bfloat16", seed=0, **SHAPE_1B)
    vocab = SHAPE_1B["vocab_size"]
    bw = copy_bandwidth()
    report["copy_bandwidth_GBps"] = bw / 1e9
    print(f"device {report['device']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    llm = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", seed=0,
              max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    engine = llm.llm_engine
    report["num_gpu_blocks"] = engine.kv_setup.num_blocks
    cfg = engine.model_config
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())

    req_a = fixed_workload(0, vocab, 128, 512, 64)
    ours = run_pagedkv(llm, req_a)
    report["A_pagedkv"] = ours
    print(f"[A 128x512x64] pagedkv {ours['tokens_per_s']:.0f} tok/s ({ours['seconds']:.2f} s)",
          flush=True)
    req_b = mixed_workload(1, vocab)
    mixed = run_pagedkv(llm, req_b)
    report["B_pagedkv"] = mixed
    print(f"[B 256 mixed] pagedkv {mixed['tokens_per_s']:.0f} tok/s ({mixed['seconds']:.2f} s)",
          flush=True)
    step = decode_step(llm, vocab)
    kv_bytes = (step["batch"] * step["context"] * cfg.num_layers * 2 * cfg.num_kv_heads
                * cfg.head_dim * 2)
    floor_ms = (weights + kv_bytes) / bw * 1e3
    step["floor_ms"] = floor_ms
    step["ratio_to_floor"] = step["step_ms"] / floor_ms
    report["C_decode_step"] = step
    g = step["gpu_ms"]
    print(f"[C decode 128 x 576] step {step['step_ms']:.2f} ms, floor {floor_ms:.2f} ms "
          f"(weights {weights / 1e9:.2f} GB + KV {kv_bytes / 1e9:.2f} GB at {bw / 1e9:.0f} GB/s): "
          f"{step['ratio_to_floor']:.2f}x floor; GPU per step: attention {g['attention']:.2f} ms, "
          f"linear {g['linear']:.2f} ms, other {g['other']:.2f} ms; GPU idle (host) "
          f"{step['host_idle_ms']:.2f} ms", flush=True)
    print("    decode GPU sampler (argmax) " + f"{g['sampler']:.2f} ms", flush=True)
    pre = prefill_step(llm, vocab)
    report["D_prefill_step"] = pre
    pg = pre["gpu_ms"]
    print(f"[D prefill 16 x 512 tokens] step {pre['step_ms']:.1f} ms; GPU: attention "
          f"{pg['attention']:.1f} ms, linear {pg['linear']:.1f} ms, other {pg['other']:.1f} ms",
          flush=True)
    print("    host phases (ms/step, under cProfile): "
          + ", ".join(f"{k} {v:.2f}" for k, v in step["host_ms"].items()), flush=True)
    llm.shutdown()
    del llm, engine
    if args.compare_eager:  # a second engine in the same process: sizes from the freed memory
        eager = LLM(model=str(model_dir), dtype="bfloat16", device="cuda", seed=0,
                    max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                    enforce_eager=True, enable_prefix_caching=False)
        report["eager_num_gpu_blocks"] = eager.llm_engine.kv_setup.num_blocks
        eager_step = decode_step(eager, vocab, steps=10)
        report["C_decode_step_eager"] = eager_step
        print(f"[C decode 128 x 576, enforce_eager] step {eager_step['step_ms']:.2f} ms "
              f"(second engine: {report['eager_num_gpu_blocks']} KV blocks, first "
              f"{report['num_gpu_blocks']})", flush=True)
        eager.shutdown()
        del eager

    if not args.skip_transformers:
        theirs = run_transformers(model_dir, req_a)
        report["A_transformers"] = theirs
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        report["A_ratio"] = ratio
        print(f"[A 128x512x64] transformers {theirs['tokens_per_s']:.0f} tok/s: pagedkv is "
              f"{ratio:.1f}x", flush=True)
        if args.transformers_mixed:
            mixed_t = run_transformers(model_dir, req_b)
            report["B_transformers"] = mixed_t
            print(f"[B 256 mixed] transformers {mixed_t['tokens_per_s']:.0f} tok/s: pagedkv is "
                  f"{mixed['tokens_per_s'] / mixed_t['tokens_per_s']:.1f}x", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
