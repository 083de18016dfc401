"""The `cpu_kernels` modes (see pagedkv.kernels.cpu), apart from the build code: parsing and
validating the flag needs no torch."""

from __future__ import annotations

import typing

from pagedkv.config.options import CpuKernelMode

CPU_KERNEL_MODES: tuple[str, ...] = typing.get_args(CpuKernelMode)
