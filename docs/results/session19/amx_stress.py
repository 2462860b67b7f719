"""The int8 kernel's AMX path under competition for the cores: 128-row passes over a Q8_0 LM-head-sized weight for
40 s, each result compared with the first, while other processes keep both cores busy (context switches mid-call).

    (for i in 1 2 3; do timeout 50 sh -c 'while :; do :; done' & done); python docs/results/session19/amx_stress.py
"""
import time, numpy as np, torch
from adaflash.models.kernels import packed
lib = packed.library()
n, k = 49152, 576
rng = np.random.default_rng(0)
raw = torch.from_numpy(rng.integers(0, 256, (n, k // 32 * 34), dtype=np.uint8))
raw.view(n, k // 32, 34)[:, :, 0:2] = torch.from_numpy(np.frombuffer(np.full(n * (k // 32), 0.01, np.float16).tobytes(), np.uint8).reshape(n, k // 32, 2).copy())
kern = packed.Int8Linear(raw, "Q8_0", k)
x = torch.randn(128, k)
ref = kern(x)
t = time.time(); calls = 0
while time.time() - t < 40:
    assert torch.equal(kern(x), ref); calls += 1
print("ok", calls, "calls of 128 rows (AMX)", packed.int8_isa())
