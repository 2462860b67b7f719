"""Which linear kernel runs each of the target's weight shapes at each row count on this machine, and why.

    python benchmarks/runtime/kernel_choice.py --json docs/results/runtime/kernel_choice.json

Loads the target (which times torch's stock kernel, the packed fp32 kernel and, for a GGUF target, the quantized
kernel once per machine and thread count, models/kernels/selection.py) plus the shipped drafter's trimmed head,
and writes the timings and the choices: what won and what lost, per shape and row bucket. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from adaflash.models.kernels import selection
from adaflash.report import markdown_table, write_report


def run(model: str, threads: int | None, json_path: str) -> dict:
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.targets.registry import resolve_target, shipped_drafter
    from adaflash.models.targets.model import load_target
    from adaflash.speculative.proposer import DFlashProposer

    if threads:
        torch.set_num_threads(threads)
    if selection.KernelChoice().mode != "auto":
        raise SystemExit("ADAFLASH_KERNELS forces a kernel, so nothing is timed: unset it")
    target = load_target(resolve_target(model), dtype=torch.float32)
    if target.fast_lm_head is None:
        raise SystemExit("the packed kernel is unavailable here (no AVX2/FMA, no compiler, or ADAFLASH_KERNELS=stock)")
    drafter = shipped_drafter(model)
    linears = [target.lm_head] + [getattr(target.layers[0], n) for n in ("qkv", "o", "gate_up", "down")]
    if drafter is not None:  # building the proposer times the drafter's (trimmed) head shape too
        linears.append(DFlashProposer(load_drafter(drafter, dtype=torch.float32), target).head.weight)
    saved = json.loads(selection.cache_file().read_text())
    ours = {f"{w.shape[0]}x{w.shape[1]}" for w in linears}
    saved["shapes"] = {k: v for k, v in saved["shapes"].items() if k in ours}
    return {"command": f"python benchmarks/runtime/kernel_choice.py --model {model}"
                       + (f" --threads {threads}" if threads else "") + f" --json {json_path}",
            "machine": {"cpu": saved["cpu"], "threads": saved["threads"], "arch": platform.machine()},
            "row_buckets": list(selection.ROW_BUCKETS), "shapes_ms": saved["shapes"]}


def to_markdown(result: dict) -> str:
    m, buckets = result["machine"], result["row_buckets"]
    rows = []
    for shape, times in result["shapes_ms"].items():
        cells = []
        for r in buckets:
            t = times[str(r)]
            win = min(t, key=t.get)
            cells.append(" / ".join(f"{t[k]:.2f}" for k in t) + f" **{win}**")
        rows.append([f"{shape} ({' / '.join(times[str(buckets[0])])})", *cells])
    lines = ["# Linear kernels: torch's stock kernel (oneDNN) vs the packed AVX2 fp32 kernel vs the quantized kernel "
             "over the GGUF's blocks, per weight shape and row count",
             "", f"Command: `{result['command']}`  ",
             f"Machine: {m['cpu']}, {m['threads']} threads, fp32 activations. Minimum of 5 timed calls each, the "
             "caches flushed before each call (a decode step meets its weights cold: the model is larger than the "
             "L3); the fastest runs that bucket (rows round up to the next bucket; past the largest, torch's kernel "
             "runs). The quantized kernel's outputs are bitwise the packed kernel's, so the choice never changes "
             "what the target computes.", "",
             markdown_table(["weight [out x in]", *(f"{r} rows" for r in buckets)], rows),
             "", "Cells: ms per call of each kernel named in the first column, and the winner."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = parser.parse_args()
    result = run(args.model, args.threads, args.json)
    write_report(args.json, result, to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
