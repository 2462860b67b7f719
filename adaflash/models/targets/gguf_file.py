"""A GGUF file read by the format's own layout: its metadata, and each tensor's bytes as a view of the mapped file.

Why not gguf-py's GGUFReader: it builds a numpy view per element of every metadata array - seconds for a 150K-token
vocabulary, paid by every process that loads the model. Here a string array is walked, not decoded, unless asked for.
The file is mapped copy-on-write: views are writable for numpy and torch, the file is never changed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (the format's numbering): scalar struct codes; 8 = string, 9 = array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # ggml type name (Q4_K, F32, ...)
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first, the torch shape reversed
    offset: int  # from the file's start
    nbytes: int


class GGUFFile:
    """`kv` (metadata; string arrays as None unless `arrays=True`), `types` (key -> value type names), `tensors`
    (name -> TensorInfo), and `data(name)`: a tensor's bytes, [rows, row bytes] for a 2-D one."""

    def __init__(self, path: str | Path, arrays: bool = False) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path} cannot be read as a GGUF file: {exc}") from exc
        buf = memoryview(self._map)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return string(), ()
            if kind != 9:
                return take(SCALARS[kind]), ()
            item, count = take("<I"), take("<Q")
            if item == 8:
                if arrays:
                    return [string() for _ in range(count)], (item,)
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                return None, (item,)
            values = np.frombuffer(buf, dtype=NUMPY[item], count=count, offset=pos)
            pos += values.nbytes
            return values.tolist(), (item,)

        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            pos = 4
            take("<I")  # version
            n_tensors, n_kv = take("<Q"), take("<Q")
            self.kv: dict[str, Any] = {}
            self.types: dict[str, tuple[str, ...]] = {}
            for _ in range(n_kv):
                key, kind = string(), take("<I")
                self.kv[key], inner = value(kind)
                self.types[key] = tuple(gguf.GGUFValueType(t).name for t in (kind, *inner))
            infos = []
            for _ in range(n_tensors):
                name, dims = string(), take("<I")
                shape = tuple(take("<Q") for _ in range(dims))
                infos.append((name, gguf.GGMLQuantizationType(take("<I")), shape, take("<Q")))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
        alignment = int(self.kv.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, kind, shape, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape)) // block * block_bytes
            if start + offset + nbytes > len(self._map):
                raise ValueError(f"{self.path} is truncated: tensor {name} ends past the file's {len(self._map)} bytes")
            self.tensors[name] = TensorInfo(name, kind.name, shape, start + offset, nbytes)

    def data(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        raw = self._map[t.offset:t.offset + t.nbytes]
        if t.type in ("F32", "F16"):  # as values; every other type as its bytes (what gguf.quants reads)
            raw = raw.view(np.float32 if t.type == "F32" else np.float16)
        return raw.reshape(*reversed(t.shape[1:]), -1) if len(t.shape) > 1 else raw
