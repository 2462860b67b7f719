"""Reading GGUF files back for the export tests: metadata and tensors as plain Python / numpy values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Provenance names llama.cpp's converter guesses from directory names and model cards (gguf-py Metadata);
# they say nothing about the model and are the only keys allowed to differ from the converter's.
PROVENANCE_KEYS = frozenset({"general.name", "general.finetune", "general.basename", "general.size_label"})


@dataclass(frozen=True)
class GGUFTensor:
    type: str  # GGML type name: F32, F16, BF16
    shape: tuple[int, ...]  # GGUF order (ne0 first: the torch shape reversed)
    values: np.ndarray  # dequantised to float32, in torch layout


@dataclass(frozen=True)
class GGUFFile:
    kv: dict[str, Any]  # key -> value
    types: dict[str, tuple[str, ...]]  # key -> GGUF value type names (ARRAY, INT32 for an int array)
    tensors: dict[str, GGUFTensor]


# GGUF value types (the format's numbering): scalar struct codes; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensors, read by the GGUF format's own layout (gguf-py's GGUFReader builds one numpy
    view per array element: seconds for a 49K-token vocabulary); tensors are dequantised by gguf-py."""
    import struct

    import gguf

    data = memoryview(Path(path).read_bytes())
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(data[pos - n:pos]).decode("utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string(), ()
        if kind != 9:
            return take(_SCALARS[kind]), ()
        item, count = take("<I"), take("<Q")
        if item == 8:
            return [string() for _ in range(count)], (item,)
        values = np.frombuffer(data, dtype=_NUMPY[item], count=count, offset=pos)
        pos += values.nbytes
        return values.tolist(), (item,)

    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    take("<I")  # version
    n_tensors, n_kv = take("<Q"), take("<Q")
    kv, types = {}, {}
    for _ in range(n_kv):
        key, kind = string(), take("<I")
        kv[key], inner = value(kind)
        types[key] = tuple(gguf.GGUFValueType(t).name for t in (kind, *inner))
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), take("<I")
        shape = tuple(take("<Q") for _ in range(dims))
        infos.append((name, shape, gguf.GGMLQuantizationType(take("<I")), take("<Q")))
    alignment = kv.get("general.alignment", 32)
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape))
        raw = np.frombuffer(data, dtype=np.uint8, count=count // block * block_bytes, offset=start + offset)
        rows = raw.reshape(*reversed(shape[1:]), -1) if len(shape) > 1 else raw
        values = gguf.quants.dequantize(rows, kind).reshape(*reversed(shape))
        tensors[name] = GGUFTensor(type=kind.name, shape=shape, values=np.asarray(values, dtype=np.float32))
    return GGUFFile(kv, types, tensors)


def differences(ours: GGUFFile, theirs: GGUFFile) -> list[str]:
    """Everything that differs between two GGUF files except the provenance names: keys, value types, values,
    tensor names, types, shapes and values (exactly)."""
    out = []
    our_keys, their_keys = set(ours.kv) - PROVENANCE_KEYS, set(theirs.kv) - PROVENANCE_KEYS
    out += [f"key only in ours: {k}" for k in sorted(our_keys - their_keys)]
    out += [f"key only in theirs: {k}" for k in sorted(their_keys - our_keys)]
    for key in sorted(our_keys & their_keys):
        if ours.types[key] != theirs.types[key]:
            out.append(f"{key}: type {ours.types[key]} != {theirs.types[key]}")
        elif ours.kv[key] != theirs.kv[key]:
            out.append(f"{key}: {str(ours.kv[key])[:80]} != {str(theirs.kv[key])[:80]}")
    out += [f"tensor only in ours: {n}" for n in sorted(set(ours.tensors) - set(theirs.tensors))]
    out += [f"tensor only in theirs: {n}" for n in sorted(set(theirs.tensors) - set(ours.tensors))]
    for name in sorted(set(ours.tensors) & set(theirs.tensors)):
        a, b = ours.tensors[name], theirs.tensors[name]
        if (a.type, a.shape) != (b.type, b.shape):
            out.append(f"{name}: {a.type}{list(a.shape)} != {b.type}{list(b.shape)}")
        elif not np.array_equal(a.values, b.values):
            out.append(f"{name}: values differ (max |diff| {float(np.abs(a.values - b.values).max()):.3g})")
    return out
