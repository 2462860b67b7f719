"""Where a target step's time goes: torch.profiler over a decode step, a 16-token verify and a batch-64 step.

    python benchmarks/runtime/runtime_profile.py --json docs/results/runtime/runtime_profile.json

Profiled op by op (the Python layer loop, ADAFLASH_LAYER_STEP=0): each op's self CPU time is put in one bucket:
linears (the LM head apart, told by its vocabulary-sized weight), attention (SDPA and the K/V cache writes), norms /
RoPE / elementwise, and the rest; Python and dispatch is the wall time no op accounts for. The same step's wall time
with the whole-layer step (one kernel call per layer, what runs by default) stands beside it: the difference is
what the loop's per-op overhead cost. Run with nothing else on the cores; the JSON names the machine and threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from adaflash.cli_args import configure_process
from adaflash.evaluation.offline import cpu_label, environment, machine_info
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.registry import resolve_target
from adaflash.models.targets.model import load_target_as
from adaflash.report import markdown_table, write_report

LINEAR = ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "packed_linear")
ATTENTION = ("scaled_dot_product", "index_copy", "aten::bmm", "_softmax", "ragged_attention")
# rope_qkv: the fused RoPE + K/V cache write (the unfused path's cache write, index_copy, counts as attention)
ELEMENTWISE = ("rms_norm", "rope_qkv", "aten::mul", "aten::add", "aten::cat", "aten::neg", "aten::silu", "aten::pow",
               "aten::mean",
               "aten::rsqrt", "aten::cos", "aten::sin", "aten::embedding", "aten::copy_", "aten::to", "aten::where",
               "aten::div", "aten::sum", "aten::chunk", "aten::slice", "aten::view", "aten::reshape", "aten::transpose")
SHAPES = {"decode (batch 1, 1 token)": (1, 1), "verify (batch 1, 16 tokens)": (1, 16), "batch-64 decode step": (64, 1)}


def _bucket(name: str, shapes, vocab: int) -> str:
    if any(k in name for k in LINEAR):
        # The packed kernel's label carries its weight shape: "adaflash::packed_linear[OUTxIN]".
        return "lm_head" if any(vocab in s for s in shapes if s) or f"[{vocab}x" in name else "linears"
    if any(k in name for k in ATTENTION):
        return "attention"
    if any(k in name for k in ELEMENTWISE):
        return "norms_rope_elementwise"
    return "other_ops"


def profile_step(target, batch: int, query_len: int, context: int, repeats: int) -> dict:
    cache = target.new_cache(batch, context + query_len)
    slots = list(range(batch))
    step = RaggedBatch.build(slots, [context] * batch, [query_len] * batch)
    ids = torch.randint(0, target.config.vocab_size, (batch * query_len,))

    def run() -> None:
        for s in slots:
            cache.lengths[s] = context
        target(ids, step, cache)

    with environment({"ADAFLASH_LAYER_STEP": "1"}):
        fused_ms = _wall_ms(run, repeats)
    with environment({"ADAFLASH_LAYER_STEP": "0"}):  # op by op, so the profiler sees each op
        wall_ms = _wall_ms(run, repeats)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(repeats):
                run()
    buckets: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        key = _bucket(event.key, event.input_shapes or [], target.config.vocab_size)
        buckets[key] = buckets.get(key, 0.0) + event.self_cpu_time_total / 1e3 / repeats
    ops_ms = sum(buckets.values())
    buckets["python_dispatch"] = max(0.0, wall_ms - ops_ms)
    return {"wall_ms": round(wall_ms, 2), "layer_step_wall_ms": round(fused_ms, 2),
            "ms": {k: round(v, 2) for k, v in sorted(buckets.items())},
            "share": {k: round(v / max(wall_ms, ops_ms), 3) for k, v in sorted(buckets.items())}}


def _wall_ms(run, repeats: int) -> float:
    """Median wall time of `run` (after two warm-up calls), without the profiler's own overhead."""
    for _ in range(2):
        run()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    return 1e3 * statistics.median(walls)


def to_markdown(report: dict) -> str:
    keys = sorted({k for r in report["steps"].values() for k in r["ms"]})
    m = report["machine"]
    rows = [[name, r["layer_step_wall_ms"], r["wall_ms"],
             *(f"{r['ms'].get(k, 0):.1f} ({100 * r['share'].get(k, 0):.0f}%)" for k in keys)]
            for name, r in report["steps"].items()]
    lines = ["# Where a target step's time goes (torch.profiler, self CPU time per bucket)", "",
             f"Command: `{report['command']}`  ",
             f"Machine: {cpu_label(m)}, {m['threads']} threads, {report['dtype']}, context {report['context']} tokens, "
             "nothing else running.", "",
             "Op by op (the Python layer loop, profiled), and the wall time of the whole-layer step that runs by "
             "default:", "",
             markdown_table(["step", "wall ms, layer step", "wall ms, op by op", *keys], rows)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = p.parse_args()
    configure_process(None)
    target = load_target_as(resolve_target(args.model), args.dtype)
    steps = {name: profile_step(target, b, q, args.context, args.repeats) for name, (b, q) in SHAPES.items()}
    report = {"command": f"python benchmarks/runtime/runtime_profile.py --model {args.model} --dtype {args.dtype} "
                         f"--context {args.context} --repeats {args.repeats} --json {args.json}", "machine": machine_info(),
              "dtype": str(target.dtype).removeprefix("torch."), "context": args.context, "steps": steps}
    write_report(args.json, report, to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
