"""Where a packed linear's calls stop running the integer product on the packed codes and
expand the weight to the activation dtype for the dense matmul instead, chosen by measurement.

Both paths are one op (`int4_linear`, `int8_block_forward`) that takes the row count up to
which it runs the product. The right count depends on the CPU, not on its instruction set
alone: on AMD Zen 4 the AVX-512 VNNI panel product beat the expanded weight's bfloat16 matmul
at every row count measured, while on Zen 5, whose 512-bit units run oneDNN's bfloat16 matmul
at full width, the expansion won SmolLM2's prefills (1.17-1.19x at 256 and 1,024 rows over
its shapes, one thread: benchmarks/bench_quant_linear.py --paths q40,int4expand) while the
panel product ran 256-bit vectors, and still takes the tied Q8_0 head past 64 rows; on Intel
with AMX the tiles' product wins up to about 64 rows. So each packed shape
class (its format, the activation dtype, N x K, bias) is timed once per rows bucket by
kernels/choice.py, the candidates "product" and "expand", the product kept unless the
expansion is clearly faster; the table is cached on disk with the dense linears' and listed
with them (`/kv_cache_info`'s `linears`, the start-up banner). The product runs up to the
last row before the first bucket the expansion takes. Where the choice is forced
(PAGEDKV_KERNEL_CHOICE) the instruction-set rule stands: the module's `static_rows()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.kernels import choice

KERNELS = ("product", "expand")
# A row count no call reaches (the kernels' kEveryRow): the product on every call.
EVERY_ROW = 1 << 40

# f(x, product_rows) -> y: the packed linear's op with the weight bound.
PackedCall = Callable[[torch.Tensor, int], torch.Tensor]


def rows_from_buckets(per_bucket: tuple[str, ...]) -> int:
    """The last row before the first choice.ROW_BUCKETS bucket that runs "expand" (0: every
    call expands), EVERY_ROW where none does."""
    for (first, _), kernel in zip(choice.ROW_BUCKETS, per_bucket, strict=True):
        if kernel == "expand":
            return first - 1
    return EVERY_ROW


class ProductRoute:
    """A packed linear's product rows per activation dtype, measured at the first call of
    each (`rows`) and kept until `reset`."""

    def __init__(self, kind: str, out_features: int, in_features: int, bias: bool,
                 static_rows: Callable[[], int]) -> None:
        """`kind` names the packed format in the shape class ("int4-q4_0", "int8-b32");
        `static_rows()`: the instruction-set rule's product rows."""
        self.kind, self.bias = kind, bias
        self.out_features, self.in_features = out_features, in_features
        self.static_rows = static_rows
        self._rows: dict[torch.dtype, int] = {}

    def rows(self, dtype: torch.dtype, call: PackedCall) -> int:
        """The product rows for `dtype` activations, measured on `call` the first time."""
        limit = self._rows.get(dtype)
        if limit is None:
            limit = self._rows[dtype] = self._choose(dtype, call)
        return limit

    def last(self) -> int:
        """The product rows last chosen (for the decode stack, which runs the model's one
        dtype), else the instruction-set rule's."""
        if not self._rows:
            return self.static_rows()
        return next(reversed(self._rows.values()))

    def reset(self) -> None:
        """Forget the chosen rows (mutates self): the next call chooses again."""
        self._rows.clear()

    def _choose(self, dtype: torch.dtype, call: PackedCall) -> int:
        if choice.choice_mode() != "measure":
            return self.static_rows()
        shape = f"{self.kind} " + choice.shape_class(dtype, self.out_features, self.in_features,
                                                      self.bias)

        def make(kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
            rows = EVERY_ROW if kernel == "product" else 0
            return lambda x: call(x, rows)

        per_bucket = choice.choose_linear(shape, dtype, self.in_features, make, KERNELS,
                                          "product")
        return rows_from_buckets(per_bucket)
