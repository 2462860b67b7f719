"""The weight set int8_isa_ab.py and int8_build_ab.py time: SmolLM2-135M's 30 layers x qkv / o / gate_up / down as
random GGUF Q4_1 blocks (66 MB packed; LAYERS=N for N layers: 1 is 2.2 MB, cache-resident), or with HEAD=1 its LM
head, 49152 x 576 Q8_0 (30 MB), packed by each library given."""
import os

import numpy as np

SHAPES, LAYERS, FORMAT = [(960, 576), (576, 576), (3072, 576), (576, 1536)], int(os.environ.get("LAYERS", 30)), 1
if os.environ.get("HEAD"):
    SHAPES, LAYERS, FORMAT = [(49152, 576)], 1, 2


def packed_weights(libs, threads: int) -> list[tuple[int, int, list[np.ndarray]]]:
    """[(n, k, [the weight packed by each library])] in the order a forward reads them."""
    rng = np.random.default_rng(0)
    weights = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            nb = k // 32
            raw = rng.integers(0, 256, (n, nb, 20 if FORMAT == 1 else 34), dtype=np.uint8)
            raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
            if FORMAT == 1:
                raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
            bufs = []
            for lib in libs:
                buf = np.zeros((n // 16) * nb * lib.adaflash_int8_block_bytes(FORMAT), np.uint8)
                lib.adaflash_pack_int8(raw.ctypes.data, n, k, FORMAT, buf.ctypes.data, threads)
                bufs.append(buf)
            weights.append((n, k, bufs))
    return weights
