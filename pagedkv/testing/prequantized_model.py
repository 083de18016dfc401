"""A tiny float32 model folder rewritten as a GPTQ or AWQ checkpoint, as AutoGPTQ / GPTQModel
and AutoAWQ write them, with the float32 weights its codes stand for (the reference).

Each linear of the decoder layers (q, k, v, o, gate, up, down) is quantized per group of
`group_size` input features (asymmetric, min to max: scale = (max - min) / (2^bits - 1), a
zero point, codes clamped), its codes packed into int32 words bit by bit the way the writers'
own loops do (GPTQ: along the input features; AWQ: along the output features in the order 0, 2,
4, 6, 1, 3, 5, 7), zero points likewise (GPTQ v1: stored minus one). With `desc_act`, GPTQ's
act-order: the input features join groups in a random order, given per feature by g_idx, one
order per input (q/k/v share theirs, as gate/up do: GPTQ orders the features by the inputs'
statistics), or one per linear with `shared_order=False`.
The reference weight is scale * (code - zero), computed here in float64 from the unpacked
values, not from the packed words.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Linears quantized on the same input (one act order between them).
SHARED_INPUT = {"q_proj": "attention input", "k_proj": "attention input",
                "v_proj": "attention input", "gate_proj": "MLP input", "up_proj": "MLP input"}


def _quantize(w: np.ndarray, members: list[np.ndarray], bits: int, min_zero: int, sym: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K] of w [N, K]; scales (float16) and zero points [G, N] per group of input
    features (`members[g]`: the features of group g), zero points at least `min_zero`; `sym`:
    GPTQ's symmetric grid, every zero point 2^(bits - 1)."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    codes = np.zeros(w.shape, np.int64)
    scales = np.zeros((len(members), n), np.float16)
    zeros = np.zeros((len(members), n), np.int64)
    for g, cols in enumerate(members):
        block = w[:, cols].astype(np.float64)
        lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        scale = np.maximum(hi - lo, 1e-6) / maxq
        scales[g] = scale.astype(np.float16)
        s = scales[g].astype(np.float64)
        zeros[g] = (maxq + 1) // 2 if sym else np.clip(np.round(-lo / s), min_zero, maxq)
        codes[:, cols] = np.clip(np.round(block / s[:, None]) + zeros[g][:, None], 0, maxq)
    return codes, scales, zeros


def _pack_gptq_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """values [R, C] -> int32 [R * bits / 32, C]: word i of a column holds rows per * i + j
    at bits bits * j."""
    per = 32 // bits
    out = np.zeros((values.shape[0] // per, values.shape[1]), np.uint32)
    for i in range(out.shape[0]):
        for j in range(per):
            out[i] |= (values[per * i + j].astype(np.uint32) & ((1 << bits) - 1)) << (bits * j)
    return out.view(np.int32)


def _pack_columns(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None
                  ) -> np.ndarray:
    """values [R, C] -> int32 [R, C * bits / 32]: word c of a row holds columns per * c +
    order[j] at bits bits * j."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((values.shape[0], values.shape[1] // per), np.uint32)
    for c in range(out.shape[1]):
        for j in range(per):
            out[:, c] |= (values[:, per * c + order[j]].astype(np.uint32)
                          & ((1 << bits) - 1)) << (bits * j)
    return out.view(np.int32)


def write_prequantized(model_dir: Path, out: Path, method: str, *, group_size: int = 32,
                       bits: int = 4, desc_act: bool = False, shared_order: bool = True,
                       sym: bool = False, checkpoint_format: str = "gptq", lm_head: bool = False,
                       own_file: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """`model_dir` as a `method` ("gptq" or "awq") checkpoint in folder `out` (GPTQ options:
    `bits`, `desc_act`, `sym`, `checkpoint_format` "gptq" or "gptq_v2"; `lm_head`: quantize the
    LM head too, as GPTQModel's `lm_head=True` does; `own_file`: the settings in the file older
    writers put them in, AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json with
    its own key names, config.json without a quantization_config); returns the
    float32 weight [N, K] each quantized linear's stored tensors stand for, by its
    `X.weight` name."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    reference, stored = {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        kinds = QUANTIZED + (("lm_head",) if lm_head else ())
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in kinds):
            stored[name] = tensor
            continue
        w = tensor.float().numpy()
        k = w.shape[1]
        size = k if group_size == -1 else group_size
        role = SHARED_INPUT.get(prefix.rsplit(".", 1)[-1], prefix) if shared_order else prefix
        order = np.arange(k) if not desc_act else orders.setdefault(
            (prefix.rsplit(".", 2)[0], role), rng.permutation(k))
        members = [np.sort(order[i:i + size]) for i in range(0, k, size)]
        # (a v1 file stores zero points minus one: it cannot hold 0)
        v1 = method == "gptq" and checkpoint_format == "gptq"
        codes, scales, zeros = _quantize(w, members, bits, min_zero=int(v1), sym=sym)
        group_of = np.zeros(k, np.int32)
        for g, cols in enumerate(members):
            group_of[cols] = g
        reference[name] = torch.from_numpy(
            (scales[group_of].T.astype(np.float64) * (codes - zeros[group_of].T))
            .astype(np.float32))
        if method == "awq":
            qweight = _pack_columns(codes.T, 4, AWQ_PACK_ORDER)
            qzeros = _pack_columns(zeros, 4, AWQ_PACK_ORDER)
        else:
            qweight = _pack_gptq_rows(codes.T, bits)
            qzeros = _pack_columns(zeros - (checkpoint_format == "gptq"), bits)
            stored[f"{prefix}.g_idx"] = torch.from_numpy(group_of)
        stored[f"{prefix}.qweight"] = torch.from_numpy(qweight)
        stored[f"{prefix}.qzeros"] = torch.from_numpy(qzeros)
        stored[f"{prefix}.scales"] = torch.from_numpy(scales)
    save_file(stored, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    quant = {"quant_method": method, "bits": bits, "group_size": group_size}
    quant |= {"version": "gemm", "zero_point": True} if method == "awq" else \
        {"desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
         "lm_head": lm_head}
    if own_file and method == "awq":
        settings = {"zero_point": True, "q_group_size": group_size, "w_bit": bits,
                    "version": "GEMM"}
        (out / "quant_config.json").write_text(json.dumps(settings))
    elif own_file:
        settings = {k: v for k, v in quant.items() if k not in ("quant_method",
                                                                "checkpoint_format")}
        (out / "quantize_config.json").write_text(json.dumps(settings))
    else:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))
    return reference


def write_reference(model_dir: Path, out: Path, reference: dict[str, torch.Tensor]) -> Path:
    """`model_dir` with its quantized linears' weights replaced by `reference` (float32): the
    float checkpoint a GPTQ / AWQ file of it stands for."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors") | reference
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out
