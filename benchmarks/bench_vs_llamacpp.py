"""pagedkv against llama.cpp on the same GGUF file, the same CPU and the same threads, one run.

llama.cpp is the anchor CPU users pick for GGUF files. It is never a project dependency: this
script finds its tools in a throwaway folder or builds them there from `llama-cpp-python`'s source
distribution on the package registry (which vendors llama.cpp): `pip download --no-binary`, then
cmake with `-DGGML_NATIVE=ON` (about 8 minutes on 2 idle cores, once).

Parts (`--parts`, all by default):
- `bench`: decode tokens/s at batch 1 over 128 tokens (llama-bench `tg128`) and prefill tokens/s
  of a 512-token prompt (`pp512`), each engine on each quant type; pagedkv in every mode of
  `--pagedkv-modes` (`packed`: bfloat16 with the GGUF linears kept 4-bit, `--quantization auto`;
  `bfloat16`, `float32`: every weight dequantized to that dtype). Also the decode step's
  bandwidth floor: the weight bytes (the GGUF file's tensor bytes) over the measured read
  bandwidth, and each engine's ratio to it.
- `perplexity`: `llama-perplexity -c CTX` on tests/data's public-domain texts, and pagedkv's
  perplexity on the same chunks scored the same way: llama.cpp's own tokens (read back from
  its `--kl-divergence-base` file), chunks of CTX tokens, each scored on its second half less
  the half's first token, as llama-perplexity does. Beside them the exact perplexity of the
  file's weights (pagedkv `float32`: every weight dequantized as `gguf.quants.dequantize` does,
  float32 throughout; on SmolLM2 Q4_0 within 0.01% of transformers' Llama in float64), each
  engine's distance from it, and where llama.cpp runs repacked weights (its default for Q4_0
  on x86) also llama.cpp `--no-repack`. The ratio to llama.cpp comes with its standard error
  over the scored tokens.
- `serve`: output tokens/s, mean TPOT and mean TTFT at each concurrency (16 and 64) of
  `llama-server` (one slot per concurrent request, `-np 16` at 16, continuous batching, the
  same threads for prompts and decode) and `pagedkv serve` (the packed GGUF), loaded by the same
  client (`pagedkv bench serve`: random 256-token prompts, 128 output tokens, greedy,
  ignore_eos), a fresh server per point, `--rounds` alternating which server goes first, each
  point's prompts new to both; the ratios are medians over the rounds. With `--steps`, pagedkv's
  engine steps (its step log) class by class. `--llama-server BUILD_DIR` names a build with
  llama-server where `--llama-cpp`'s has none.

    PYTHONPATH=$PWD python benchmarks/bench_vs_llamacpp.py [--gguf FILE]
        [--quant-types Q4_1,Q8_0,Q4_0,Q6_K] [--parts bench,perplexity,serve] [--threads N]
        [--pagedkv-modes packed,bfloat16] [--llama-cpp BUILD_DIR] [--llama-server BUILD_DIR]
        [--concurrency 16,64] [--num-prompts 64] [--rounds 2] [--steps] [--depth D]
        [--bench-rounds N]

`--depth D`: the bench part's decode after D tokens of context instead (llama-bench `-p 0 -n
128 -d D`; pagedkv a D-token prompt's next 127 tokens), a chat's long context.
`--bench-rounds N`: the bench part N times, alternating which engine goes first, then each
mode's median ratios and their range: on a shared machine one round's ratio moves with the
load (llama.cpp's own tg128 has moved by a quarter between runs minutes apart).

Q4_1 is the shipped SmolLM2 file; other types are made from it with `llama-quantize
--allow-requantize` into the throwaway folder (requantized from Q4_1: the same weights for both
engines, not the quality of a quant made from the original float weights). SmolLM2's rows of
576 weights do not split into K-quants' super-blocks of 256, so its "Q6_K" file holds Q6_K only
in the MLP's down projections and Q8_0 elsewhere (llama-quantize's fallback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.bench.machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors_steps import pagedkv_steps, print_step_tables  # noqa: E402
from bench_serve import _table as print_table  # noqa: E402
from bench_serve import free_port, load, wait_healthy  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_PYTHON = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
ANCHORS = Path.home() / ".cache" / "pagedkv-anchors"
TOOLS = ("llama-bench", "llama-server", "llama-quantize", "llama-perplexity")
TEXTS = [Path(__file__).resolve().parent.parent / "tests" / "data" / name
         for name in ("declaration_of_independence.txt", "lincoln_addresses.txt")]


# ----- llama.cpp: find or build ---------------------------------------------------------------

def llama_cpp_bin(build_dir: Path | None, tools: tuple[str, ...] = TOOLS) -> Path:
    """The folder holding llama.cpp's `tools`: `build_dir`/bin, else the throwaway build in
    ANCHORS (built there when not found)."""
    if build_dir is not None:
        bin_dir = build_dir / "bin"
        missing = [t for t in tools if not (bin_dir / t).is_file()]
        if missing:
            raise SystemExit(f"{bin_dir} has no {', '.join(missing)}")
        return bin_dir
    src = ANCHORS / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    bin_dir = src / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    ANCHORS.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        print(f"downloading {LLAMA_CPP_PYTHON}'s source distribution into {ANCHORS}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-binary",
                        ":all:", "--no-deps", "-d", str(ANCHORS)], check=True)
        tarball = ANCHORS / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
        subprocess.run(["tar", "xzf", str(tarball), "-C", str(ANCHORS)], check=True)
    print(f"building llama.cpp in {src / 'build'} (minutes, once)", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_OPENSSL=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(src / "build"), "-j", str(os.cpu_count() or 1),
                    "--target", *TOOLS], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def quantized_file(bin_dir: Path, source: Path, quant_type: str) -> Path:
    """`source` itself when it is already `quant_type`, else a requantized copy in ANCHORS."""
    if f".{quant_type}." in source.name:
        return source
    out = ANCHORS / "models" / source.name.replace(".gguf", f".requant-{quant_type}.gguf")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source),
                        str(out), quant_type], check=True, capture_output=True)
    return out


# ----- the bandwidth floor --------------------------------------------------------------------

def read_bandwidth_gbs() -> float:
    """Best of 5 reads of a 1 GiB tensor with torch (all threads), in GB/s."""
    import torch

    data = torch.ones(1 << 28, dtype=torch.float32)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def gguf_vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def gguf_weight_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


# ----- llama.cpp measurements -----------------------------------------------------------------

# llama.cpp repacks weights for its AMX / AVX-512 kernels by default. Where that path crashes on a
# file (llama.cpp 0.3.36's AMX mul_mat segfaults on SmolLM2's Q4_1 on Sapphire Rapids), the tool
# is run again without repacking, and so is every later run of that tool (it says so).
NO_REPACK: dict[str, list[str]] = {"llama-bench": ["--repack", "0"],
                                   "llama-perplexity": ["--no-repack"],
                                   "llama-server": ["--no-repack"]}
repack_off: set[str] = set()  # the tools run without repacking


def run_llama(bin_dir: Path, tool: str, args: list[str]) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; retried once without weight repacking when it dies by a signal."""
    cmd = [str(bin_dir / tool), *args, *(NO_REPACK[tool] if tool in repack_off else [])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode < 0 and tool not in repack_off:
        print(f"  ({tool} died by {signal.Signals(-out.returncode).name}: running it without "
              f"weight repacking from here on)", flush=True)
        repack_off.add(tool)
        return run_llama(bin_dir, tool, args)
    out.check_returncode()
    return out

def llama_bench(bin_dir: Path, model: Path, threads: int, reps: int,
                depth: int = 0) -> dict[str, float]:
    """llama-bench's pp512 and tg128 tokens/s (`depth` > 0: tg128 alone, after that many
    tokens of context, `-d`)."""
    tests = ["-p", "512", "-n", "128"] if depth == 0 else ["-p", "0", "-n", "128", "-d", str(depth)]
    out = run_llama(bin_dir, "llama-bench", ["-m", str(model), *tests, "-t", str(threads),
                                             "-r", str(reps), "-o", "json"])
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        key = "pp512" if row["n_prompt"] else "tg128"
        result[key] = float(row["avg_ts"])
    return result


@dataclass
class LlamaPerplexity:
    """llama-perplexity's run: its figure, the chunks it scored and each scored token's log-prob."""

    ppl: float
    tokens: np.ndarray  # int [chunks, ctx]: llama.cpp's own tokens of the text
    logprobs: np.ndarray  # float [chunks, ctx - 1 - ctx // 2]: log p of tokens ctx//2 + 1 ..
    repacked: bool  # llama.cpp ran repacked weights (`CPU_REPACK`: its default where it has one)
    floored: np.ndarray  # bool, as logprobs: the file holds only its floor for that token


def scored_logprobs(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [chunks, ctx], log p of each scored token [chunks, ctx - 1 - ctx // 2], whether
    that token sits at its position's floor) from the file `llama-perplexity
    --kl-divergence-base` writes (tools/perplexity/perplexity.cpp): b"_logits_", int32 ctx,
    vocab, chunks, the tokens, then per scored position the log-probs of the whole vocabulary as
    two float32 (scale, minimum) and uint16 steps above the minimum; the minimum is the
    position's top log-prob less 16, and a token below it is stored as step 0 (its log-prob is
    then unknown, at most the minimum)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        ctx, vocab, chunks = np.frombuffer(f.read(12), np.int32)
        tokens = np.frombuffer(f.read(4 * ctx * chunks), np.int32).reshape(chunks, ctx)
    first = ctx // 2
    stride = 2 * ((vocab + 1) // 2) + 4
    rows = np.memmap(path, np.uint16, "r", 20 + tokens.nbytes).reshape(chunks, ctx - 1 - first,
                                                                        stride)
    header = np.ascontiguousarray(rows[..., :4]).view(np.float32)  # [chunks, rows, 2]
    steps = np.take_along_axis(rows[..., 4:], tokens[:, first + 1:, None], 2)[..., 0]
    return tokens, header[..., 1] + header[..., 0] * steps.astype(np.float32), steps == 0


def llama_perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, threads: int,
                     no_repack: bool = False) -> LlamaPerplexity:
    """`llama-perplexity -c ctx` on `text`, with the tokens and log-probs it scored."""
    with tempfile.TemporaryDirectory(prefix="llama-ppl-") as tmp:
        logits = Path(tmp) / "logits.bin"
        out = run_llama(bin_dir, "llama-perplexity", [
            "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
            "--kl-divergence-base", str(logits), "-lv", "4",  # -lv 4: the buffers' log lines
            *(NO_REPACK["llama-perplexity"] if no_repack else [])])
        log = out.stdout + out.stderr
        match = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
        if match is None:
            raise RuntimeError(f"no perplexity in llama-perplexity's output: {log[-2000:]}")
        tokens, logprobs, floored = scored_logprobs(logits)
    ppl = float(match.group(1))
    # Floored tokens read higher than they are: with any, the file's perplexity may only be lower.
    from_file = math.exp(-logprobs.mean()) / ppl - 1
    if from_file > 1e-3 or (from_file < -1e-3 and not floored.any()):
        raise RuntimeError(f"llama-perplexity's log-probs give {math.exp(-logprobs.mean()):.4f}, "
                           f"its log {ppl:.4f}: the logits file is misread")
    repacked = re.search(r"CPU_REPACK model buffer size = +[1-9]", log) is not None
    return LlamaPerplexity(ppl, tokens, logprobs, repacked, floored)


# ----- pagedkv measurements -------------------------------------------------------------------

# pagedkv's modes: (dtype, quantization). `packed`: the GGUF linears kept 4-bit (Q4_0, Q4_1,
# Q4_K; other types dequantized); the others dequantize every weight at load.
MODES = {"packed": ("bfloat16", "auto"), "bfloat16": ("bfloat16", "none"),
         "float32": ("float32", "none")}


def pagedkv_engine(model: Path, mode: str, threads: int):  # noqa: ANN201 - an LLMEngine
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    dtype, quantization = MODES[mode]
    args = EngineArgs(model=str(model), dtype=dtype, quantization=quantization,
                      max_model_len=1024, max_num_batched_tokens=1024, enable_prefix_caching=False,
                      kv_cache_memory_bytes=256 << 20, cpu_threads=threads, cpu_kernels="wait")
    return LLMEngine.from_engine_args(args)


def pagedkv_bench(model: Path, mode: str, threads: int, reps: int,
                  depth: int = 0) -> dict[str, float]:
    """pp512 and tg128 as llama-bench measures them (tg128 after `depth` tokens of context),
    and the bytes a decode step reads (bench_quant_weights.pagedkv_throughput)."""
    from bench_quant_weights import pagedkv_throughput

    dtype, quantization = MODES[mode]
    got = pagedkv_throughput(str(model), quantization=quantization, dtype=dtype, n_prompt=512,
                             n_gen=128, threads=threads, reps=reps, depth=depth)
    return {"pp512": got.prefill_tps, "tg128": got.decode_tps, "step_bytes": got.step_bytes}


def bench_round(bin_dir: Path, model: Path, modes: list[str], threads: int, reps: int,
                depth: int, pagedkv_first: bool) -> tuple[dict, dict[str, dict]]:
    """One round of llama-bench and pagedkv's same measures in each mode (pagedkv_bench), in
    that order or the other: (llama.cpp's, {mode: pagedkv's})."""
    got: dict[str, dict] = {}
    ref: dict = {}
    for who in ([*modes, "llama.cpp"] if pagedkv_first else ["llama.cpp", *modes]):
        if who == "llama.cpp":
            ref = llama_bench(bin_dir, model, threads, reps, depth)
        else:
            got[who] = pagedkv_bench(model, who, threads, reps, depth)
    return ref, got


def bench_part(bin_dir: Path, model: Path, modes: list[str], threads: int, reps: int,
               floor: float, weight_bytes: int, depth: int = 0, rounds: int = 1) -> None:
    """tg128 (after `depth` tokens of context) and, at depth 0, pp512 of llama.cpp and of
    pagedkv in each mode, pagedkv's against llama.cpp's, and at depth 0 each against the
    decode floor (`floor` tok/s). `rounds` > 1: that many rounds, alternating which engine
    goes first, then each mode's median ratios with their range (one round's ratio moves with
    the machine's load and llama.cpp's own spread)."""
    keys = ["tg128"] if depth else ["pp512", "tg128"]
    at = f" at depth {depth}" if depth else ""
    ratios: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in modes}

    def of_floor(tps: dict) -> str:  # (the weights-only floor: at a depth the K/V add to it)
        return "" if depth else f" ({tps['tg128'] / floor:.2f} of the floor)"

    for r in range(rounds):
        ref, got = bench_round(bin_dir, model, modes, threads, reps, depth, r % 2 == 1)
        label = f"round {r} " if rounds > 1 else ""
        print(f"  {label}llama.cpp        " + "  ".join(f"{k}{at} {ref[k]:8.1f} tok/s"
                                                     for k in keys) + of_floor(ref))
        for mode in modes:
            for k in keys:
                ratios[mode][k].append(got[mode][k] / ref[k])
            print(f"  {label}pagedkv {mode:8} " + "  ".join(f"{k}{at} {got[mode][k]:8.1f} tok/s"
                                                          for k in keys)
                  + of_floor(got[mode]) + "  ratio to llama.cpp: "
                  + ", ".join(f"{k} {got[mode][k] / ref[k]:.2f}x" for k in keys)
                  + f"; a step reads {got[mode]['step_bytes'] / 2**20:.1f} MiB, "
                  f"{got[mode]['step_bytes'] / weight_bytes:.2f}x the file's weights")
    if rounds > 1:
        for mode in modes:
            print(f"  pagedkv {mode} against llama.cpp, median over {rounds} rounds (range): "
                  + ", ".join(f"{k}{at} {np.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                              for k, v in ratios[mode].items()))


def pagedkv_logprobs(engine, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """llama-perplexity's scoring: log p of tokens ctx//2 + 1 .. ctx - 1 of each chunk (a row of
    `tokens`, [chunks, ctx]), each chunk a fresh request."""
    from pagedkv import SamplingParams

    ctx = tokens.shape[1]
    for index, chunk in enumerate(tokens.tolist()):
        engine.add_request(f"ppl{index}", {"prompt_token_ids": chunk},
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return np.array([[outs[f"ppl{index}"].prompt_logprobs[p][chunk[p]]
                      for p in range(ctx // 2 + 1, ctx)]
                     for index, chunk in enumerate(tokens.tolist())])


def perplexity(logprobs: np.ndarray) -> float:
    return math.exp(-float(logprobs.mean()))


def compare_line(name: str, logprobs: np.ndarray, exact: np.ndarray,
                 anchors: dict[str, np.ndarray] | None = None) -> str:
    """`name`'s perplexity, its distance from the exact one and its ratio to each of `anchors`
    (llama.cpp's runs) with the standard error of that ratio over the scored tokens (paired)."""
    ppl = perplexity(logprobs)
    line = (f"    {name:27} {ppl:8.3f}  {(ppl / perplexity(exact) - 1) * 100:+6.2f}% vs exact, "
            f"mean |dlogp| {np.abs(logprobs - exact).mean():.4f}")
    for anchor_name, anchor in (anchors or {}).items():
        diff = anchor - logprobs
        stderr = diff.std(ddof=1) / math.sqrt(diff.size) * 100
        ratio = ppl / perplexity(anchor)
        line += f"; to {anchor_name} {ratio:.4f} ({(ratio - 1) * 100:+.2f}% +- {stderr:.2f}%)"
    return line


def perplexity_part(bin_dir: Path, model: Path, modes: list[str], ctx: int,
                    threads: int) -> tuple[float, float, float, float | None]:
    """Both engines on the same chunks scored the same way, with the exact perplexity of the
    file's weights (pagedkv float32: every weight dequantized, float32 throughout) beside them.
    Returns the perplexities: exact, llama.cpp's, pagedkv's in the first of `modes`, llama.cpp
    `--no-repack`'s (None where llama.cpp did not repack)."""
    from pagedkv.model.tokenizer import Tokenizer

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as joined:
        text = "\n\n".join(p.read_text() for p in TEXTS)
        joined.write(text)
        joined.flush()
        ref = llama_perplexity(bin_dir, model, Path(joined.name), ctx, threads)
        plain = (llama_perplexity(bin_dir, model, Path(joined.name), ctx, threads, no_repack=True)
                 if ref.repacked else None)
    ours = Tokenizer.from_dir(model).encode(text)[:ref.tokens.size]
    same = ours == ref.tokens.reshape(-1).tolist()
    got = {}
    for mode in dict.fromkeys([*modes, "float32"]):
        engine = pagedkv_engine(model, mode, threads)
        try:
            got[mode] = pagedkv_logprobs(engine, ref.tokens)
        finally:
            engine.shutdown()
    # The lines compare every engine on the tokens each llama.cpp file holds exactly.
    keep = ~ref.floored if plain is None else ~(ref.floored | plain.floored)
    exact = got["float32"][keep]
    left_out = f"; {int((~keep).sum())} below llama.cpp's stored floor left out" \
        if not keep.all() else ""
    print(f"  perplexity: ctx {ctx}, {ref.tokens.shape[0]} chunks, {int(keep.sum())} tokens "
          f"scored (llama-perplexity's tokens and scoring, both engines; pagedkv's tokenizer "
          f"gives {'the same' if same else 'OTHER'} tokens{left_out})")
    print(f"    {'exact (float32 weights)':27} {perplexity(exact):8.3f}")
    print(compare_line("llama.cpp" + (" (repacked)" if ref.repacked else ""),
                       ref.logprobs[keep], exact))
    if plain is not None:
        print(compare_line("llama.cpp --no-repack", plain.logprobs[keep], exact))
    anchors = {"llama.cpp": ref.logprobs[keep]}
    if plain is not None:
        anchors["--no-repack"] = plain.logprobs[keep]
    for mode in modes:
        print(compare_line(f"pagedkv {mode}", got[mode][keep], exact, anchors))
    # The table: each engine's own perplexity over every scored token (llama.cpp's from its log).
    return (perplexity(got["float32"]), ref.ppl, perplexity(got[modes[0]]),
            None if plain is None else plain.ppl)


# ----- serving --------------------------------------------------------------------------------

# Tokens of context a llama-server slot needs: a 256-token prompt and 128 outputs, rounded up.
SLOT_CTX = 512


@dataclass(frozen=True)
class Threads:
    """Each server's compute threads."""

    pagedkv: int
    llama_cpp: int


def llama_server_command(bin_dir: Path, model: Path, port: int, threads: int,
                         slots: int) -> list[str]:
    """llama-server at its best for `slots` concurrent requests: one slot each, continuous
    batching, `threads` for decode and for prompts alike, a context that holds every slot."""
    return [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
            "--port", str(port), "-np", str(slots), "-cb", "-c", str(slots * SLOT_CTX),
            "-t", str(threads), "-tb", str(threads), "-a", "m",
            *(NO_REPACK["llama-server"] if "llama-server" in repack_off else [])]


def pagedkv_server_command(model: Path, mode: str, port: int, threads: int, max_num_seqs: int,
                           step_log: str | None) -> list[str]:
    """`pagedkv serve` on the GGUF in `mode` (of MODES) with `threads` compute threads."""
    dtype, quantization = MODES[mode]
    return [sys.executable, "-m", "pagedkv.cli", "serve", str(model), "--port", str(port),
            "--served-model-name", "m", "--max-num-seqs", str(max_num_seqs),
            "--dtype", dtype, "--quantization", quantization, "--cpu-threads", str(threads),
            "--log-level", "warning", *(["--step-log", step_log] if step_log else [])]


def warm_up(url: str, vocab: int, seed: int) -> None:
    """4 requests of 256 prompt tokens and 8 outputs, prompts of their own (a server's first
    requests carry its one-time costs)."""
    subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "serve", "--url", url, "--model", "m",
         "--num-prompts", "4", "--max-concurrency", "4", "--input-len", "256", "--output-len",
         "8", "--vocab-size", str(vocab), "--seed", str(seed), "--no-progress"],
        capture_output=True, check=True, timeout=600)


def served_point(kind: str, bin_dir: Path, model: Path, threads: Threads, concurrency: int,
                 num_prompts: int, vocab: int, seed: int, step_log: str | None) -> dict:
    """`pagedkv bench serve`'s figures of one load point on a fresh server of `kind`, after a
    warm-up. llama-server gets one slot per concurrent request and is started
    again without weight repacking when it dies by a signal while loading."""
    port = free_port()
    cmd = (llama_server_command(bin_dir, model, port, threads.llama_cpp, concurrency)
           if kind == "llama.cpp" else
           pagedkv_server_command(model, kind.removeprefix("pagedkv "), port, threads.pagedkv,
                                  concurrency, step_log))
    with tempfile.NamedTemporaryFile(prefix=f"llamacpp-vs-{kind}-", suffix=".log") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(proc, f"http://127.0.0.1:{port}", kind, log.name)
            except RuntimeError:
                if (kind != "llama.cpp" or "llama-server" in repack_off
                        or (proc.returncode or 0) >= 0):
                    raise
                print(f"  (llama-server died by {signal.Signals(-proc.returncode).name} while "
                      "loading: serving without weight repacking)", flush=True)
                repack_off.add("llama-server")
                return served_point(kind, bin_dir, model, threads, concurrency, num_prompts,
                                    vocab, seed, step_log)
            url = f"http://127.0.0.1:{port}"
            warm_up(url, vocab, seed + 1)
            return load(url, concurrency, num_prompts, vocab, seed)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serve_part(bin_dir: Path, model: Path, label: str, modes: list[str], threads: Threads,
               concurrencies: list[int], num_prompts: int, rounds: int,
               record_steps: bool) -> None:
    """Both servers at each concurrency, a fresh server per point, rounds alternating which goes
    first; each point's prompts new to both (a seed per round and concurrency, the same for
    both). pagedkv in each of `modes`. Prints each point, the summary with the first mode's
    ratios and, with `record_steps`, pagedkv's steps class by class."""
    vocab = gguf_vocab_size(model)
    kinds = [f"pagedkv {mode}" for mode in modes] + ["llama.cpp"]
    figures: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llamacpp-vs-steps-") as tmp:
        step_logs = {kind: str(Path(tmp) / f"{kind}.jsonl")
                     if record_steps and kind != "llama.cpp" else None for kind in kinds}
        for round_index in range(rounds):
            for c in concurrencies:
                for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                    m = served_point(kind, bin_dir, model, threads, c, num_prompts, vocab,
                                     1000 * (round_index + 1) + c, step_logs[kind])
                    figures.setdefault((kind, c), []).append(m)
                    print(f"  {label} c={c} round {round_index} {kind:16} "
                          f"{m['output_throughput']:8.1f} out tok/s  TPOT "
                          f"{m['tpot_ms']['mean']:6.1f} ms  TTFT {m['ttft_ms']['mean']:7.1f} ms  "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
        print_table(label, kinds, concurrencies, figures, [])
        if record_steps:
            print_step_tables({kind: pagedkv_steps(path) for kind, path in step_logs.items()
                               if path is not None})


# ----- main -----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the SmolLM2 file")
    parser.add_argument("--quant-types", default="Q4_1,Q8_0,Q4_0,Q6_K")
    parser.add_argument("--parts", default="bench,perplexity,serve")
    parser.add_argument("--pagedkv-modes", default="packed,bfloat16",
                        help=f"of {sorted(MODES)}")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=0,
                        help="bench: tg128 alone, after this many tokens of context "
                             "(llama-bench -d)")
    parser.add_argument("--bench-rounds", type=int, default=1,
                        help="bench: rounds alternating which engine goes first, then each "
                             "mode's median ratios")
    parser.add_argument("--ctx", type=int, default=256, help="perplexity chunk length")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2,
                        help="serve: rounds over every point, alternating the servers' order")
    parser.add_argument("--steps", action="store_true",
                        help="serve: record pagedkv's engine steps and print them by class")
    parser.add_argument("--llama-threads", type=int, default=None,
                        help="serve: llama-server's threads (default: --threads)")
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="BUILD_DIR",
                        help="llama.cpp's build for llama-bench, llama-perplexity and "
                             "llama-quantize (default: built in a throwaway folder)")
    parser.add_argument("--llama-server", type=Path, default=None, metavar="BUILD_DIR",
                        help="the build holding llama-server (default: --llama-cpp's)")
    args = parser.parse_args()
    if args.bench_rounds < 1:
        parser.error(f"--bench-rounds must be at least 1, got {args.bench_rounds}")
    if args.gguf is None:
        from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path

        args.gguf = smollm2_gguf_path()
        if args.gguf is None:
            raise SystemExit(f"the real model is not installed: {INSTALL}")
    parts = set(args.parts.split(","))
    bin_dir = llama_cpp_bin(args.llama_cpp, tuple(t for t in TOOLS if t != "llama-server"))
    print(f"CPU: {cpu_name()}; threads: {args.threads}; load: {os.getloadavg()[0]:.1f}; "
          f"llama.cpp: {bin_dir}")
    server_dir = bin_dir
    if "serve" in parts:
        server_dir = llama_cpp_bin(args.llama_server or args.llama_cpp, ("llama-server",))
        llama_threads = args.llama_threads or args.threads
        print(f"serving: llama-server ({server_dir}) -t {llama_threads} -tb {llama_threads} "
              f"-np CONCURRENCY -cb -c CONCURRENCY*{SLOT_CTX} (weights repacked unless it "
              f"crashes); pagedkv serve --cpu-threads {args.threads} --max-num-seqs "
              f"CONCURRENCY in each of --pagedkv-modes (packed: --quantization auto); both on "
              f"CPUs {sorted(os.sched_getaffinity(0))}")
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth: {bandwidth:.1f} GB/s")
    modes = args.pagedkv_modes.split(",")
    ppl_rows: list[tuple[str, float, float, float, float | None]] = []
    for quant_type in args.quant_types.split(","):
        model = quantized_file(bin_dir, args.gguf, quant_type)
        weight_bytes = gguf_weight_bytes(model)
        floor = bandwidth * 1e9 / weight_bytes
        print(f"\n== {quant_type}: {model.name}, {weight_bytes / 2**20:.1f} MiB of weights; "
              f"decode floor {floor:.0f} tok/s at batch 1 (weights over read bandwidth)")
        if "bench" in parts:
            bench_part(bin_dir, model, modes, args.threads, args.reps, floor, weight_bytes,
                       args.depth, args.bench_rounds)
        if "perplexity" in parts:
            ppl_rows.append((quant_type, *perplexity_part(bin_dir, model, modes, args.ctx,
                                                          args.threads)))
        if "serve" in parts:
            serve_part(server_dir, model, quant_type, modes,
                       Threads(args.threads, args.llama_threads or args.threads),
                       [int(c) for c in args.concurrency.split(",")], args.num_prompts,
                       args.rounds, args.steps)
    if ppl_rows:
        print(f"\nperplexity, pagedkv {modes[0]} against llama.cpp (ctx {args.ctx}):")
        print("| type | exact | llama.cpp | pagedkv | ratio | llama.cpp --no-repack | ratio |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for quant_type, exact, ref_ppl, ppl, plain in ppl_rows:
            no_repack = "| | |" if plain is None else f"| {plain:.3f} | {ppl / plain:.4f} |"
            print(f"| {quant_type} | {exact:.3f} | {ref_ppl:.3f} | {ppl:.3f} | "
                  f"{ppl / ref_ppl:.4f} {no_repack}")


if __name__ == "__main__":
    main()
