"""Building blocks of the Llama family: RMSNorm, rotary embeddings (default, linear, llama3), MLP.

Numerics follow transformers' implementations (RMSNorm in float32, RoPE angles in float32 then
cast to the activation dtype) so float32 results match to rounding; the fast paths below (in-place
steps, one RoPE call for q and k together) round exactly as transformers' op sequence does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.kernels import choice
from pagedkv.kernels.cpu import PANELS_BEAT_ONEDNN_BF16, panel_isa
from pagedkv.model.decode_stack import LinearCall
from pagedkv.model.ops import LayerOps, RopeInputs, rms_norm_reference


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * normalised x (a new tensor), the reference rounding (ops.rms_norm_reference);
        on CUDA, rows of a 2-D x: one fused kernel (fused_ops.py). Layers call LayerOps
        instead, which also has the fused CPU kernel and the residual add."""
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
            from pagedkv.model.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for RoPE with optional linear/llama3 scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table that grows on demand.

    The sin table is stored "signed" (first half negated) so that RoPE (ops.py) needs no
    negation: x * cos + swap_halves(x) * signed_sin equals transformers'
    x * cos + rotate_half(x) * sin bit for bit (a sign flip is exact)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._table_len = 0
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._max_positions = max_positions

    def _table(self, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or needed > self._table_len or self._cos.dtype != dtype:
            n = max(needed, self._max_positions, self._table_len)
            pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq)
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            self._cos = torch.cat((cos, cos), dim=-1)
            self._sin = torch.cat((-sin, sin), dim=-1)
            self._table_len = n
        return self._cos, self._sin

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The step's RoPE inputs for `positions` [T] in `dtype` (the tables grow on demand;
        see the class docstring for the sign convention)."""
        if (positions.device.type != "cpu" and self._cos is not None and self._cos.dtype == dtype
                and self._table_len >= self._max_positions):
            # No host sync (CUDA graphs): positions stay below max_positions (max_model_len).
            cos, sin = self._cos, self._sin
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 1
            cos, sin = self._table(needed, dtype)
        return RopeInputs(positions, cos, sin)

def onednn_bf16_available(weight: torch.Tensor) -> bool:
    """True when `weight` can use oneDNN's pre-packed bfloat16 linear (CPU, bfloat16, a torch
    built with oneDNN on a CPU with native bfloat16 support, e.g. AVX512-BF16 or AMX)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def isa_rule(weight: torch.Tensor) -> str:
    """The instruction-set rule's kernel for `weight` with the fused CPU kernels loaded:
    "panel", except bfloat16 where oneDNN has native bfloat16 and the build's panels do not
    (kernels.cpu.PANELS_BEAT_ONEDNN_BF16)."""
    if onednn_bf16_available(weight) and panel_isa() not in PANELS_BEAT_ONEDNN_BF16:
        return "onednn"
    return "panel"


def use_panels(weight: torch.Tensor) -> bool:
    """Whether the instruction-set rule (`isa_rule`) runs `weight` through panel_linear."""
    return isa_rule(weight) == "panel"


def onednn_takes(weight: torch.Tensor) -> bool:
    """Whether oneDNN's pre-packed linear takes `weight` natively: float32 (torch built with
    oneDNN), bfloat16 where oneDNN has native bfloat16 (`onednn_bf16_available`)."""
    return onednn_bf16_available(weight) or (weight.device.type == "cpu"
                                             and weight.dtype == torch.float32
                                             and torch.backends.mkldnn.is_available())


@functools.cache
def onednn_linear_ops() -> bool:
    """Whether this torch has oneDNN's pre-packed linear ops (`pack_onednn`, `Linear.forward`)."""
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` pre-packed for oneDNN's linear, or None where this torch cannot."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except (AttributeError, RuntimeError):
        return None


class Linear(nn.Linear):
    """nn.Linear whose weight can be prepared once for the CPU (CPU only; `pack`).

    - With the fused CPU kernels loaded (`pack(panels=True)`, the runner's call once they are):
      each rows bucket of the layer's shape class runs the kernel that kernels/choice.py
      measured fastest on this CPU (or a forced one, PAGEDKV_KERNEL_CHOICE), among:
      `pagedkv_cpu::panel_linear` (kernels/csrc/panel_linear.cpp), the weight re-laid in panels of 16
      output columns, float32 accumulation in registers while each panel streams past once
      (float32, and bfloat16/float16 kept at 16 bits, widened in registers exactly, or paired
      into vdpbf16ps where the build has AVX512-BF16; 8 lanes with AVX2, 16 with AVX-512); and
      oneDNN's pre-packed linear, for the dtypes oneDNN takes natively (float32; bfloat16 with
      AVX512-BF16 or AMX, whose tiles make it the faster one from about 8 rows on an Intel
      CPU with AMX, while the panels win at decode sizes and, on AMD Zen 4/5, throughout);
      and oneDNN's matmul on the weight transposed once to [in, out] (torch.mm), which beats
      the pre-packed linear for a prefill's wide products on AMX (gate_up at 1,536 rows).
      The call picks by its rows (`choice.rows_route`: one tuple lookup); a weight keeps only
      the copies its buckets use. Results differ from F.linear's only in float32 summation
      order (and one rounding to a 16-bit activation dtype at the end).
    - Otherwise, float32, and bfloat16 where oneDNN has native bfloat16 (AVX512-BF16 or AMX):
      pre-packed for oneDNN (a second copy), 1.3-2x MKL's F.linear at decode sizes.
    - bfloat16 / float16 without native 16-bit dot products and without the kernels: a float32
      copy of the weight, the product in float32 on the exactly widened activations, rounded
      once at the end (the same result as a 16-bit matmul with float32 accumulation).
    The prepared copy is not updated if `weight` changes: call `pack()` again after.
    """

    _packed: torch.Tensor | None = None
    _widened: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _panels: torch.Tensor | None = None
    # With both copies: whether panels run, by min(rows, choice.ROUTE_LAST); else None.
    _panel_rows: tuple[bool, ...] | None = None
    # The weight as [in, out] for oneDNN's matmul, and whether it runs, by min(rows, ROUTE_LAST).
    _matmul: torch.Tensor | None = None
    _matmul_rows: tuple[bool, ...] | None = None

    def pack(self, panels: bool = False) -> bool:
        """Prepare the current weight as above (mutates self; `panels` needs the fused CPU
        kernels loaded); returns whether forward now uses a prepared copy."""
        self._packed, self._widened, self._panels, self._panel_rows = None, None, None, None
        self._matmul, self._matmul_rows = None, None
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if panels:
            self._pack_chosen(w)
            return True
        if onednn_takes(w):
            self._packed = pack_onednn(w)
            if self._packed is not None:
                return True
        if w.dtype == torch.float32:
            return False
        bias = None if self.bias is None else self.bias.detach().float()
        self._widened = (w.float(), bias)
        return True

    def _pack_chosen(self, w: torch.Tensor) -> None:
        """Prepare the copies of the kernels `choice.choose_linear` picks for w's rows buckets."""
        builders = {"panel": lambda: torch.ops.pagedkv_cpu.pack_panels(w),
                    "onednn": lambda: pack_onednn(w), "matmul": lambda: w.t().contiguous()}
        made: dict[str, Any] = {}

        def copy(kernel: str) -> Any:
            if kernel not in made:
                made[kernel] = builders[kernel]()
            return made[kernel]

        def make(kernel: str) -> Any:
            p = copy(kernel)
            if kernel == "panel":
                return lambda x: torch.ops.pagedkv_cpu.panel_linear(x, p, self.out_features,
                                                                     self.bias)
            if kernel == "matmul":
                return lambda x: self._mm(x, p)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, p, self.bias, "none", [], "")

        available = ("panel", "onednn", "matmul") if onednn_takes(w) and onednn_linear_ops() \
            else ("panel",)
        shape = choice.shape_class(w.dtype, self.out_features, self.in_features,
                                   self.bias is not None)
        per_bucket = choice.choose_linear(shape, w.dtype, self.in_features, make, available,
                                          isa_rule(w))
        route = choice.rows_route(per_bucket)
        self._panels = copy("panel") if "panel" in per_bucket else None
        self._packed = copy("onednn") if "onednn" in per_bucket else None
        if self._panels is not None and self._packed is not None:
            self._panel_rows = tuple(k == "panel" for k in route)
        if "matmul" in per_bucket:
            self._matmul = copy("matmul")
            self._matmul_rows = tuple(k == "matmul" for k in route)

    def _mm(self, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        """x @ wt (+ bias): oneDNN's matmul for the weight transposed to [in, out]."""
        return torch.mm(x, wt) if self.bias is None else torch.addmm(self.bias, x, wt)

    def decode_call(self, rows: int) -> LinearCall | None:
        """The one op `forward` runs for a contiguous CPU x of `rows` rows (decode_stack.py),
        or None where that is not a single op taking x first."""
        bucket = min(rows, choice.ROUTE_LAST)
        if self._matmul_rows is not None and self._matmul_rows[bucket]:  # as _mm
            if self.bias is None:
                return LinearCall("aten::mm", (self._matmul,))
            return LinearCall("aten::addmm", (self.bias, self._matmul), x_index=1)
        if self._panels is not None and (self._panel_rows is None or self._panel_rows[bucket]):
            return LinearCall("pagedkv_cpu::panel_linear", (self._panels, self.bias),
                              (self.out_features,))
        if self._packed is not None:
            return LinearCall("mkldnn::_linear_pointwise", (self._packed, self.bias), (),
                              ("none", ""))
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.device.type == "cpu":
            if self._matmul_rows is not None and self._matmul_rows[
                    min(x.shape[0], choice.ROUTE_LAST)]:
                return self._mm(x, self._matmul)
            if self._panels is not None and (self._panel_rows is None or self._panel_rows[
                    min(x.shape[0], choice.ROUTE_LAST)]):
                if x.shape[1] != self.in_features:  # (paired panels cannot tell K from K + 1)
                    raise RuntimeError(f"Linear: x has {x.shape[1]} features, not "
                                       f"{self.in_features}")
                return torch.ops.pagedkv_cpu.panel_linear(x, self._panels, self.out_features,
                                                          self.bias)
            if self._packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed,
                                                          self.bias, "none", [], "")
        if self._widened is not None and x.device.type == "cpu":
            return F.linear(x.float(), *self._widened).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # .forward: no nn.Module hook machinery per call (a measurable cost at decode sizes).
        return self.down_proj.forward(ops.silu_and_mul(self.gate_up_proj.forward(x)))
