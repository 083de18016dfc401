"""Reading a GGUF file: its metadata and its tensors' places, in one pass over the header.

The layout is llama.cpp's GGUF (versions 2 and 3, little-endian): a header, typed key/value
metadata, one record per tensor (name, dims, ggml type, offset) and the aligned tensor data. The
`gguf` package names the types (`GGUFValueType`, `GGMLQuantizationType`, `GGML_QUANT_SIZES`) and
dequantizes; the header is parsed here because `gguf.GGUFReader` turns every one of a
vocabulary's tokens into numpy views (about 2 s for a 49k-token vocabulary, once per process),
while this reads the same header in a tenth of that (checked against `GGUFReader` in
tests/model/test_gguf_file.py). Tensor data stays memory-mapped until dequantized.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: `shape` in torch order (rows first; GGUF lists dims innermost
    first), its ggml type, and where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _Cursor:
    """Little-endian reads from a bytes-like buffer."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"GGUF file {self.path} is truncated (header ends early)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF file {self.path} is truncated (header ends early)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"GGUF file {self.path}: unknown metadata value type {vtype}")
        value = self.unpack(fmt)
        if vtype == GGUFValueType.FLOAT32:  # 9.999999747378752e-06 -> 1e-05, as written
            value = float(str(np.float32(value)))
        return value

    def array(self) -> list[Any]:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        fmt = _SCALARS.get(etype)
        if fmt is None or etype == GGUFValueType.BOOL:
            return [self.value(etype) for _ in range(count)]
        size = struct.calcsize(fmt)
        if self.pos + size * count > len(self.buf):
            raise ValueError(f"GGUF file {self.path} is truncated (header ends early)")
        values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
        self.pos += size * count
        return values.tolist()


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> int, float, bool, str or list) and tensors
    (`tensors`: name -> TensorInfo); `data(name)` is a tensor's raw bytes, one row of blocks per
    row of the tensor (what `gguf.quants.dequantize` takes). Raises ValueError naming the file
    when it is not a readable GGUF."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read GGUF file {self.path}: {exc}") from None
        cursor = _Cursor(memoryview(self._map), self.path)
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no 'GGUF' magic at its start)")
        cursor.pos = 4
        self.version = cursor.unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF file {self.path} has version {self.version}; "
                             "supported: 2 and 3 (little-endian)")
        n_tensors, n_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = [self._tensor_record(cursor) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            nbytes = _byte_size(shape, ggml_type, name, self.path)
            if start + offset + nbytes > len(self._map):
                raise ValueError(f"GGUF file {self.path} is truncated: tensor {name!r} "
                                 "runs past its end")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start + offset, nbytes)

    def _tensor_record(self, cursor: _Cursor) -> tuple[str, tuple[int, ...],
                                                       GGMLQuantizationType, int]:
        name = cursor.string()
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        raw_type = cursor.unpack("<I")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"GGUF file {self.path}: tensor {name!r} has unknown ggml type "
                             f"{raw_type}") from None
        return name, tuple(reversed(dims)), ggml_type, cursor.unpack("<Q")

    @property
    def architecture(self) -> str:
        """`general.architecture` ("llama", "qwen2", ...)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"GGUF file {self.path} has no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata `<architecture>.<key>` (e.g. "block_count"), or `default`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def data(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as uint8 rows: shape (*shape[:-1], bytes per row)."""
        info = self.tensors[name]
        raw = self._map[info.offset:info.offset + info.nbytes]
        rows = info.shape[:-1] if len(info.shape) > 1 else ()
        return raw.reshape(*rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))


def _byte_size(shape: tuple[int, ...], ggml_type: GGMLQuantizationType, name: str,
               path: Path) -> int:
    if ggml_type not in GGML_QUANT_SIZES:
        raise ValueError(f"GGUF file {path}: tensor {name!r} has ggml type {ggml_type.name}, "
                         "whose size is unknown")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if shape and shape[-1] % block:
        raise ValueError(f"GGUF file {path}: tensor {name!r} rows of {shape[-1]} are not whole "
                         f"{ggml_type.name} blocks of {block}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return count // block * type_size


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The parsed GGUF file at `path`, parsed once per process (keyed by path, size and
    modification time, so a rewritten file is read again)."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from None
    return _open_cached(str(resolved), stat.st_size, stat.st_mtime_ns)
