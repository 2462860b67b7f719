"""Check: a real GGUF's fp32 target (`--dtype fp32`: the file's values, our kernels over its blocks) against
transformers' own load of the same file, greedy, on held-out prompts; and what a process holds for it.

    python benchmarks/runtime/gguf_fp32_oracle.py --model qwen2.5-coder-0.5b --prompts 8 --new-tokens 32 \
        --json docs/results/runtime/gguf_fp32_oracle.json
    python benchmarks/runtime/gguf_fp32_oracle.py --memory-only qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
        --json docs/results/runtime/gguf_memory.json

Per prompt (gsm8k, humaneval, mt-bench, sharegpt-chat, in turn): our greedy tokens and transformers' `generate`
(greedy) from the same chat-templated ids, compared up to the first EOS ours chose. Our runtime sums in another order
than transformers' matmuls, so a near-tie may part them; each difference is reported with the top-2 logit gap of
transformers at that position. Then the peak resident memory of a fresh process that loads the model with `--dtype
auto` and generates, against the file's size.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.evaluation.offline import cpu_label
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import resolve_target, target_gguf, transformers_model
from adaflash.pipeline import Pipeline
from adaflash.report import markdown_table, write_report
from adaflash.speculative.reference import autoregressive_generate

SETS = ("gsm8k", "humaneval", "mt-bench", "sharegpt-chat")


def peak_rss_of_a_generation(model: str) -> dict:
    """A fresh process: load `model` with --dtype auto, generate 16 tokens; its peak RSS (GB)."""
    # VmHWM, not getrusage's ru_maxrss: a child's ru_maxrss starts from its parent's at the fork (this one's: GBs)
    code = ("from adaflash.pipeline import Pipeline; "
            f"p = Pipeline.load({model!r}); ids = p.encode(messages=[{{'role': 'user', 'content': 'Say hi.'}}]); "
            "p.generate_ids(ids, 'ar', max_new_tokens=16); "
            "status = dict(l.split(':', 1) for l in open('/proc/self/status')); "
            "print(p.target.numerics, status['VmHWM'].split()[0], status['VmRSS'].split()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"numerics": out[-3], "peak_rss_GB": round(int(out[-2]) / 1e6, 2), "rss_after_GB": round(int(out[-1]) / 1e6, 2)}


def run(model: str, prompts: int, new_tokens: int, json_path: str) -> dict:
    checkpoint = resolve_target(model)
    pipeline = Pipeline.load(model, dtype="fp32")
    hf = transformers_model(checkpoint)
    chosen = [p for i in range(prompts) for p in load_prompts(SETS[i % len(SETS)], "eval", limit=i // len(SETS) + 1)[-1:]]
    rows = []
    for prompt in chosen:
        ids = pipeline.encode(messages=prompt.messages)
        ours = autoregressive_generate(pipeline.target, ids, new_tokens, stop_token_ids=pipeline.stop_token_ids).token_ids
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=len(ours), min_new_tokens=len(ours), do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        theirs = out.sequences[0, len(ids):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        gap = None
        if first is not None:
            top2 = torch.topk(out.scores[first][0].float(), 2).values
            gap = round(float(top2[0] - top2[1]), 4)
        rows.append({"prompt": prompt.id, "dataset": prompt.dataset, "tokens": len(ours), "identical": first is None,
                     "first_difference": first, "transformers_top2_gap_there": gap})
    gguf = target_gguf(model)
    return {"command": f"python benchmarks/runtime/gguf_fp32_oracle.py --model {model} --prompts {prompts} "
                       f"--new-tokens {new_tokens} --json {json_path}",
            "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__},
            "model": model, "gguf": gguf.name, "file_GB": round(gguf.stat().st_size / 1e9, 3), "prompts": rows,
            "identical": sum(r["identical"] for r in rows), "memory": peak_rss_of_a_generation(model),
            "this_process_peak_rss_GB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def to_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"# {r['model']}: our fp32 target against transformers' own load of {r['gguf']}", "",
             f"Command: `{r['command']}`  ", f"Machine: {cpu_label(m)}, {m['threads']} threads, torch {m['torch']}.", "",
             f"Greedy tokens identical to transformers' on {r['identical']} of {len(r['prompts'])} held-out prompts.", "",
             markdown_table(["prompt", "set", "tokens", "identical", "first difference", "transformers' top-2 gap there"],
                            [[p["prompt"], p["dataset"], p["tokens"], p["identical"], p["first_difference"],
                              p["transformers_top2_gap_there"]] for p in r["prompts"]]), "",
             f"Memory: a fresh process loading it with `--dtype auto` ({r['memory']['numerics']}) and generating 16 "
             f"tokens peaks at {r['memory']['peak_rss_GB']} GB resident ({r['memory']['rss_after_GB']} GB after "
             f"generating), for a {r['file_GB']} GB file: the packed blocks, the fp32 embedding, the mapped file's "
             "pages read while packing, torch and the tokenizer."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--memory-only", default=None, metavar="MODELS",
                        help="only the fresh-process memory of each of these comma-separated models")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    configure_process(None)
    if args.memory_only:
        results = {"command": f"python benchmarks/runtime/gguf_fp32_oracle.py --memory-only {args.memory_only} "
                              f"--json {args.json}", "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads()},
                   "models": {m: {**peak_rss_of_a_generation(m), "file_GB": round(target_gguf(m).stat().st_size / 1e9, 3)}
                              for m in args.memory_only.split(",")}}
        text = "\n".join(["# Memory of a process generating from a GGUF (`--dtype auto`, 16 tokens)", "",
                          f"Command: `{results['command']}`  ", f"Machine: {cpu_label(results['machine'])}.", "",
                          markdown_table(["model", "numerics", "file GB", "peak resident GB (VmHWM)",
                                          "resident after generating GB"],
                                         [[m, r["numerics"], r["file_GB"], r["peak_rss_GB"], r["rss_after_GB"]]
                                          for m, r in results["models"].items()])]) + "\n"
        write_report(args.json, results, text)
        print(text)
        return
    results = run(args.model, args.prompts, args.new_tokens, args.json)
    write_report(args.json, results, to_markdown(results))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
