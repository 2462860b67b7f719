"""Benchmark: our runtime's batch-1 AR decoding vs transformers' `generate`, side by side in one process.

    python benchmarks/runtime/runtime_speed.py --json docs/results/runtime/runtime_speed.json

Both decode the same chat prompts greedily to the same length, alternating run by run (this machine is
noisy); medians are reported with the measured memory bandwidth and the bandwidth limit of the weight bytes a
decode step streams. Where the packed kernels are available ours runs four times: with the per-machine kernel
choice (the default: the quantized kernel over the GGUF's blocks where it is faster, one kernel call per layer),
the same with the layers run op by op from Python (ADAFLASH_LAYER_STEP=0), with the packed fp32 kernel only
(ADAFLASH_KERNELS=packed) and with torch's stock kernels (=stock), so what each piece buys is measured in the same run.
In fp32 a fifth variant runs `--dtype int8` (the GGUF's blocks with int8-rounded activations: llama.cpp's
arithmetic, another model than the fp32 target, so its tokens may part from the others'). When llama.cpp is built
(`make peer`), its `llama-bench` decode on the target's own GGUF is reported beside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch
from tqdm import tqdm

from adaflash.cli_args import configure_process
from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.evaluation.offline import cpu_label, environment
from adaflash.models.device.placement import synchronize
from adaflash.models.device.cpu import cpu_has_native_bf16
from adaflash.models.kernels.dtype import DTYPES
from adaflash.models.device.cpu import cpu_model
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.registry import load_tokenizer, resolve_target, transformers_model
from adaflash.models.targets.model import load_target
from adaflash.report import markdown_table, write_report
from adaflash.speculative.reference import autoregressive_generate


def measure_read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> dict[str, float]:
    """GB/s of a streaming read of a buffer far larger than the caches, by two probes: torch's sum of fp32 values, and
    an AVX2 read loop (kernels/fused.cpp) where our kernels run. The bandwidth limit takes the faster: a probe that
    reads slower than the memory can makes every limit too low (and a kernel look nearer to it than it is)."""
    from adaflash.models.kernels import packed

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    probes = {"torch sum": x.sum}
    lib = packed.library()
    if lib is not None:
        threads = torch.get_num_threads()
        probes["AVX2 read"] = lambda: lib.adaflash_stream_read(x.data_ptr(), num_bytes, threads)
    out = {}
    for name, probe in probes.items():
        probe()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            probe()
            times.append(time.perf_counter() - t)
        out[name] = num_bytes / statistics.median(times) / 1e9
    return out


def forward_cost_ms(model, context: int, query_lens=(1, 2, 4, 8, 16), repeats: int = 5) -> dict[int, float]:
    """Median ms of one target forward appending q tokens to a `context`-token cache (the verify cost curve)."""
    cache = model.new_cache(1, context + max(query_lens))
    model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
    out = {}
    for q in query_lens:
        times = []
        for _ in range(repeats + 1):
            synchronize(model.device)  # the clock read after the GPU's queued work, not at its launch
            t = time.perf_counter()
            model(torch.arange(q) + 100, RaggedBatch.build([0], [context], [q]), cache)
            synchronize(model.device)
            times.append(time.perf_counter() - t)
            cache.rollback(0, context)
        out[q] = 1000 * statistics.median(times[1:])
    return out


def llama_bench_decode(model_name: str, tokens: int, threads: int, repeats: int = 3) -> dict | None:
    """llama.cpp's batch-1 decode (`llama-bench -p 0 -n N`) on the embedded target's GGUF, or None if not built."""
    from adaflash.evaluation.peer import peer_bin_dir, peer_env
    from adaflash.models.targets.registry import target_gguf

    binary = peer_bin_dir() / "llama-bench"
    if not binary.is_file():
        return None
    gguf = target_gguf(model_name)
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(peer_bin_dir()), timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    (row,) = json.loads(proc.stdout)
    return {"command": " ".join(cmd), "gguf": gguf.name, "model_type": row.get("model_type"),
            "tokens_per_s": round(float(row["avg_ts"]), 2), "stddev": round(float(row.get("stddev_ts", 0.0)), 2),
            "build": row.get("build_commit")}


def run(model_name: str, dtype_names: list[str], max_new_tokens: int, repeats: int, json_path: str) -> dict:
    checkpoint = resolve_target(model_name)
    tokenizer = load_tokenizer(checkpoint)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for _, text in DEMO_PROMPTS
    ]
    # The VM's memory speed moves with its neighbours over minutes: probed before every round of runs, and the limit
    # takes the median of the rounds' fastest probes.
    probes = [measure_read_bandwidth()]
    peer_runs: list[dict] = []  # llama-bench's decode, one run a round
    weight_bytes_of: dict[str, int] = {}  # per dtype: the weight bytes a decode step streams
    results = {
        "command": f"python benchmarks/runtime/runtime_speed.py --model {model_name} --dtypes {','.join(dtype_names)} "
        f"--max-new-tokens {max_new_tokens} --repeats {repeats} --json {json_path}",
        "machine": {
            "cpu": cpu_model(),
            "processor": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu_has_native_bf16(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "max_new_tokens": max_new_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "by_dtype": {},
    }
    for name in dtype_names:
        dtype = DTYPES[name]
        # Each variant loads and runs under its own ADAFLASH_KERNELS mode: the linears fix their kernels at load,
        # attention and the fused steps read the mode at every call.
        modes = {"chosen": {"ADAFLASH_KERNELS": os.environ.get("ADAFLASH_KERNELS", "auto")}}
        ours = {"chosen": load_target(checkpoint, dtype=dtype)}
        if ours["chosen"].layer_steps is not None:  # the same model and kernels, layers run op by op from Python
            modes["chosen, op-by-op layers"] = {**modes["chosen"], "ADAFLASH_LAYER_STEP": "0"}
            ours["chosen, op-by-op layers"] = ours["chosen"]
        if ours["chosen"].fast_lm_head is not None:  # what each kernel buys, in the same run
            for variant, mode in (("packed fp32", "packed"), ("stock", "stock")):
                modes[variant] = {"ADAFLASH_KERNELS": mode}
                with environment(modes[variant]):
                    ours[variant] = load_target(checkpoint, dtype=dtype)
            if dtype == torch.float32:
                modes[INT8_VARIANT] = modes["chosen"]
                ours[INT8_VARIANT] = load_target(checkpoint, dtype=dtype, int8_activations=True)
        hf = transformers_model(checkpoint, dtype)
        tps = {variant: [] for variant in ours}
        decode_tps = {variant: [] for variant in ours}  # after the first token: what llama-bench's tg measures
        hf_tps, agree = [], []
        same_as_chosen = {variant: [] for variant in ours}
        for variant, model in ours.items():  # warm-up all
            with environment(modes[variant]):
                autoregressive_generate(model, prompts[0], 4)
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
        with tqdm(total=repeats * len(prompts) * (len(ours) + 1), desc=f"runtime vs HF ({name})", unit="run") as bar:
            for _ in range(repeats):
                probes.append(measure_read_bandwidth())
                peer = llama_bench_decode(model_name, max_new_tokens, torch.get_num_threads(), repeats=1)
                if peer is not None:  # once a round, between ours: the VM's speed drifts over minutes
                    peer_runs.append(peer)
                for ids in prompts:
                    outputs = {}
                    for variant, model in ours.items():
                        with environment(modes[variant]):
                            r = autoregressive_generate(model, ids, max_new_tokens)  # no stop tokens: fixed length
                        tps[variant].append(len(r.token_ids) / r.stats.elapsed_s)
                        decode_tps[variant].append((len(r.token_ids) - 1) / (r.stats.elapsed_s - r.stats.first_token_s))
                        outputs[variant] = r.token_ids
                        bar.update(1)
                    for variant, out in outputs.items():
                        same_as_chosen[variant].append(out == outputs["chosen"])
                    synchronize(hf.device)
                    t = time.perf_counter()
                    with torch.inference_mode():
                        out = hf.generate(
                            torch.tensor([ids], device=hf.device), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                        )
                    synchronize(hf.device)
                    hf_tps.append(max_new_tokens / (time.perf_counter() - t))
                    hf_ids = out[0, len(ids):].tolist()
                    # min_new_tokens masks transformers' EOS, so compare up to the first EOS ours chose.
                    ours_ids = outputs["chosen"]
                    if tokenizer.eos_token_id in ours_ids:
                        ours_ids = ours_ids[: ours_ids.index(tokenizer.eos_token_id)]
                    agree.append(sum(a == b for a, b in zip(hf_ids, ours_ids)) / max(1, len(ours_ids)))
                    bar.update(1)
        hf_med = statistics.median(hf_tps)
        costs = {}
        for variant, model in ours.items():
            with environment(modes[variant]):
                costs[variant] = forward_cost_ms(model, 256)
        chosen = ours["chosen"]
        weight_bytes = weight_bytes_of[name] = chosen.streamed_weight_bytes(1)
        ours_med = statistics.median(tps["chosen"])
        results["by_dtype"][name] = {
            "ours_tokens_per_s": round(ours_med, 2),
            "transformers_tokens_per_s": round(hf_med, 2),
            "speedup": round(ours_med / hf_med, 3),
            "transformers_runs": [round(x, 2) for x in hf_tps],
            "decode_weight_MB": round(weight_bytes / 1e6, 1),
            "token_agreement_with_transformers": round(statistics.mean(agree), 4),
            "variants": {
                variant: {
                    "tokens_per_s": round(statistics.median(tps[variant]), 2),
                    "decode_tokens_per_s": round(statistics.median(decode_tps[variant]), 2),
                    "runs": [round(x, 2) for x in tps[variant]],
                    "decode_weight_MB": round(model.streamed_weight_bytes(1) / 1e6, 1),
                    "runs_identical_to_chosen": f"{sum(same_as_chosen[variant])}/{len(same_as_chosen[variant])}",
                    "forward_ms_by_query_len_ctx256": {str(k): round(v, 1) for k, v in costs[variant].items()},
                }
                for variant, model in ours.items()
            },
        }
        del ours, chosen, hf
    # One bandwidth for every dtype's limit: the median over all rounds of each round's fastest probe.
    bandwidth = statistics.median(max(p.values()) for p in probes)
    results["machine"]["read_bandwidth_GBps"] = round(bandwidth, 2)
    for name, r in results["by_dtype"].items():
        limit = bandwidth * 1e9 / weight_bytes_of[name]
        r["bandwidth_limit_tokens_per_s"] = round(limit, 1)
        r["fraction_of_bandwidth_limit"] = round(r["variants"]["chosen"]["decode_tokens_per_s"] / limit, 3)
    results["machine"]["read_bandwidth_probes_GBps"] = [{k: round(v, 2) for k, v in p.items()} for p in probes]
    results["llama_cpp"] = None
    if peer_runs:
        runs = [r["tokens_per_s"] for r in peer_runs]
        results["llama_cpp"] = {**peer_runs[0], "tokens_per_s": round(statistics.median(runs), 2), "runs": runs}
    if results["llama_cpp"]:
        peer = results["llama_cpp"]["tokens_per_s"]
        for r in results["by_dtype"].values():
            # decode against decode (llama-bench's tg runs no prompt)
            r["ours_over_llama_cpp"] = round(r["variants"]["chosen"]["decode_tokens_per_s"] / peer, 3)
            if INT8_VARIANT in r["variants"]:
                r["int8_over_llama_cpp"] = round(r["variants"][INT8_VARIANT]["decode_tokens_per_s"] / peer, 3)
    return results


# --dtype int8: another model (int8-rounded activations), measured beside the fp32 target, never its stand-in.
INT8_VARIANT = "int8 activations (--dtype int8)"


def _probe_ranges(machine: dict) -> str:
    """'AVX2 read 52.3-70.2 GB/s, torch sum 38.1-41.0 GB/s' over the run's bandwidth probes."""
    probes = machine.get("read_bandwidth_probes_GBps") or []
    names = sorted({name for p in probes for name in p})
    return ", ".join(f"{n} {min(p[n] for p in probes if n in p):.1f}-{max(p[n] for p in probes if n in p):.1f} GB/s"
                     for n in names) or "one probe"


def to_markdown(results: dict) -> str:
    m = results["machine"]
    rows = []
    for name, r in results["by_dtype"].items():
        for variant, v in r["variants"].items():
            limit = m["read_bandwidth_GBps"] * 1e3 / v["decode_weight_MB"]
            rows.append([name, variant, v["tokens_per_s"], v["decode_tokens_per_s"], v["decode_weight_MB"], f"{limit:.1f}",
                         f"{v['decode_tokens_per_s'] / limit:.0%}",
                         f"{v['tokens_per_s'] / r['transformers_tokens_per_s']:.2f}x", v["runs_identical_to_chosen"]])
        rows.append([name, "transformers `generate`", r["transformers_tokens_per_s"], "", "", "", "", "1.00x", ""])
    lines = [
        "# Runtime speed: batch-1 greedy AR decoding, ours vs transformers `generate`",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {cpu_label(m)}, {m['cpu_capability']}, native bf16: {m['native_bf16']}, {m['threads']} threads, "
        f"torch {m['torch']}, measured read bandwidth {m['read_bandwidth_GBps']} GB/s (median over "
        f"{len(m.get('read_bandwidth_probes_GBps', [])) or 1} probes, one before each round of runs, of the fastest "
        f"probe: {_probe_ranges(m)}).  ",
        f"{results['max_new_tokens']} new tokens per run, prompts of {results['prompt_tokens']} tokens, medians over alternating runs.",
        "",
        markdown_table(["dtype", "kernels", "tok/s", "decode tok/s", "decode weight MB", "bandwidth limit tok/s",
                        "decode / limit", "vs transformers", "runs with tokens identical to chosen"], rows),
    ]
    lines += ["", "Token agreement with transformers (chosen kernels): "
              + ", ".join(f"{n} {r['token_agreement_with_transformers']:.0%}" for n, r in results["by_dtype"].items())
              + ". chosen = the per-machine choice per weight and row count (kernels/selection.py: the quantized "
              "kernel over the GGUF's own blocks where it measured fastest, one kernel call per decoder layer); "
              "op-by-op layers = the same kernels called layer op by layer op from Python (bitwise the same); "
              "packed fp32 = the packed kernel on the "
              "dequantized fp32 weights (bitwise the quantized kernel's outputs); stock = torch's kernels (another summation "
              f"order: may part at float ties); {INT8_VARIANT} = the GGUF's blocks with activations rounded to int8 "
              "per 32 values (int8_linear.cpp, llama.cpp's arithmetic): another model, so its tokens may part."]
    lines += ["tok/s: new tokens over the whole generation, the prompt's prefill included (as transformers' is timed); "
              "decode tok/s: the tokens after the first over the time after it - what the bandwidth limit and "
              "llama-bench's tg measure."]
    lines += ["Token agreement: the share of positions where our greedy tokens equal transformers', up to the first EOS "
              "ours chose (transformers' `min_new_tokens` masks EOS to decode a fixed length)."]
    peer = results.get("llama_cpp")
    if peer:
        lines += ["", f"llama.cpp (`{peer['command']}`, the same {peer['gguf']} our quantized kernels stream): "
                  f"{peer['tokens_per_s']} tok/s (median of {len(peer.get('runs', [1]))} runs, one a round between "
                  "ours); ours (decode tok/s) / llama.cpp: "
                  + ", ".join(f"{n} {r['ours_over_llama_cpp']:.2f}x" for n, r in results["by_dtype"].items())
                  + "".join(f", {n} {INT8_VARIANT} {r['int8_over_llama_cpp']:.2f}x"
                            for n, r in results["by_dtype"].items() if "int8_over_llama_cpp" in r)]
    lines += ["", "Target forward cost (ms) appending q tokens to a 256-token context (the verify cost curve):", ""]
    first_variant = next(iter(next(iter(results["by_dtype"].values()))["variants"].values()))
    qs = list(first_variant["forward_ms_by_query_len_ctx256"])
    costs = [(name, variant, v["forward_ms_by_query_len_ctx256"])
             for name, r in results["by_dtype"].items() for variant, v in r["variants"].items()]
    lines.append(markdown_table(["dtype", "kernels", *(f"q={q}" for q in qs), "q=16 / q=1"],
                                [[name, variant, *(cost[q] for q in qs), f"{cost[qs[-1]] / cost[qs[0]]:.2f}"]
                                 for name, variant, cost in costs]))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = parser.parse_args()
    configure_process(None)  # as every adaflash command runs (threads, allocator)
    results = run(args.model, args.dtypes.split(","), args.max_new_tokens, args.repeats, args.json)
    write_report(args.json, results, to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
