"""The CPU linears of the benchmark model, by path: oneDNN's pre-packed linear against our
`panel_linear` in this machine's build and in the AVX2 build (`PAGEDKV_CPU_ISA=avx2`, the code a
Zen 3 runs); and the model's own Linear (a module call around the kernel) two ways: "before",
every call on the panels (PAGEDKV_KERNEL_CHOICE=panel), and "chosen", each call on the kernel
that kernels/choice.py measured fastest for its rows bucket (the table is printed).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_panel_linear.py [--dtypes bfloat16,float32]
        [--rows 1,4,8,16,64,256,512,2048] [--rounds 3] [--threads N] [--no-avx2] [--json]

The weights are the linears of bench_offline.py's model (hidden 512, intermediate 1408, 8 heads
of 64, 4 KV heads: qkv, o, gate_up, down) for each of its 8 layers, so a pass streams every
weight from memory as a decode step does (1 layer at 2,048 rows: a pass is compute). A pass's
time is the sum over its linears of each one's fastest call (30 calls each, 5 at 2,048 rows; the
paths alternate call by call, after one untimed call each): robust on a shared machine, where
most calls get interrupted.
With --threads 1 a call's time is this thread's CPU time (time.thread_time), which leaves out
the time other processes held the core (not what they do to the caches).
The AVX2 build runs in a child process; the rounds alternate parent and child. Prints ms per pass per path,
each path's ratio to oneDNN's (above 1: faster), and the load average (a shared machine shows
there). Needs the fused kernels built (they are, on first use: about a minute per build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS, LAYERS = 512, 1408, 64, 8, 4, 8
SHAPES = [(HEAD_DIM * (HEADS + 2 * KV_HEADS), HIDDEN), (HIDDEN, HEAD_DIM * HEADS),
          (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [N, K] of qkv, o, gate_up, down


def best_pass_ms(paths: dict[str, list], xs: dict[int, torch.Tensor], reps: int) -> dict:
    """{path: ms}: for each path's linears (k, fn), the fastest of `reps` calls of fn(x of
    width k) each, summed. Paths alternate call by call, so a busy moment hits them alike; the
    fastest call of each linear is the one no other process interrupted."""
    # One thread computes in this thread: its CPU time leaves out the time other processes ran.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = {path: [float("inf")] * len(fns) for path, fns in paths.items()}
    for fns in paths.values():  # untimed: the allocator's first big outputs fault their pages in
        for k, fn in fns:
            fn(xs[k])
    for _ in range(reps):
        for i in range(len(next(iter(paths.values())))):
            for path, fns in paths.items():
                k, fn = fns[i]
                start = clock()
                fn(xs[k])
                best[path][i] = min(best[path][i], clock() - start)
    return {path: 1e3 * sum(times) for path, times in best.items()}


def measure(dtype_name: str, rows_list: list[int], paths: list[str]) -> dict:
    """{path: {rows: ms}} for this process's build; paths among "onednn", "panel", "before"
    and "chosen"."""
    from pagedkv.kernels.cpu import ensure_cpu_kernels
    from pagedkv.model.cpu_memory import keep_freed_memory

    ensure_cpu_kernels("wait")
    keep_freed_memory()  # the engine's malloc settings: no page faults for each new output
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) / k ** 0.5
               for _ in range(LAYERS) for n, k in SHAPES]
    made = {"onednn": lambda w: (lambda x, p=torch.ops.mkldnn._reorder_linear_weight(w, 64):
                                 torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")),
            "panel": lambda w: (lambda x, p=torch.ops.pagedkv_cpu.pack_panels(w), n=w.shape[0]:
                                torch.ops.pagedkv_cpu.panel_linear(x, p, n, None)),
            "before": lambda w: model_linear(w, "panel"),
            "chosen": lambda w: model_linear(w, "measure")}
    fns = {path: [(w.shape[1], made[path](w)) for w in weights] for path in paths}
    out: dict = {path: {} for path in paths}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
        layer_fns = {p: f if rows <= 128 else f[:len(SHAPES)] for p, f in fns.items()}
        for path, ms in best_pass_ms(layer_fns, xs, 30 if rows <= 128 else 5).items():
            out[path][rows] = ms
    return out


def model_linear(w: torch.Tensor, choice_mode: str) -> torch.nn.Module:
    """The model's Linear of weight `w`, packed as the runner packs it once the kernels load,
    under PAGEDKV_KERNEL_CHOICE=`choice_mode`."""
    from pagedkv.kernels.choice import ENV
    from pagedkv.model.layers import Linear

    layer = Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    saved = os.environ.get(ENV)
    os.environ[ENV] = choice_mode
    try:
        layer.pack(panels=True)
    finally:
        if saved is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = saved
    return layer


def child(dtype_name: str, rows_list: list[int]) -> dict:
    """The AVX2 build's panel path, measured in a child process (one library per process)."""
    env = dict(os.environ, PAGEDKV_CPU_ISA="avx2")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys, torch; sys.path.insert(0, {here!r}); import bench_panel_linear as b; "
            f"torch.set_num_threads({torch.get_num_threads()}); "
            f"print('RESULT', json.dumps(b.measure({dtype_name!r}, {rows_list!r}, ['panel'])['panel']))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1200, check=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {int(r): ms for r, ms in json.loads(line[len("RESULT "):]).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,4,8,16,64,256,512,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-avx2", action="store_true", help="leave out the AVX2 build")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedkv.bench.machine import cpu_name
    from pagedkv.kernels import choice
    from pagedkv.kernels.cpu import ensure_cpu_kernels

    ensure_cpu_kernels("wait")
    isa = torch.ops.pagedkv_cpu.panel_isa()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; this build's panels: {isa}; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    report = {}
    for dtype_name in args.dtypes.split(","):
        best: dict = {}
        for _ in range(args.rounds):
            runs = measure(dtype_name, rows_list, ["onednn", "panel", "before", "chosen"])
            if not args.no_avx2:
                runs["panel avx2"] = child(dtype_name, rows_list)
            for path, by_rows in runs.items():
                for rows, ms in by_rows.items():
                    best.setdefault(path, {})[rows] = min(ms, best.get(path, {}).get(rows, 1e9))
        best[f"panel {isa}"] = best.pop("panel")
        best["before"], best["chosen"] = best.pop("before"), best.pop("chosen")
        report[dtype_name] = best
        print(f"[{dtype_name}] ms per pass (8 layers' 4 linears; 1 layer at >128 rows), fastest "
              f"of {args.rounds} rounds; ratio = oneDNN's time / the path's")
        for rows in rows_list:
            base = best["onednn"][rows]
            cells = "  ".join(f"{path} {best[path][rows]:7.3f} ({base / best[path][rows]:.2f}x)"
                              for path in best)
            print(f"  rows {rows:5d}: {cells}  | chosen / before: "
                  f"{best['before'][rows] / best['chosen'][rows]:.2f}x", flush=True)
        print(f"  chosen: {choice.describe_choice()}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
