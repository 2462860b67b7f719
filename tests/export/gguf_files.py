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


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensors (the runtime's own layout reader, string arrays decoded), dequantised by
    gguf-py."""
    import gguf

    from adaflash.models.targets.gguf_file import GGUFFile as Layout

    layout = Layout(path, arrays=True)
    tensors = {}
    for name, info in layout.tensors.items():
        kind = gguf.GGMLQuantizationType[info.type]
        values = gguf.quants.dequantize(layout.data(name), kind).reshape(*reversed(info.shape))
        tensors[name] = GGUFTensor(type=info.type, shape=info.shape, values=np.asarray(values, dtype=np.float32))
    return GGUFFile(layout.kv, layout.types, tensors)


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
