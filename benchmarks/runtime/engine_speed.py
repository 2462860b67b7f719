"""Benchmark: our engine's batched AR decoding vs transformers' eager `generate` at the same batch size.

    python benchmarks/runtime/engine_speed.py --batch 64 --max-new-tokens 32 --json docs/results/runtime/engine_speed.json

Both decode the same chat prompts greedily to the same length (eos ignored), alternating; reports output
tokens/s, the ratio, and the engine's achieved FLOP/s as a fraction of this machine's measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.engine.engine_factory import EngineConfig, EngineModels, build_engine
from adaflash.engine.request import Request
from adaflash.evaluation.flops import linear_flops_per_token, matmul_peak_flops, served_gflops
from adaflash.models.kernels.dtype import resolve_dtype
from adaflash.models.targets.registry import load_tokenizer, resolve_target, transformers_model
from adaflash.models.targets.model import load_target_as
from adaflash.report import write_json


def engine_tokens_per_s(target, prompts: list[list[int]], max_new_tokens: int) -> float:
    engine = build_engine(EngineConfig(max_batch=len(prompts), max_len=max(map(len, prompts)) + max_new_tokens + 1),
                          EngineModels(target))
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", ids, max_new_tokens))  # no stop tokens: fixed length
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return len(prompts) * max_new_tokens / (time.perf_counter() - start)


def hf_tokens_per_s(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for decoder-only
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return len(prompts) * max_new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", required=True, help="where the results go")
    args = parser.parse_args()
    configure_process(None)  # as every adaflash command runs (threads, allocator)
    dtype = resolve_dtype(args.dtype)
    checkpoint = resolve_target(args.model)
    tokenizer = load_tokenizer(checkpoint)
    chats = [p.messages for p in load_prompts("mt-bench", "eval")] * 4
    prompts = [tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in chats[: args.batch]]
    ours = load_target_as(checkpoint, args.dtype)
    hf = transformers_model(checkpoint, dtype)
    engine_runs, hf_runs = [], []
    for _ in range(args.repeats):
        engine_runs.append(engine_tokens_per_s(ours, prompts, args.max_new_tokens))
        hf_runs.append(hf_tokens_per_s(hf, tokenizer, prompts, args.max_new_tokens))
    peak = matmul_peak_flops(dtype)
    engine_med, hf_med = statistics.median(engine_runs), statistics.median(hf_runs)
    result = {
        "command": f"python benchmarks/runtime/engine_speed.py --batch {args.batch} --max-new-tokens {args.max_new_tokens} "
        f"--dtype {args.dtype} --repeats {args.repeats} --json {args.json}",
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "dtype": str(dtype)},
        "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "engine_tokens_per_s": engine_med, "transformers_tokens_per_s": hf_med, "speedup": engine_med / hf_med,
        "engine_runs": engine_runs, "transformers_runs": hf_runs,
        "matmul_peak_GFLOPs": peak / 1e9,
        # The linears' FLOPs of the output tokens; and with the prompts' prefill, which the wall time includes.
        "engine_fraction_of_compute_peak": linear_flops_per_token(ours.config) * engine_med / peak,
        "engine_fraction_with_prompts": served_gflops(ours.config, engine_med, sum(map(len, prompts)) / (
            len(prompts) * args.max_new_tokens))["with_prompts_gflops"] * 1e9 / peak,
    }
    write_json(result, args.json)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
