"""GGUF's Q5_0, Q4_K, Q5_K and Q6_K blocks packed for our kernels (kquant.cpp holds the layout and the arithmetic).

Decoding follows gguf.quants' own numpy dequantizers step for step but stops before the floats: each weight's small
unsigned integer q and each block's scale fields, which kquant.cpp turns into w = S * q + M with gguf's rounding. The
packing is numpy reshapes (a second or two for a 1.5B model's weights), written once per load; only the packed copy
stays in memory.
"""

from __future__ import annotations

import numpy as np

PANEL, BLOCK, SUPER = 16, 32, 256
KQUANT_CODES = {"Q5_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}  # kquant.cpp's KFormat


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> [blocks, 8] each (gguf's Q4_K.get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(fmt: str, blocks: np.ndarray, k: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """GGUF blocks of n rows ([n, row bytes] uint8) -> q [n, k] uint8 and the scale fields, per row: `d` (fp16 bits
    as uint16, one per block or super-block), for the K formats `dmin` and 6-bit `sc` / `m` per 32 k, Q6_K's int8
    `sc` per 16 k."""
    n = blocks.shape[0]
    if fmt == "Q5_0":
        b = blocks.reshape(-1, 22)
        d = b[:, :2].copy().view(np.uint16)
        qh = b[:, 2:6].copy().view(np.uint32)
        bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        ql = np.concatenate([b[:, 6:] & 0x0F, b[:, 6:] >> 4], axis=-1)
        return (ql | (bits << 4)).reshape(n, k), {"d": d.reshape(n, -1)}
    if fmt in ("Q4_K", "Q5_K"):
        size = 144 if fmt == "Q4_K" else 176
        b = blocks.reshape(-1, size)
        d, dmin = b[:, 0:2].copy().view(np.uint16), b[:, 2:4].copy().view(np.uint16)
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, SUPER)
        if fmt == "Q5_K":
            qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1).reshape(-1, SUPER) << 4)
        fields = {"d": d.reshape(n, -1), "dmin": dmin.reshape(n, -1), "sc": sc.reshape(n, -1), "m": mn.reshape(n, -1)}
        return q.reshape(n, k), fields
    if fmt == "Q6_K":
        b = blocks.reshape(-1, 210)
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(-1, 8, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(-1, 8, 32)
        q = (ql | (qh << 4)).reshape(n, k)
        return q, {"d": b[:, 208:210].copy().view(np.uint16).reshape(n, -1), "sc": b[:, 192:208].reshape(n, -1)}
    raise ValueError(f"no kquant decoding for {fmt}")


def dequantize(fmt: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """The weights kquant.cpp computes from `decode`'s fields (w = S * q + M), in numpy: the tests' bridge between
    gguf.quants.dequantize and the kernels."""
    q, f = decode(fmt, blocks, k)
    n = q.shape[0]
    d = f["d"].view(np.float16).astype(np.float32)
    if fmt == "Q5_0":
        return (np.repeat(d, BLOCK, axis=1) * (q.astype(np.float32) - 16)).astype(np.float32)
    if fmt == "Q6_K":
        s = np.repeat(d, 16, axis=1) * f["sc"].view(np.int8).astype(np.float32)
        return np.repeat(s, 16, axis=1) * (q.astype(np.int8) - np.int8(32)).astype(np.float32)
    s = np.repeat(d, 8, axis=1) * f["sc"].astype(np.float32)
    mm = np.repeat(f["dmin"].view(np.float16).astype(np.float32), 8, axis=1) * f["m"].astype(np.float32)
    return (np.repeat(s, BLOCK, axis=1) * q.astype(np.float32) - np.repeat(mm, BLOCK, axis=1)).reshape(n, k)


def _plane(high: np.ndarray, bits: int) -> np.ndarray:
    """The high bits of q ([p, h, j, b, half, l, t], values < 2^(bits - 4)) as kquant.cpp's plane: [p, b, bytes]."""
    p, _, _, nb = high.shape[:4]
    if bits == 5:  # byte [h][j][t]: bit 2l = low half's, 2l + 1 = high half's
        plane = np.zeros(high.shape[:4] + (4,), dtype=np.uint8)
        for l in range(4):
            plane |= (high[:, :, :, :, 0, l] << (2 * l)) | (high[:, :, :, :, 1, l] << (2 * l + 1))
        return plane.transpose(0, 3, 1, 2, 4).reshape(p, nb, 64)
    # 6 bits: byte [h][c][j][t]: bits 4l' + 0..1 low half's, 4l' + 2..3 high half's, step l = 2c + l'
    plane = np.zeros(high.shape[:4] + (2, 4), dtype=np.uint8)  # [p, h, j, b, c, t]
    for l in range(4):
        c, lp = divmod(l, 2)
        plane[..., c, :] |= (high[:, :, :, :, 0, l] << (4 * lp)) | (high[:, :, :, :, 1, l] << (4 * lp + 2))
    return plane.transpose(0, 3, 1, 4, 2, 5).reshape(p, nb, 128)


def _rows_to_panels(a: np.ndarray, groups: int) -> np.ndarray:
    """A per-row field [n, groups * w] -> per (panel, group) its 16 rows' values laid out [w][16] (one vector load per
    field), as bytes: [n / 16, groups, w * 16 * itemsize]."""
    n = a.shape[0]
    w = a.shape[1] // groups
    lanes = a.reshape(n // PANEL, PANEL, groups, w).transpose(0, 2, 3, 1).reshape(n // PANEL, groups, -1)
    return np.ascontiguousarray(lanes).view(np.uint8)


def pack(fmt: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """GGUF blocks of an [n, k] weight -> kquant.cpp's packed bytes (n % 16 == 0, k a multiple of the format's
    block)."""
    n = blocks.shape[0]
    p, nb = n // PANEL, k // BLOCK
    q, f = decode(fmt, blocks, k)
    v = q.reshape(p, 2, 8, nb, 2, 4, 4)
    nib = (v[:, :, :, :, 0] & 0x0F) | ((v[:, :, :, :, 1] & 0x0F) << 4)  # [p, h, j, b, l, t]
    body = [nib.transpose(0, 3, 4, 1, 2, 5).reshape(p, nb, 256)]
    if fmt != "Q4_K":
        body.append(_plane(v >> 4, 6 if fmt == "Q6_K" else 5))
    body = np.concatenate(body, axis=-1)  # [p, b, body bytes]
    if fmt == "Q5_0":
        return np.concatenate([_rows_to_panels(f["d"], nb), body], axis=-1).reshape(-1)
    ns = k // SUPER
    fields = ("d", "sc") if fmt == "Q6_K" else ("d", "dmin", "sc", "m")
    header = np.concatenate([_rows_to_panels(f[name], ns) for name in fields], axis=-1)
    return np.concatenate([header, body.reshape(p, ns, -1)], axis=-1).reshape(-1)
