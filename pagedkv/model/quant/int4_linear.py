"""A linear layer on 4- or 5-bit weights kept packed (GGUF Q4_0, Q4_1, Q4_K, Q5_1, Q5_K):
weight = code * scale + offset per group of 32 along each row (int4_blocks.py).

One copy of the codes (uint8 [N, K/2], the file's nibble order, and for 5-bit codes their fifth
bits after them, [N, K/2 + K/8]: int4_blocks.pack_group_codes) and of the scales (per row the
groups' scales, then their offsets: float16 where that holds them exactly, Q4_1's and Q5_1's
own values, else float32; Q4_0's float16 scales alone, its offsets -8 times them implied; the
K-quants' as the file has them, two levels in a uint8 table: int4_blocks.k_quant_two_level),
read front to back by both paths (kernels/csrc/quant_int4.cpp; 5-bit codes run the VNNI panel
product where 4-bit ones run AMX tiles):
- a call up to its product rows (measured per shape class and rows bucket: product_route.py;
  where the choice is forced, `product_rows()`: `GEMV_ROWS` with AVX2, 64 where AMX-INT8 tiles
  run, every call with AVX-512 VNNI's panel product) runs `int4_gemv`: as llama.cpp's Q4 x Q8
  dot, each activation row quantized once to int8 per group of 32, integer dot products on the
  codes (AVX-512 VNNI, AVX2), each group's sum scaled in float32; about 2x torch's
  `_weight_int4pack_mm_for_cpu` summed over SmolLM2's shapes with the weights out of cache, at
  one row and at four (benchmarks/bench_quant_linear.py --cold, one thread: 1.8 against 3.8 ms
  at one row); from 4 rows AVX-512 VNNI lays out 16 weight rows' codes at a time for all the
  rows (the panel product, a block of up to 256 rows at a time: at 16-64 rows 1.4-2x the
  expansion below, 1.2x at 512-2,048, and faster than the dense bfloat16 linear at each, on
  AMD Zen 4), and at 10-64 rows AMX tiles run it (1.2-1.9x the expansion);
- a larger call (with AVX2 alone, past 64 rows on AMX, or wherever the measurement finds it
  faster) expands the codes to a dense weight in the activation dtype (`int4_expand`) and runs
  the dense matmul (oneDNN's: its bfloat16 AMX kernels win on a prefill's hundreds of rows).
Until the fused kernels load (a background build) decode-sized calls run torch's int4 op on a
copy of the weights in its own layout, made at the first such call and dropped once the kernels
are in (5-bit codes, which it cannot hold, expand instead); larger ones expand the weight in
torch ops.
The tensors are parameters (requires_grad False), so the model's parameter bytes count them.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.kernels.cpu import cpu_kernels_loaded
from pagedkv.model.decode_stack import LinearCall
from pagedkv.model.quant.gguf_parts import narrowest_scales
from pagedkv.model.quant.int4_blocks import GROUP, code_bits, two_level_scales
from pagedkv.model.quant.product_route import ProductRoute

_EXPAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Rows up to which `int4_gemv` runs with AVX2 alone: against expanding the weight first and then
# the dense matmul it wins at decode sizes and loses on prefills (benchmarks/bench_quant_linear.py);
# where it runs as AVX-512 VNNI's panel product or on AMX tiles, up to `int4_tile_rows()`
# (`product_rows`).
GEMV_ROWS = 12


@functools.cache
def product_rows() -> int:
    """Rows up to which Int4Linear runs the int4 product with the fused kernels loaded, by the
    instruction-set rule (a forced kernel choice; else measured: Int4Linear.product_rows_for)."""
    return max(GEMV_ROWS, int(torch.ops.pagedkv_cpu.int4_tile_rows()))


# Each Int4Linear's copy of its weight in torch's int4 layout, made for decode-sized calls
# before the fused kernels load and dropped once they are in.
_torch_int4_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def scales_table(scale: np.ndarray, offset: np.ndarray) -> torch.Tensor:
    """[N, 2 * K/32]: each row's scales then its offsets, float16 where every value round-trips
    through it exactly, else float32; where every offset is -8 times its scale (Q4_0's) and the
    scales are float16, the scales alone [N, K/32] (the kernels imply the offsets)."""
    table = narrowest_scales(np.concatenate((scale, offset), axis=1))
    if table.dtype == np.float16 and np.array_equal(offset, -8 * scale):
        table = table[:, :scale.shape[1]]
    return torch.from_numpy(np.ascontiguousarray(table))


def table_groups(code_bytes: int, scales: torch.Tensor) -> int:
    """Groups of 32 a row of a weight whose codes take `code_bytes` a row and whose scales are
    `scales` [N, ...]: 2.5 bytes a group in two levels (uint8), one float16 where Q4_0's scales
    stand alone (a sixteenth of the 4-bit codes' width), else a scale and an offset."""
    width = scales.shape[1]
    if scales.dtype == torch.uint8:
        return width * 2 // 5
    return width if scales.dtype == torch.float16 and 16 * width == code_bytes else width // 2


def unpacked(codes: torch.Tensor, scales: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, G, 32] (0..15, or 0..31), scale and offset float32 [N, G, 1] of a packed
    weight's rows (Int4Linear's `codes` and `scales`, or rows of them), in torch ops."""
    n = codes.shape[0]
    groups = table_groups(codes.shape[1], scales)
    blocks = codes[:, :16 * groups].reshape(n, groups, 16)
    values = torch.cat((blocks & 15, blocks >> 4), dim=2)
    if code_bits(codes.shape[1], groups) == 5:  # a group's fifth bits: a little-endian uint32
        fifth = codes[:, 16 * groups:].reshape(n, groups, 4, 1)
        bits = (fifth >> torch.arange(8, dtype=torch.uint8)) & 1
        values = values | (bits.reshape(n, groups, 32) << 4)
    if scales.dtype == torch.uint8:  # the K-quants' two levels
        scale, offset = (torch.from_numpy(t) for t in two_level_scales(scales.numpy()))
        return values, scale[..., None], offset[..., None]
    if scales.shape[1] == groups:  # Q4_0's scales alone
        scale = scales.float()[..., None]
        return values, scale, -8 * scale
    both = scales.float().view(n, 2, -1)
    return values, both[:, 0, :, None], both[:, 1, :, None]


def expand_reference(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """W [N, K] of a packed weight's rows in `dtype` (each value rounded once from float32), in
    torch ops: the reference the kernel is tested against."""
    values, scale, offset = unpacked(codes, scales)
    return torch.addcmul(offset, values.float(), scale).reshape(codes.shape[0], -1).to(dtype)


def expand_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`expand_reference` by the fused kernels' `int4_expand` when they are loaded."""
    if cpu_kernels_loaded() and dtype in _EXPAND_DTYPES:
        return torch.ops.pagedkv_cpu.int4_expand(codes, scales, dtype)
    return expand_reference(codes, scales, dtype)


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] in 4- or 5-bit groups of 32."""

    def __init__(self, codes: np.ndarray | nn.Parameter, scale: np.ndarray | None,
                 offset: np.ndarray | None, bias: torch.Tensor | None = None, *,
                 table: np.ndarray | nn.Parameter | None = None) -> None:
        """`codes` uint8 [N, K/2] (4-bit, Q4_0 order) or [N, K/2 + K/8] (5-bit:
        int4_blocks.pack_group_codes), `scale` and `offset` float32 [N, K/32]
        (int4_blocks.codes_and_scales), or in their place `table`, the K-quants' two levels
        (`from_two_level`) or any table the kernels read; parameters given are kept as they
        are (shared with a tied embedding). ValueError when N is not a multiple of 16 or the
        codes' width fits neither bit count."""
        super().__init__()
        if table is None:
            table = scales_table(scale, offset)
        elif not isinstance(table, torch.Tensor):
            table = torch.from_numpy(np.ascontiguousarray(table))
        n = codes.shape[0]
        groups = table_groups(codes.shape[1], table)
        self.bits = code_bits(codes.shape[1], groups)
        self.out_features, self.in_features = n, GROUP * groups
        if n % 16:
            raise ValueError(f"Int4Linear: weight [{n}, {self.in_features}] needs rows a "
                             f"multiple of 16")
        self.codes = codes if isinstance(codes, nn.Parameter) \
            else _param(torch.from_numpy(np.ascontiguousarray(codes)))
        self.scales = table if isinstance(table, nn.Parameter) else _param(table)
        self.bias = None if bias is None else _param(bias.detach().clone())
        self.route = ProductRoute(self._format(), n, self.in_features, bias is not None,
                                  product_rows)

    def _format(self) -> str:
        """The packed format as the kernel choice's shape class names it: the code bits and
        the scales' layout ("int4-q4_0", "int4-float16", "int5-two-level")."""
        s = self.scales
        if s.dtype == torch.uint8:
            layout = "two-level"
        elif s.dtype == torch.float16 and s.shape[1] * GROUP == self.in_features:
            layout = "q4_0"
        else:
            layout = str(s.dtype).removeprefix("torch.")
        return f"int{self.bits}-{layout}"

    @classmethod
    def from_two_level(cls, codes: np.ndarray, table: np.ndarray,
                       bias: torch.Tensor | None = None) -> Int4Linear:
        """A Q4_K or Q5_K linear with its scales kept in two levels
        (`int4_blocks.k_quant_two_level`): the same products, 0.078 bytes of scales a weight
        where the float32 table takes 0.25."""
        return cls(codes, None, None, bias, table=table)

    def pack(self, panels: bool = False) -> bool:
        """Nothing to prepare (the weight is packed at build) but the product rows, chosen
        again at the next call (mutates self.route)."""
        self.route.reset()
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (each value rounded once from float32): the fused CPU kernels'
        `int4_expand` when they are loaded (kernels/csrc/quant_int4.cpp), else torch ops."""
        return expand_rows(self.codes, self.scales, dtype)

    def dequantized_reference(self, dtype: torch.dtype) -> torch.Tensor:
        """`dequantized` in torch ops (the reference the kernel is tested against)."""
        return expand_reference(self.codes, self.scales, dtype)

    def _torch_int4_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows W^T by torch's int4 op (bfloat16 scales and activations), on its own copy of
        the weight, made at the first call (kept aside until the kernels load)."""
        copy = _torch_int4_copies.get(self)
        if copy is None:
            codes, scale, offset = unpacked(self.codes, self.scales)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.reshape(self.out_features, -1).to(torch.int32), 1)
            scale_zero = torch.cat((scale, offset + 8 * scale), dim=2).transpose(0, 1)
            copy = _torch_int4_copies[self] = packed, scale_zero.contiguous().bfloat16()
        packed, scale_zero = copy
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16).contiguous(), packed, GROUP, scale_zero).to(rows.dtype)

    def decode_call(self, rows: int) -> LinearCall | None:
        """The one op `forward` runs with the fused kernels loaded (decode_stack.py)."""
        return LinearCall("pagedkv_cpu::int4_linear", (self.codes, self.scales, self.bias),
                          (self.route.last(),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels_loaded():  # one op: its row count picks the product or the expansion
            if _torch_int4_copies:
                _torch_int4_copies.clear()  # the kernels are in: the torch op's copies go
            return self._kernel_forward(x)
        return self._forward_without_kernels(x)

    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self._parameters  # (not nn.Module's __getattr__: a microsecond a parameter)
        return torch.ops.pagedkv_cpu.int4_linear(x, p["codes"], p["scales"], p.get("bias"),
                                                 self.product_rows_for(x.dtype))

    def product_rows_for(self, dtype: torch.dtype) -> int:
        """Rows up to which a call on `dtype` activations runs the integer product (beyond:
        the expanded weight), measured at the first such call (product_route.py)."""
        return self.route.rows(dtype, self._call)

    def _call(self, x: torch.Tensor, product_rows: int) -> torch.Tensor:
        """The fused op with the product up to `product_rows` rows (the route's candidates)."""
        return torch.ops.pagedkv_cpu.int4_linear(x, self.codes, self.scales, self.bias,
                                                 product_rows)

    def _forward_without_kernels(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if rows.shape[0] <= GEMV_ROWS and self.bits == 4:
            y = self._torch_int4_mm(rows)
            y = y if bias is None else y + bias
        else:
            y = F.linear(rows, self.dequantized(x.dtype), bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} group 32")


class Int4Embedding(nn.Module):
    """Rows of a [vocab, hidden] table kept as an Int4Linear's packed codes and scales (a GGUF
    file's Q4_K / Q4_0 / Q5_K ... token embeddings: a quarter of the bfloat16 table's bytes); a
    lookup dequantizes only the rows asked for, to `dtype`."""

    def __init__(self, codes: nn.Parameter, scales: nn.Parameter, dtype: torch.dtype) -> None:
        """`codes`, `scales`: an Int4Linear's (kept as they are: the same parameters)."""
        super().__init__()
        self.codes, self.scales = codes, scales
        self.dtype = dtype
        self.num_embeddings = codes.shape[0]
        self.embedding_dim = GROUP * table_groups(codes.shape[1], scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = expand_rows(self.codes[flat], self.scales[flat], self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def tied_head(self) -> Int4Linear:
        """The LM head over the same codes and scales (tied embeddings)."""
        return Int4Linear(self.codes, None, None, table=self.scales)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 groups of 32"
