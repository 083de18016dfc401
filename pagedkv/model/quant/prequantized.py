"""GPTQ and AWQ checkpoints: a Hugging Face model folder whose linears are stored pre-quantized.

config.json's `quantization_config` names the method; each quantized linear `X` is stored as
`X.qweight` (int32 words of 32 / bits codes each), `X.qzeros` (the zero points, packed the same
way along the output features), `X.scales` (float16 [groups, out_features]) and, for GPTQ,
`X.g_idx` (the group of each input feature), in place of `X.weight`. Per input feature k and
output feature n, with g the group of k:

    weight[n, k] = scales[g, n] * (code[k, n] - zero[g, n])

The two layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them:
- GPTQ: qweight [K * bits / 32, N], word i of column n holding codes 32 / bits * i ... of
  that column from its low bits up; qzeros [G, N * bits / 32], word c of a row holding the
  zero points of columns 32 / bits * c ... likewise. A `checkpoint_format` "gptq" (the default,
  "v1") file stores each zero point minus one (the reader adds it back per code, as vLLM's and
  exllama's kernels do); "gptq_v2" stores it as it is.
- AWQ (`version` "gemm"): qweight [K, N / 8] and qzeros [G, N / 8], 4-bit codes packed along the
  output features in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i of word c holds column 8 c +
  AWQ_ORDER[i]); zero points as they are; groups of `group_size` consecutive input features.

Two uses (the loader picks, as for a GGUF file): `DequantizedState` presents such a checkpoint
to the loader with each `X.weight` dequantized exactly to float32 (every bit width here, any
group layout; a GPU, float32, quantization "none"), and `prequantized_int4_linear` builds a
4-bit linear as an `Int4Linear` on its codes, never dequantized: a group of 32 takes the
scale s of its GPTQ / AWQ group and the offset -zero * s (both exact in float32), so the
packed weight equals the dequantized one. A 4-bit linear packs when each group is a whole
number of runs of 32 input features and its shape fits the int4 kernel; GPTQ's `desc_act`
checkpoints, whose g_idx deals the input features to the groups in a permuted order, pack with
the features sorted by group (`PermutedInt4Linear`: the activations' columns gathered into that
order first), where the fused parts share one order (q/k/v and gate/up quantized on the same
inputs do); the others stay dequantized, with a warning. A down_proj's order is folded into
its gate_up's output rows instead (`fold_act_orders`: no gather of the MLP's widest input).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.model.decode_stack import LinearCall
from pagedkv.model.quant.int4_blocks import GROUP, pack_group_codes
from pagedkv.model.quant.int4_linear import Int4Linear

METHODS = ("gptq", "awq")
GPTQ_BITS = (2, 4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_WEIGHT = ".weight"


def method_named(method: str) -> str:
    """A method's name with its article, for messages: "a GPTQ", "an AWQ"."""
    return f"{'an' if method == 'awq' else 'a'} {method.upper()}"


@dataclass(frozen=True)
class PrequantizedFormat:
    """What a checkpoint's quantization_config says about how its linears are stored."""

    method: str            # "gptq" or "awq"
    bits: int
    group_size: int        # input features a group; -1: one group a row
    zero_minus_one: bool   # GPTQ v1: each zero point stored minus one

    def describe(self) -> str:
        group = "one group a row" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"{self.method.upper()} {self.bits}-bit, {group}"


def prequantized_format(config: dict[str, Any], model: str | Path) -> PrequantizedFormat | None:
    """The storage format config.json's `quantization_config` declares, or None without one.
    ValueError naming the method or field pagedkv does not read (FP8, bitsandbytes, a GPTQ
    Marlin file, AWQ's GEMV layout, a bit width without a reader ...)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else quant
    method = method.lower() if isinstance(method, str) else method
    if method not in METHODS:
        raise ValueError(
            f"{model} is a pre-quantized checkpoint (config.json's quantization_config, "
            f"quant_method {method!r}), which pagedkv does not load (it reads GPTQ and AWQ "
            f"checkpoints): give the model's float16, bfloat16 or float32 checkpoint "
            f"(--quantization int8 packs its linears at load) or a GGUF file of it")

    def unsupported(field: str, value: Any, supported: str) -> ValueError:
        return ValueError(f"{model}: the {method.upper()} checkpoint's quantization_config has "
                          f"{field} {value!r}, which pagedkv does not read ({supported})")

    bits = quant.get("bits", quant.get("w_bit", 4))
    group_size = quant.get("group_size", quant.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or \
            (group_size != -1 and group_size < 1):
        raise unsupported("group_size", group_size, "a positive integer, or -1")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise unsupported("version", quant.get("version"), "'gemm'")
        if bits != 4:
            raise unsupported("bits", bits, "4")
        if quant.get("zero_point", True) is not True:
            raise unsupported("zero_point", quant.get("zero_point"), "true")
        return PrequantizedFormat("awq", 4, group_size, False)
    if bits not in GPTQ_BITS:
        raise unsupported("bits", bits, ", ".join(map(str, GPTQ_BITS)))
    form = str(quant.get("checkpoint_format", "gptq")).lower()
    if form not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
        raise unsupported("checkpoint_format", quant.get("checkpoint_format", "marlin"),
                          "'gptq' or 'gptq_v2'")
    return PrequantizedFormat("gptq", bits, group_size, form == "gptq")


@dataclass
class StoredLinear:
    """One quantized linear's stored tensors (`g_idx` None where the file has none)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [..., W] -> their codes [..., W, 32 / bits] from the low bits up."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return (words.view(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)


def unpack_linear(fmt: PrequantizedFormat, stored: StoredLinear, name: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K] (uint8), zero points [G, N] (int32, v1's one added back), scales float32
    [G, N] and each input feature's group [K] (int64) of linear `name`. ValueError naming it
    when the tensors' shapes disagree with each other or with the format."""
    scales = stored.scales.float().numpy()
    groups, n = scales.shape
    qweight = stored.qweight.numpy()
    per_word = 32 // fmt.bits
    if fmt.method == "awq":
        codes = _unpack(qweight, 4)[..., np.argsort(AWQ_ORDER)].reshape(qweight.shape[0], -1).T
        zeros = _unpack(stored.qzeros.numpy(), 4)[..., np.argsort(AWQ_ORDER)]
    else:
        codes = _unpack(qweight, fmt.bits).transpose(0, 2, 1).reshape(-1, qweight.shape[1]).T
        zeros = _unpack(stored.qzeros.numpy(), fmt.bits)
    zeros = zeros.reshape(zeros.shape[0], -1)[:, :n].astype(np.int32) + int(fmt.zero_minus_one)
    k = codes.shape[1]
    if codes.shape[0] != n or zeros.shape != (groups, n):
        raise ValueError(f"{name}: qweight {list(qweight.shape)}, qzeros "
                         f"{list(stored.qzeros.shape)} and scales {[groups, n]} disagree "
                         f"({fmt.describe()}, {per_word} codes an int32)")
    size = k if fmt.group_size == -1 else fmt.group_size
    if stored.g_idx is not None:
        group_of = stored.g_idx.numpy().astype(np.int64)
        if group_of.shape != (k,) or group_of.min(initial=0) < 0 or \
                group_of.max(initial=0) >= groups:
            raise ValueError(f"{name}: g_idx of shape {list(stored.g_idx.shape)} does not give "
                             f"each of the {k} input features one of the {groups} groups")
    else:
        group_of = np.arange(k) // size
        if -(-k // size) != groups:
            raise ValueError(f"{name}: {k} input features in groups of {size} are "
                             f"{-(-k // size)} groups, but scales has {groups}")
    return np.ascontiguousarray(codes.astype(np.uint8)), zeros, scales, group_of


def dequantize_linear(fmt: PrequantizedFormat, stored: StoredLinear, name: str) -> torch.Tensor:
    """weight [N, K] float32 = scale * (code - zero), each value exact (a code and a zero point
    of at most 8 bits times a float16 scale)."""
    codes, zeros, scales, group_of = unpack_linear(fmt, stored, name)
    zero = zeros.T[:, group_of].astype(np.float32)
    return torch.from_numpy((codes.astype(np.float32) - zero) * scales.T[:, group_of])


def int4_groups(fmt: PrequantizedFormat, stored: StoredLinear, name: str
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Linear `name` as Int4Linear's parts, codes uint8 [N, K] and per group of 32 a scale and
    an offset float32 [N, K / 32] (weight = code * scale + offset: scale * (code - zero)
    exactly), and the order of its input features they are in: None where it is the stored
    one; else (GPTQ's `desc_act`, a g_idx whose groups are not runs of consecutive features)
    the features sorted by group, the codes' columns in that order. None where a group is
    not a whole number of runs of 32 (a group size off a multiple of 32) or the codes are not
    4-bit."""
    if fmt.bits != 4:
        return None
    codes, zeros, scales, group_of = unpack_linear(fmt, stored, name)
    k = codes.shape[1]
    if k % GROUP:
        return None
    order = None
    if not (group_of.reshape(-1, GROUP) == group_of.reshape(-1, GROUP)[:, :1]).all():
        order = np.argsort(group_of, kind="stable")
        codes, group_of = np.ascontiguousarray(codes[:, order]), group_of[order]
    of32 = group_of.reshape(-1, GROUP)
    if not (of32 == of32[:, :1]).all():
        return None
    group = of32[:, 0]
    scale = np.ascontiguousarray(scales.T[:, group])
    return codes, scale, -zeros.T[:, group].astype(np.float32) * scale, order


class PermutedInt4Linear(Int4Linear):
    """An Int4Linear whose codes' columns are the input features in `order` (a GPTQ act-order
    linear, its groups made runs of 32): y = x[..., order] W'^T, the gather and the product
    one op with the fused kernels loaded (`int4_linear_gathered`, which the decode stack runs
    too)."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                 bias: torch.Tensor | None, order: np.ndarray) -> None:
        super().__init__(codes, scale, offset, bias)
        self.register_buffer("order", torch.from_numpy(order.astype(np.int64)), persistent=False)

    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, self.product_rows_for(x.dtype))

    def _forward_without_kernels(self, x: torch.Tensor) -> torch.Tensor:
        return super()._forward_without_kernels(x[..., self.order])

    def _call(self, x: torch.Tensor, product_rows: int) -> torch.Tensor:
        return torch.ops.pagedkv_cpu.int4_linear_gathered(x, self.order, self.codes,
                                                          self.scales, self.bias, product_rows)

    def decode_call(self, rows: int) -> LinearCall:
        return LinearCall("pagedkv_cpu::int4_linear_gathered",
                          (self.order, self.codes, self.scales, self.bias),
                          (self.route.last(),))

    def _in_stored_order(self, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(w)
        out[:, self.order] = w
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`, its columns the input features in their own order."""
        return self._in_stored_order(super().dequantized(dtype))

    def dequantized_reference(self, dtype: torch.dtype) -> torch.Tensor:
        return self._in_stored_order(super().dequantized_reference(dtype))


def fold_act_orders(model: torch.nn.Module) -> None:
    """Before the weights are read: where a gated MLP's down_proj is a PermutedInt4Linear and its
    gate_up_proj packed (an Int4Linear, without a bias): reorder gate_up's output rows (gate's
    and up's alike) into down's input order, so the elementwise product between them comes out in that order, and make down a plain
    Int4Linear on the same codes (mutates `model`; the same function, exactly, with no gather
    of the MLP's widest activations)."""
    for mlp in model.modules():
        down, gate_up = getattr(mlp, "down_proj", None), getattr(mlp, "gate_up_proj", None)
        if not (isinstance(down, PermutedInt4Linear) and isinstance(gate_up, Int4Linear)) \
                or gate_up.bias is not None:  # (a bias is read later, in the stored order)
            continue
        width = down.in_features
        rows = torch.cat((down.order, width + down.order))
        with torch.no_grad():
            for param in (gate_up.codes, gate_up.scales):
                param.copy_(param[rows])
        mlp.down_proj = Int4Linear(down.codes, None, None, down.bias, table=down.scales)


def stored_linear(state: Any, prefix: str) -> StoredLinear:
    """The stored tensors of the quantized linear `prefix` (e.g. `model.layers.0.mlp.up_proj`)
    in `state` (a checkpoint's tensors by name: `in` and `[name]`)."""
    g_idx = f"{prefix}.g_idx"
    return StoredLinear(state[f"{prefix}.qweight"], state[f"{prefix}.qzeros"],
                        state[f"{prefix}.scales"],
                        state[g_idx] if g_idx in state else None)  # noqa: SIM401 (no .get)


def prequantized_int4_linear(fmt: PrequantizedFormat, state: Any, sources: list[str],
                             in_features: int, bias: torch.Tensor | None) -> Int4Linear | None:
    """The linear on `in_features` whose weight is `sources` (`X.weight` names in `state`, their rows
    concatenated: q/k/v, gate/up) as one Int4Linear on their stored codes, or None where a
    source is stored unquantized, does not pack (`int4_groups`) or the rows are not a multiple
    of 16. `bias`: the layer's bias parameter (or None), whose shape the new module's takes,
    zero until the weights are loaded."""
    prefixes = [s.removesuffix(_WEIGHT) for s in sources]
    if not all(s.endswith(_WEIGHT) and f"{p}.qweight" in state
               for s, p in zip(sources, prefixes, strict=True)):
        return None
    parts = [int4_groups(fmt, stored_linear(state, p), p) for p in prefixes]
    if any(part is None for part in parts):
        return None
    codes, scale, offset = (np.concatenate([p[i] for p in parts]) for i in range(3))
    orders = [part[3] for part in parts]
    if codes.shape[0] % 16 or codes.shape[1] != in_features:
        return None
    bias = None if bias is None else torch.zeros_like(bias)
    packed = pack_group_codes(codes, 4)
    if all(order is None for order in orders):
        return Int4Linear(packed, scale, offset, bias)
    if any(order is None or not np.array_equal(order, orders[0]) for order in orders):
        return None  # fused parts in different act orders (one gather cannot serve them)
    return PermutedInt4Linear(packed, scale, offset, bias, orders[0])


class DequantizedState:
    """A checkpoint's tensors (`state`: `in`, `[name]`, `shape(name)` and `keys()`, as the
    loader's lazy reader answers them) with each quantized linear `X` also shown as
    `X.weight`, dequantized to float32 when asked for (`dequantize_linear`); `quantized`: the
    names X."""

    def __init__(self, state: Any, fmt: PrequantizedFormat) -> None:
        self._state, self._fmt = state, fmt
        self.quantized = {name.removesuffix(".qweight") for name in state.keys()  # noqa: SIM118
                          if name.endswith(".qweight")}

    def _prefix(self, name: str) -> str | None:
        prefix = name.removesuffix(_WEIGHT)
        return prefix if name.endswith(_WEIGHT) and prefix in self.quantized else None

    def __contains__(self, name: str) -> bool:
        return self._prefix(name) is not None or name in self._state

    def __getitem__(self, name: str) -> torch.Tensor:
        prefix = self._prefix(name)
        if prefix is None:
            return self._state[name]
        stored = stored_linear(self._state, prefix)
        return dequantize_linear(self._fmt, stored, prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        prefix = self._prefix(name)
        if prefix is None:
            return self._state.shape(name)
        groups, n = self._state.shape(f"{prefix}.scales")
        rows = self._state.shape(f"{prefix}.qweight")[0]
        return n, rows if self._fmt.method == "awq" else rows * 32 // self._fmt.bits
