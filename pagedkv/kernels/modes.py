"""The `cpu_kernels` modes (see pagedkv.kernels.cpu), apart from the build code: parsing and
validating the flag needs no torch."""

from __future__ import annotations

CPU_KERNEL_MODES = ("auto", "wait", "off")
