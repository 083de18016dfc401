"""Microbenchmark of the KV-cache manager: microseconds per operation, optionally against vLLM.

Workload (issue 2): 256 requests whose prompts share a 512-token prefix plus 64 unique tokens
(36 blocks of 16). Requests run in waves of 8 resident at a time; each one is hashed, looked up
in the prefix cache (32 blocks hit, except the very first request), allocated for its prefill,
decoded for 64 steps (append a token, allocate its slot, advance num_computed_tokens), and
freed when its wave ends. The pool holds 1024 blocks, so later waves evict the cached unique
blocks of earlier ones (lazy LRU eviction is part of what is measured).

Operations timed (each with time.perf_counter_ns around the single call):
    hash     hash the 36 full blocks of a fresh 576-token prompt (sha256 by default)
    lookup   get_computed_blocks (the longest cached prefix: a 32-block hit)
    prefill  allocate_slots for the prompt after the hit (touch 32 hits, 4 new blocks, cache them)
    decode   one decode step: append the sampled token (hashing the block it fills, if any),
             allocate_slots(request, 1), advance num_computed_tokens
    free     free(request): its 40 blocks back to the pool, tail first

    python benchmarks/bench_kv.py [--json] [--reps 5] [--hash-algo sha256|xxhash]
    python benchmarks/bench_kv.py --vs-vllm /tmp/vllm-venv/bin/python

With --vs-vllm PYTHON the same driver (this file's `run_workload`, shipped as source) runs
against vLLM's own v1 KVCacheManager in that interpreter, in a subprocess, and the table gains
vLLM's figures and our/their ratios (below 1.0: we are faster). vLLM is never imported here.
Each figure is the median over --reps full runs of the workload, each on a fresh manager, after
one warm-up run per side; with --vs-vllm the two sides' runs alternate (vLLM's subprocess stays
up and runs the workload on request), so both see the same machine load, and each ratio is the
median of the per-run ratios. The spread column, (max - min) / median of the runs, shows noise.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

OPS = ("hash", "lookup", "prefill", "decode", "free")


@dataclass(frozen=True)
class Workload:
    num_requests: int = 256
    prefix_len: int = 512
    unique_len: int = 64
    decode_steps: int = 64
    block_size: int = 16
    resident: int = 8
    num_blocks: int = 1024
    max_model_len: int = 2048
    hash_algo: str = "sha256"


# ----------------------------------------------------------------------------- the driver
# run_workload is shipped verbatim (inspect.getsource) into the vLLM-side script, so both
# managers see exactly the same sequence of calls with the same token ids.


def run_workload(adapter, w) -> dict:
    """Drive `adapter` through the workload `w`; returns total ns and call count per operation,
    plus checksums (hit tokens, failed allocations) that must agree between implementations."""
    clock = time.perf_counter_ns
    totals = {op: 0 for op in ("hash", "lookup", "prefill", "decode", "free")}
    counts = dict.fromkeys(totals, 0)
    prefix = list(range(1000, 1000 + w["prefix_len"]))
    hit_tokens = 0
    failed = 0
    for wave_start in range(0, w["num_requests"], w["resident"]):
        wave = []
        for i in range(wave_start, min(wave_start + w["resident"], w["num_requests"])):
            unique = [100_000 + i * w["unique_len"] + j for j in range(w["unique_len"])]
            req = adapter.new_request(f"req-{i}", prefix + unique)
            t = clock()
            adapter.hash(req)
            totals["hash"] += clock() - t
            t = clock()
            hit = adapter.lookup(req)
            totals["lookup"] += clock() - t
            t = clock()
            ok = adapter.prefill(req, hit)
            totals["prefill"] += clock() - t
            counts["hash"] += 1
            counts["lookup"] += 1
            counts["prefill"] += 1
            hit_tokens += adapter.num_hit_tokens(hit)
            if not ok:
                failed += 1
                continue
            wave.append((i, req))
        for step in range(w["decode_steps"]):
            for i, req in wave:
                token = 500_000 + i * w["decode_steps"] + step
                t = clock()
                ok = adapter.decode(req, token)
                totals["decode"] += clock() - t
                counts["decode"] += 1
                if not ok:
                    failed += 1
        for _, req in wave:
            t = clock()
            adapter.free(req)
            totals["free"] += clock() - t
            counts["free"] += 1
    adapter.check()
    return {"totals_ns": totals, "counts": counts, "hit_tokens": hit_tokens, "failed": failed}


def us_per_op(result: dict) -> dict:
    """Microseconds per call of each operation in one run_workload result."""
    return {op: result["totals_ns"][op] / result["counts"][op] / 1000.0 for op in OPS}


def checks_of(result: dict) -> dict:
    return {"counts": result["counts"], "hit_tokens": result["hit_tokens"],
            "failed": result["failed"]}


# ----------------------------------------------------------------------------- our side


class BenchRequest:
    """The duck-typed request pagedkv.kv.manager.KVCacheManager reads."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "cache_salt", "lora_name")

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.cache_salt = None
        self.lora_name = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class PagedKVAdapter:
    def __init__(self, w: dict) -> None:
        from pagedkv.kv.manager import KVCacheManager

        self.manager = KVCacheManager(num_blocks=w["num_blocks"], block_size=w["block_size"],
                                      enable_caching=True, hash_algo=w["hash_algo"])

    def new_request(self, request_id, prompt):
        return BenchRequest(request_id, prompt)

    def hash(self, req):
        self.manager.update_block_hashes(req)

    def lookup(self, req):
        return self.manager.get_computed_blocks(req)

    def num_hit_tokens(self, hit):
        return hit[1]

    def prefill(self, req, hit):
        blocks, num_hit = hit
        num_new = req.num_tokens - num_hit
        if self.manager.allocate_slots(req, num_new, blocks, num_hit) is None:
            return False
        req.num_computed_tokens = req.num_tokens
        return True

    def decode(self, req, token):
        req.all_token_ids.append(token)
        if self.manager.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def free(self, req):
        self.manager.free(req)

    def check(self):
        self.manager.check_invariants()


# ----------------------------------------------------------------------------- vLLM's side

_VLLM_ADAPTER = r'''
import gc, json, sys, time

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus


class VLLMAdapter:
    """vLLM v1's KVCacheManager as its Scheduler drives it (one full-attention group)."""

    def __init__(self, w):
        hash_fn = get_hash_fn_by_name(w["hash_algo"])
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(w["block_size"], hash_fn)
        spec = FullAttentionSpec(block_size=w["block_size"], num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)
        config = KVCacheConfig(num_blocks=w["num_blocks"], kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(config, max_model_len=w["max_model_len"],
                                      scheduler_block_size=w["block_size"],
                                      hash_block_size=w["block_size"], enable_caching=True)
        self.params = SamplingParams(max_tokens=w["decode_steps"] + 1)

    def new_request(self, request_id, prompt):
        # No hasher yet: hashing the prompt is timed on its own by hash().
        return Request(request_id, prompt, self.params, None)

    def hash(self, req):
        req._block_hasher = self.hasher
        req.update_block_hashes()

    def lookup(self, req):
        return self.manager.get_computed_blocks(req)

    def num_hit_tokens(self, hit):
        return hit[1]

    def prefill(self, req, hit):
        blocks, num_hit, _ = hit
        num_new = req.num_tokens - num_hit
        if self.manager.allocate_slots(req, num_new, num_hit, blocks) is None:
            return False
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        return True

    def decode(self, req, token):
        req.append_output_token_ids(token)
        if self.manager.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def free(self, req):
        self.manager.free(req)

    def check(self):
        pass


if __name__ == "__main__":
    # One run of the workload per "run" line on stdin, so that the caller can interleave the
    # two sides' runs and both see the same machine load.
    import vllm

    w = json.loads(sys.argv[1])
    print("READY " + vllm.__version__, flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        adapter = VLLMAdapter(w)
        gc.collect()
        print("RESULT " + json.dumps(run_workload(adapter, w)), flush=True)
'''


class VLLMSide:
    """vLLM's KVCacheManager driven in interpreter `python`: a subprocess running a script
    written to a temporary file, one workload run per `run()` call."""

    def __init__(self, python: str, w: dict) -> None:
        source = "\n".join(["import gc, json, sys, time", "OPS = " + repr(OPS),
                            inspect.getsource(run_workload), _VLLM_ADAPTER])
        self._tmp = tempfile.TemporaryDirectory(prefix="bench_kv_vllm_")
        script = os.path.join(self._tmp.name, "bench_kv_vllm.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(source)
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
        stderr_path = os.path.join(self._tmp.name, "stderr.txt")
        self._stderr = open(stderr_path, "w+", encoding="utf-8")  # noqa: SIM115 (close())
        self._proc = subprocess.Popen([python, script, json.dumps(w)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                      cwd=self._tmp.name, env=env)
        self.version = self._expect("READY ")

    def _expect(self, prefix: str) -> str:
        for line in self._proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self._proc.wait()
        self._stderr.seek(0)
        tail = "\n".join(self._stderr.read().strip().splitlines()[-20:])
        raise RuntimeError(f"the vLLM side failed (exit {self._proc.returncode}):\n{tail}")

    def run(self) -> dict:
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        self._stderr.close()
        self._tmp.cleanup()


def measure(w: dict, reps: int, vllm_python: str | None) -> dict:
    """One warm-up run per side, then `reps` runs, alternating the sides run by run."""
    vllm_side = VLLMSide(vllm_python, w) if vllm_python else None
    try:
        ours_runs: list[dict] = []
        theirs_runs: list[dict] = []
        checks: dict = {}
        for rep in range(reps + 1):
            gc.collect()
            result = run_workload(PagedKVAdapter(w), w)
            checks["pagedkv"] = checks_of(result)
            if rep:
                ours_runs.append(us_per_op(result))
            if vllm_side is not None:
                result = vllm_side.run()
                checks["vllm"] = checks_of(result)
                if rep:
                    theirs_runs.append(us_per_op(result))
        return {"ours": ours_runs, "theirs": theirs_runs or None, "checks": checks,
                "vllm_version": vllm_side.version if vllm_side else None}
    finally:
        if vllm_side is not None:
            vllm_side.close()


# ----------------------------------------------------------------------------- report


def summarize(runs: list[dict]) -> dict:
    """Per op: median and min microseconds over the runs, and spread = (max - min) / median."""
    out = {}
    for op in OPS:
        values = [run[op] for run in runs]
        median = statistics.median(values)
        out[op] = {"us_median": median, "us_min": min(values),
                   "spread": (max(values) - min(values)) / median if median else 0.0}
    return out


def ratios(ours: list[dict], theirs: list[dict]) -> dict:
    """Per op: the median over paired (interleaved) runs of ours / theirs."""
    return {op: statistics.median(o[op] / t[op] for o, t in zip(ours, theirs, strict=True))
            for op in OPS}


def format_table(ours: dict, theirs: dict | None, ratio: dict | None, w: Workload, reps: int,
                 vllm_version: str | None) -> str:
    header = (f"{w.num_requests} requests x ({w.prefix_len} shared + {w.unique_len} unique "
              f"tokens), block {w.block_size}, {w.decode_steps} decode steps, "
              f"{w.resident} resident, {w.num_blocks} blocks, {w.hash_algo}; median of {reps} runs")
    lines = [header, ""]
    if theirs is None or ratio is None:
        lines.append(f"{'op':<8} {'pagedkv us':>11} {'min':>8} {'spread':>7}")
        for op in OPS:
            o = ours[op]
            lines.append(f"{op:<8} {o['us_median']:>11.2f} {o['us_min']:>8.2f} "
                         f"{o['spread']:>6.0%}")
        return "\n".join(lines)
    lines.append(f"{'op':<8} {'pagedkv us':>11} {'spread':>7} {'vLLM us':>9} {'spread':>7} "
                 f"{'ours/theirs':>12} {'min/min':>8}")
    for op in OPS:
        o, t = ours[op], theirs[op]
        lines.append(f"{op:<8} {o['us_median']:>11.2f} {o['spread']:>6.0%} "
                     f"{t['us_median']:>9.2f} {t['spread']:>6.0%} {ratio[op]:>12.2f} "
                     f"{o['us_min'] / t['us_min']:>8.2f}")
    lines.append("")
    lines.append(f"vLLM {vllm_version}: its v1 KVCacheManager, same driver and tokens, runs "
                 "interleaved with ours; ours/theirs = median of per-run ratios, min/min = ratio "
                 "of the fastest runs (< 1: pagedkv faster)")
    return "\n".join(lines)


def profile_ours(w: dict, limit: int = 25) -> str:
    """cProfile one run of our side; the top functions by internal time."""
    adapter = PagedKVAdapter(w)
    profiler = cProfile.Profile()
    profiler.enable()
    run_workload(adapter, w)
    profiler.disable()
    stream = __import__("io").StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(limit)
    return stream.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--reps", type=int, default=5, help="full runs per side (median)")
    parser.add_argument("--hash-algo", default="sha256", choices=("sha256", "xxhash"))
    parser.add_argument("--num-requests", type=int, default=Workload.num_requests)
    parser.add_argument("--vs-vllm", metavar="PYTHON", default=None,
                        help="an interpreter with vLLM installed: compare against its manager")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of one run of our side")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    w = Workload(hash_algo=args.hash_algo, num_requests=args.num_requests)
    wd = asdict(w)

    measured = measure(wd, args.reps, args.vs_vllm)
    checks = measured["checks"]
    if "vllm" in checks and checks["vllm"] != checks["pagedkv"]:
        raise SystemExit(f"the two managers disagree on the workload: {checks}")
    ours = summarize(measured["ours"])
    theirs = summarize(measured["theirs"]) if measured["theirs"] else None
    ratio = ratios(measured["ours"], measured["theirs"]) if measured["theirs"] else None
    version = measured["vllm_version"]

    if args.json:
        result = {"workload": wd, "reps": args.reps, "checks": checks["pagedkv"],
                  "pagedkv": ours}
        if theirs is not None:
            result.update(vllm=theirs, vllm_version=version, ratio=ratio,
                          ratio_of_mins={op: ours[op]["us_min"] / theirs[op]["us_min"]
                                         for op in OPS})
        print(json.dumps(result, indent=2))
    else:
        print(format_table(ours, theirs, ratio, w, args.reps, version))
        c = checks["pagedkv"]
        print(f"\nchecks: {c['hit_tokens']} prefix-hit tokens, {c['failed']} failed "
              f"allocations, calls {c['counts']}"
              + ("; identical on both sides" if theirs is not None else ""))
    if args.profile:
        print(profile_ours(wd), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
