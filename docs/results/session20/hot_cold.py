"""One-row passes of the fp32 target's Q4_1 gate_up kernel: one layer's weight over and over (L2-hot) vs the 30 layers
in turn (streamed), and the int8 target's the same way: GB/s of packed weight."""
import sys, time, statistics, torch
from adaflash.models import registry
from adaflash.models.target import load_target_as
for dtype in ("fp32", "int8"):
    m = load_target_as(registry.resolve_target("smollm2-135m"), dtype)
    x = torch.randn(1, 576)
    fs = [l.fast["gate_up"] for l in m.layers]
    nbytes = fs[0].streamed_bytes(1)
    for name, seq in (("hot (layer 0 x30)", [fs[0]] * 30), ("streamed (30 layers)", fs)):
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            for f in seq: f(x)
            ts.append(time.perf_counter() - t)
        med = statistics.median(ts)
        print(f"{dtype} {name}: {1e3 * med / 30:.3f} ms a call, {nbytes * 30 / med / 1e9:.1f} GB/s")
