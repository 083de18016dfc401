"""Torch's prefill attention path (SDPA's flash kernel, which prefill_choice.py picks for
longer chunks) runs oneDNN's brgemm on AMX tiles where the CPU has them, for a chunk after a
cached prefix (a prefix-cache hit: gathered blocks and a mask) as for a fresh one, from 64
query tokens (shorter chunks take the flash kernel's plain loops). Skips on a CPU without AMX;
prints the CPU flag and the kernel oneDNN reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import torch
from pagedkv.model.attention import PrefillChunk, prefill_attention
torch.set_num_threads(1)
cached, n, kvh, heads, d, bs = 64, 128, 2, 4, 64, 16  # brgemm from 64 query tokens
k_cache, v_cache = (torch.randn(kvh, 12, bs, d).bfloat16() for _ in range(2))
k, v = (c.view(kvh, -1, d)[:, cached:cached + n].transpose(0, 1) for c in (k_cache, v_cache))
q = torch.randn(n, heads, d).bfloat16()
prefill_attention(q, k, v, k_cache, v_cache, PrefillChunk(0, n, cached, cached + n,
                  torch.arange(12)), d ** -0.5, None)
"""


def has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_torch_prefill_after_a_prefix_runs_onednn_brgemm_on_amx():
    amx = has_amx()
    print(f"CPU flag amx_bf16: {amx}")
    if not amx:
        pytest.skip("this CPU has no AMX")
    env = {**os.environ, "ONEDNN_VERBOSE": "all"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    log = (done.stdout + done.stderr).splitlines()
    isa = [line for line in log if ",info,cpu,isa:" in line]
    brgemm = [line for line in log if ",ukernel,exec,cpu,brgemm," in line and "bf16" in line]
    print(f"oneDNN: {isa[0] if isa else 'no isa line'}; {len(brgemm)} bfloat16 brgemm calls")
    assert isa and "AMX" in isa[0]
    assert brgemm  # the flash kernel's products: oneDNN brgemm, on AMX where oneDNN's ISA has it
