"""A linear layer and an embedding on int8 codes with a scale per block of 16 or 32 along each
row (GGUF Q8_0, Q6_K and the other symmetric formats kept packed: int8_blocks.py), W = code *
scale exactly. The scales: float16 where that holds them exactly (Q8_0's own), Q6_K's and
Q3_K's two levels (a uint8 table: int8_blocks.q6_k_two_level), else float32; Q6_K's codes in 6
bits, Q5_0's in 5, IQ4's as 4-bit indices and Q3_K's in 3 (uint8 [N, K/64 * 8 * bits]:
int8_blocks.packed_codes), others a byte each.

The linear's calls up to its product rows (measured per shape class and rows bucket:
product_route.py; where the choice is forced, `product_rows()`: `INT8_BLOCK_ROWS` with AVX2, 64
where AMX-INT8 tiles run, every call with AVX-512 VNNI's panel product) run `int8_block_linear`
(kernels/csrc/quant_int8.cpp: activations quantized per block to int8, as llama.cpp's Q8_0 dot
does, integer dot products with AVX-512 VNNI or AVX2; from 4 rows on AVX-512 VNNI a panel
product, a block of up to 256 rows at a time, from 10 on AMX tiles); larger ones expand the
codes to a dense weight in the activation dtype (`int8_block_expand`) for the dense matmul
(oneDNN's: on AMX, or with AVX2 alone, faster on a prefill's hundreds of rows). Without the
fused kernels both run in torch ops on the expanded weight. The embedding gathers only the
looked-up rows' codes and scales.
The tensors are parameters (requires_grad False), so the model's parameter bytes count them; a
tied head and embedding share them (the model's parameters list them once).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.kernels.cpu import cpu_kernels_loaded
from pagedkv.model.decode_stack import LinearCall
from pagedkv.model.quant.int8_blocks import two_level_block_scales, unpacked_codes
from pagedkv.model.quant.product_route import ProductRoute

_EXPAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows up to which the integer kernel runs where neither AVX-512 VNNI's panel product nor AMX
# tiles do (benchmarks/bench_quant_linear.py --paths q8gemv,q8expand): against expanding the
# weight and oneDNN's bfloat16 matmul it wins at decode sizes and loses on prefills.
INT8_BLOCK_ROWS = 16
# A larger call expands this many weight bytes (in the activation dtype) at a time: a buffer
# the allocator reuses and the cache keeps, where the whole weight at once (the tied head's
# 49152 x 576: 57 MB in bfloat16) costs fresh pages each call, more than the matmul itself.
EXPAND_CHUNK_BYTES = 2 << 20


@functools.cache
def product_rows() -> int:
    """Rows up to which Int8BlockLinear runs the integer product with the fused kernels loaded:
    `INT8_BLOCK_ROWS`, 64 where AMX-INT8 tiles run, every call where AVX-512 VNNI's panel
    product does (`int8_block_tile_rows`; at 16-64 rows 1.5-2.5x the expanded weight's matmul
    on a Zen 4, 1.25x at 512-2,048; 1.1-1.6x at 16-64 on AMX:
    benchmarks/bench_quant_linear.py --paths q8gemv,q8expand)."""
    return max(INT8_BLOCK_ROWS, int(torch.ops.pagedkv_cpu.int8_block_tile_rows()))


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as the kernels take them: float16 and a uint8 two-level table kept,
    anything else as float32."""
    kept = scales if scales.dtype in (torch.float16, torch.uint8) else scales.float()
    return kept.contiguous()


def block_of(k: int, scales: torch.Tensor) -> int:
    """The block size of scales [N, ...] for K columns (16 for a two-level table)."""
    return 16 if scales.dtype == torch.uint8 else k // max(1, scales.shape[1])


def code_bits(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """8 for int8 codes; packed (uint8) ones: with two-level scales 3 where a row takes 3K/8
    bytes (Q3_K's), else 6 (Q6_K's); else (blocks of 32) 4 where a block takes 16 bytes
    (IQ4's), 5 where 20 (Q5_0's)."""
    if codes.dtype != torch.uint8:
        return 8
    if scales.dtype == torch.uint8:  # K/16 + K/128 bytes a row
        return 3 if codes.shape[1] == scales.shape[1] // 9 * 128 * 3 // 8 else 6
    return 4 if codes.shape[1] == 16 * scales.shape[1] else 5


def columns(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """K of codes [N, K] int8 or [N, K/64 * 8 * bits] packed."""
    bits = code_bits(codes, scales)
    return codes.shape[1] if bits == 8 else codes.shape[1] // (8 * bits) * 64


def float_scales(scales: torch.Tensor) -> torch.Tensor:
    """The block scales as float32 [N, K / block] (a two-level table's products)."""
    if scales.dtype == torch.uint8:
        return torch.from_numpy(two_level_block_scales(scales.numpy()))
    return scales.float()


def int8_codes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The codes int8 [N, K] (packed ones unpacked)."""
    bits = code_bits(codes, scales)
    return codes if bits == 8 else torch.from_numpy(unpacked_codes(codes.numpy(), bits))


def expand_reference(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """W [N, K] = codes times their block's scale in float32, rounded once to `dtype` (torch
    ops: the reference the kernel is tested against, and the path without the kernels)."""
    codes = int8_codes(codes, scales)
    n, k = codes.shape
    w = codes.view(n, -1, block_of(k, scales)).float() * float_scales(scales)[..., None]
    return w.reshape(n, k).to(dtype)


class Int8BlockLinear(nn.Module):
    """y = x W^T (+ bias), W [out_features, in_features] as int8 codes times per-block scales."""

    def __init__(self, codes: torch.Tensor | nn.Parameter, scales: torch.Tensor | nn.Parameter,
                 bias: torch.Tensor | None = None) -> None:
        """`codes` int8 [N, K] or packed (uint8 [N, K/64 * 8 * bits]:
        int8_blocks.packed_codes: 6 or 3 bits with two-level scales, else 5 or 4 with blocks
        of 32), `scales` [N, K / block]
        (float16 kept as such: half the bytes of float32, for scales it holds exactly, as
        Q8_0's own; any other dtype as float32), block 16 or 32, or Q6_K's two levels (uint8
        [N, K/16 + K/128], K a multiple of 256: int8_blocks.q6_k_two_level); parameters given
        are kept as they are (shared with a tied embedding). ValueError for a K that is not a
        multiple of 32 or a block other than 16 or 32, or packed codes of another shape."""
        super().__init__()
        bits = code_bits(codes, scales)
        self.out_features, self.in_features = codes.shape[0], columns(codes, scales)
        self.block = block_of(self.in_features, scales)
        k = self.in_features
        width = k // 16 + k // 128 if scales.dtype == torch.uint8 else k // max(1, self.block)
        if k % 32 or self.block not in (16, 32) or scales.shape[1] != width \
                or (scales.dtype == torch.uint8 and k % 256) \
                or (bits != 8 and codes.shape[1] % (8 * bits)) \
                or (bits in (4, 5) and self.block != 32):
            raise ValueError(f"Int8BlockLinear: codes [{self.out_features}, "
                             f"{self.in_features}] ({bits} bits) with scales "
                             f"{list(scales.shape)} ({scales.dtype}) need K a multiple of 32 "
                             f"and blocks of 16 or 32 (two levels: K a multiple of 256, K/16 + "
                             f"K/128 bytes; packed codes: whole chunks of 64, 4 or 5 bits in "
                             f"blocks of 32)")
        self.codes = codes if isinstance(codes, nn.Parameter) else _param(codes.contiguous())
        self.scales = scales if isinstance(scales, nn.Parameter) else _param(_scales(scales))
        self.bias = None if bias is None else _param(bias.detach().clone())
        two_level = "-two-level" if self.scales.dtype == torch.uint8 else ""
        self.route = ProductRoute(f"int{bits}-b{self.block}{two_level}", self.out_features,
                                  self.in_features, bias is not None, product_rows)

    def pack(self, panels: bool = False) -> bool:
        """Nothing to prepare (the weight is packed at build) but the product rows, chosen
        again at the next call (mutates self.route)."""
        self.route.reset()
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`, each value rounded once from float32."""
        return self._dequantized_rows(0, self.out_features, dtype)

    def decode_call(self, rows: int) -> LinearCall | None:
        """The one op `forward` runs with the fused kernels loaded (decode_stack.py)."""
        return LinearCall("pagedkv_cpu::int8_block_forward", (self.codes, self.scales, self.bias),
                          (self.block, self.route.last()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels_loaded():  # one op: its row count picks the product or the expansion
            p = self._parameters  # (not nn.Module's __getattr__: a microsecond a parameter)
            return torch.ops.pagedkv_cpu.int8_block_forward(x, p["codes"], p["scales"],
                                                            self.block, p.get("bias"),
                                                            self.product_rows_for(x.dtype))
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return self._expanded_linear(rows, bias).view(*x.shape[:-1], self.out_features)

    def product_rows_for(self, dtype: torch.dtype) -> int:
        """Rows up to which a call on `dtype` activations runs the integer product (beyond:
        the expanded weight), measured at the first such call (product_route.py)."""
        return self.route.rows(dtype, self._call)

    def _call(self, x: torch.Tensor, product_rows: int) -> torch.Tensor:
        """The fused op with the product up to `product_rows` rows (the route's candidates)."""
        return torch.ops.pagedkv_cpu.int8_block_forward(x, self.codes, self.scales, self.block,
                                                        self.bias, product_rows)

    def _expanded_linear(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows W^T (+ bias) through the dense matmul, W expanded a chunk of rows at a time."""
        step = max(16, EXPAND_CHUNK_BYTES // (rows.element_size() * self.in_features))
        if step >= self.out_features:
            return F.linear(rows, self.dequantized(rows.dtype), bias)
        parts = [F.linear(rows, self._dequantized_rows(start, start + step, rows.dtype),
                          None if bias is None else bias[start:start + step])
                 for start in range(0, self.out_features, step)]
        return torch.cat(parts, dim=1)

    def _dequantized_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        codes, scales = self.codes[start:stop], self.scales[start:stop]
        if cpu_kernels_loaded() and dtype in _EXPAND_DTYPES:
            return torch.ops.pagedkv_cpu.int8_block_expand(codes, scales, self.block, dtype)
        return expand_reference(codes, scales, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 blocks of {self.block}")


class Int8BlockEmbedding(nn.Module):
    """Rows of a [vocab, hidden] table kept as int8 codes times per-block scales; a lookup
    dequantizes only the rows asked for, to `dtype`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.codes = _param(codes.contiguous())
        self.scales = _param(_scales(scales))
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = codes.shape[0], columns(codes, scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = expand_reference(self.codes[flat], self.scales[flat], self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def tied_head(self) -> Int8BlockLinear:
        """The LM head over the same codes and scales (tied embeddings)."""
        return Int8BlockLinear(self.codes, self.scales)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 blocks"
