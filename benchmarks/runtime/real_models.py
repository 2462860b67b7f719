"""Benchmark: the real Qwen2.5-Coder GGUFs on our runtime against llama.cpp on the same file, in one run.

    python benchmarks/runtime/real_models.py --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --rounds 3 \
        --json docs/results/runtime/real_models.json

Per model and round, alternating (this VM's speed drifts over minutes): a streaming-read probe of the memory
bandwidth; `llama-bench` (`make peer`'s build) on the file: tg128 decode and prompt passes of 1 / 2 / 4 / 8 / 16 / 512
tokens; ours (`--dtype auto`: int8 for these K-quant files) on the same file: a 128-token greedy decode after a short
prompt, one forward pass appending 1 / 2 / 4 / 8 / 16 tokens to a 256-token context (the verify cost: logits at every
row, as a verification computes them), and a 512-token prefill (the last row's logits, as llama-bench's pp). Medians
over rounds; ratios are ours / llama.cpp, or a k-token pass / the same runtime's decode step.

Then greedy text on held-out prompts (gsm8k, humaneval, mt-bench, sharegpt-chat: 5 each, 64 new tokens): ours (int8)
against llama-server's greedy completion of the same token ids - the share of prompts with identical tokens, and the
mean share of positions equal up to the first difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for benchmarks/ (not installed)

from adaflash.cli_args import configure_process  # noqa: E402
from adaflash.data import load_prompts
from adaflash.evaluation.offline import cpu_label
from adaflash.evaluation.peer import launched_process, llama_server_command, peer_bin_dir, peer_env, require_binary
from adaflash.models.device.cpu import cpu_model
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.registry import target_gguf
from adaflash.pipeline import Pipeline
from adaflash.report import markdown_table, write_report
from adaflash.speculative.reference import autoregressive_generate
from benchmarks.runtime.runtime_speed import forward_cost_ms, measure_read_bandwidth

PASSES = (1, 2, 4, 8, 16)
PROMPT_SETS = (("gsm8k", 5), ("humaneval", 5), ("mt-bench", 5), ("sharegpt-chat", 5))
DECODE_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def llama_bench(gguf, threads: int) -> dict[str, float]:
    """tok/s of llama-bench's tg128 and pp of each pass size and 512, one repetition."""
    binary = require_binary(peer_bin_dir(), "llama-bench")
    sizes = ",".join(str(p) for p in (*PASSES, 512))
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", sizes, "-n", "128", "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(peer_bin_dir()), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out = {}
    for row in json.loads(proc.stdout):
        key = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
        out[key] = float(row["avg_ts"])
    return out


def prefill_ms(model, tokens: int, repeats: int = 2) -> float:
    """Median ms of a prefill of `tokens` into an empty cache, logits of the last row only (as llama-bench's pp)."""
    cache = model.new_cache(1, tokens)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(torch.arange(tokens) % 1000 + 100, RaggedBatch.build([0], [0], [tokens]), cache,
              logit_indices=torch.tensor([tokens - 1]))
        times.append(time.perf_counter() - t)
        cache.rollback(0, 0)
    return 1000 * statistics.median(times[1:])


def ours_round(pipeline: Pipeline) -> dict[str, float]:
    ids = pipeline.encode(messages=[{"role": "user", "content": DECODE_PROMPT}])
    r = autoregressive_generate(pipeline.target, ids, 128)  # no stop tokens: a fixed length
    out = {"decode_tok_s": (len(r.token_ids) - 1) / (r.stats.elapsed_s - r.stats.first_token_s)}
    for q, ms in forward_cost_ms(pipeline.target, 256, PASSES, repeats=3).items():
        out[f"pass{q}_ms"] = ms
    out["prefill512_tok_s"] = 512 / prefill_ms(pipeline.target, 512) * 1000
    return out


def greedy_agreement(pipeline: Pipeline, gguf, threads: int, new_tokens: int = 64) -> dict:
    prompts = [(p, pipeline.encode(messages=p.messages)) for name, count in PROMPT_SETS
               for p in load_prompts(name, "eval", limit=count)]
    cmd = llama_server_command(peer_bin_dir(), ["-m", str(gguf)], port=8931, parallel=1, ctx_per_slot=4096,
                               threads=threads, model_gguf=None)
    rows = []
    with launched_process("llama-server", cmd, "http://127.0.0.1:8931/health", gguf.parent / ".bench-server.log",
                          env=peer_env(peer_bin_dir())):
        for prompt, ids in prompts:
            body = {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "return_tokens": True,
                    "cache_prompt": False, "seed": 0}
            theirs = httpx.post("http://127.0.0.1:8931/completion", json=body, timeout=600).json()["tokens"]
            ours = pipeline.generate_ids(ids, "ar", max_new_tokens=new_tokens).token_ids
            n = min(len(ours), len(theirs))
            first = next((i for i in range(n) if ours[i] != theirs[i]), n)
            rows.append({"prompt": prompt.id, "dataset": prompt.dataset, "identical": ours[:n] == theirs[:n],
                         "equal_prefix": first, "compared": n})
    return {"prompts": rows, "identical_share": sum(r["identical"] for r in rows) / len(rows),
            "mean_equal_prefix_share": statistics.mean(r["equal_prefix"] / max(1, r["compared"]) for r in rows)}


def run(models: list[str], rounds: int, json_path: str) -> dict:
    threads = torch.get_num_threads()
    results = {"command": f"python benchmarks/runtime/real_models.py --models {','.join(models)} --rounds {rounds} "
                          f"--json {json_path}",
               "machine": {"cpu": cpu_model(), "threads": threads, "torch": torch.__version__}, "models": {}}
    for name in models:
        gguf = target_gguf(name)
        pipeline = Pipeline.load(name, dtype="auto")
        ours_runs, peer_runs, probes = [], [], []
        ours_round(pipeline)  # warm-up
        for _ in range(rounds):
            probes.append(max(measure_read_bandwidth().values()))
            peer_runs.append(llama_bench(gguf, threads))
            ours_runs.append(ours_round(pipeline))
        ours = {k: statistics.median(r[k] for r in ours_runs) for k in ours_runs[0]}
        peer = {k: statistics.median(r[k] for r in peer_runs) for k in peer_runs[0]}
        bandwidth = statistics.median(probes)
        weight_bytes = sum(f.streamed_bytes(1) for layer in pipeline.target.layers for f in layer.fast.values())
        weight_bytes += pipeline.target.fast_lm_head.streamed_bytes(1)
        peer_ms = {q: 1000 / peer[f"pp{q}"] * q for q in PASSES}
        results["models"][name] = {
            "gguf": gguf.name, "numerics": pipeline.target.numerics,
            "decode_weight_MB": round(weight_bytes / 1e6, 1), "read_bandwidth_GBps": round(bandwidth, 2),
            "ours": {k: round(v, 2) for k, v in ours.items()}, "llama_cpp": {k: round(v, 2) for k, v in peer.items()},
            "ours_runs": ours_runs, "llama_cpp_runs": peer_runs, "read_bandwidth_probes_GBps": probes,
            "decode_over_llama_bench_tg128": round(ours["decode_tok_s"] / peer["tg128"], 3),
            "decode_share_of_bandwidth_limit": round(ours["decode_tok_s"] * weight_bytes / (bandwidth * 1e9), 3),
            "prefill_over_llama_bench_pp512": round(ours["prefill512_tok_s"] / peer["pp512"], 3),
            "pass_over_decode_step": {q: round(ours[f"pass{q}_ms"] / ours["pass1_ms"], 2) for q in PASSES},
            "llama_cpp_pass_over_its_decode_step": {q: round(peer_ms[q] / (1000 / peer["tg128"]), 2) for q in PASSES},
        }
        results["models"][name]["greedy_vs_llama_cpp"] = greedy_agreement(pipeline, gguf, threads)
        del pipeline
    return results


def to_markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# Real models: Qwen2.5-Coder Q4_K_M GGUFs, ours vs llama.cpp on the same file", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {cpu_label(m)}, {m['threads']} threads, torch {m['torch']}; llama.cpp: `make peer`'s native "
             "build. Ours runs `--dtype auto` (int8 activations on these K-quant files, llama.cpp's arithmetic).", ""]
    rows = []
    for name, r in results["models"].items():
        o, p = r["ours"], r["llama_cpp"]
        rows.append([name, f"{o['decode_tok_s']:.1f}", f"{p['tg128']:.1f}", f"{r['decode_over_llama_bench_tg128']:.2f}x",
                     f"{r['decode_share_of_bandwidth_limit']:.0%}", f"{o['prefill512_tok_s']:.1f}", f"{p['pp512']:.1f}",
                     f"{r['prefill_over_llama_bench_pp512']:.2f}x"])
    lines.append(markdown_table(["model", "decode tok/s (ours)", "llama-bench tg128", "ours / llama.cpp",
                                 "ours / bandwidth limit", "prefill 512 tok/s (ours)", "llama-bench pp512",
                                 "ours / llama.cpp"], rows))
    lines += ["", "Bandwidth limit: the median streaming-read probe over the weight bytes a decode step streams "
              "(the packed linears; the embedding rows read are negligible). Medians over rounds, alternating.", "",
              "A pass of k tokens against the same runtime's decode step (the verify cost; ours: logits at every row):",
              ""]
    rows = []
    for name, r in results["models"].items():
        rows.append([name, "ours", *(f"{r['pass_over_decode_step'][q]:.2f}x" for q in PASSES[1:]),
                     f"{r['ours']['pass1_ms']:.1f}"])
        rows.append([name, "llama.cpp (pp k / tg128)",
                     *(f"{r['llama_cpp_pass_over_its_decode_step'][q]:.2f}x" for q in PASSES[1:]),
                     f"{1000 / r['llama_cpp']['tg128']:.1f}"])
    lines.append(markdown_table(["model", "runtime", *(f"{q} tokens" for q in PASSES[1:]), "decode step ms"], rows))
    lines += ["", "Greedy text against llama-server's greedy completion of the same token ids (64 new tokens):", ""]
    for name, r in results["models"].items():
        g = r.get("greedy_vs_llama_cpp")
        if g:
            lines.append(f"- {name}: {sum(x['identical'] for x in g['prompts'])} of {len(g['prompts'])} prompts "
                         f"identical; mean share of positions equal up to the first difference "
                         f"{g['mean_equal_prefix_share']:.0%}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = parser.parse_args()
    configure_process(None)
    results = run(args.models.split(","), args.rounds, args.json)
    write_report(args.json, results, to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
