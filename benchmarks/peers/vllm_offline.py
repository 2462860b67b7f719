"""Run vLLM offline on token-id prompts and write what it generated and accepted, as JSON.

Runs with the *vLLM* virtual environment's python (`make peer-vllm`: .peer/vllm-venv/bin/python), never ours, so it
imports nothing from adaflash. Prompts are token ids (our chat template, our tokenizer), so both engines see the
same inputs. Greedy; fp32; enforce_eager (CPU build).

    .peer/vllm-venv/bin/python benchmarks/peers/vllm_offline.py --target DIR [--drafter DIR] \
        --prompts prompts.json --max-tokens 64 --out out.json

prompts.json: [{"id": str, "ids": [int, ...]}, ...]. Per prompt the output has `token_ids`, `text`, and with a
drafter vLLM's own per-request counters (`per_request_spec_decode_metrics="detailed"`: accepted and drafted tokens
of every verify step); `--logprobs 2` adds the top-2 log-probability gap of every generated token (to tell a float
tie from a real divergence). The work sits under `if __name__ == "__main__":`: vLLM spawns its engine core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def grouped_rms_norm_is_per_row() -> bool:
    """Whether vLLM's rms_norm op applies row i of a 2-D weight [L, d] to group i of an [L, ..., d] input, as DFlash's
    context-key norm (`DFlashQwen3Model._normalize_context_k`: one k_norm row per draft layer) needs."""
    import torch
    from vllm import _custom_ops as ops

    x, w = torch.randn(2, 3, 8), torch.stack([torch.ones(8), torch.full((8,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    expected = 2.0 * x[1] * torch.rsqrt(x[1].pow(2).mean(-1, keepdim=True) + 1e-6)
    return bool(torch.allclose(out[1], expected, atol=1e-4))


def fix_dflash_context_k_norm() -> bool:
    """vLLM 0.32.0's CPU rms_norm uses the weight's first row for every group, so draft layers >= 1 norm their context
    keys with layer 0's k_norm (their drafts then differ from the checkpoint's). Norm each layer with its own row;
    only where the probe shows the fault. Patches this process: the engine must run in it (see main)."""
    if grouped_rms_norm_is_per_row():
        return False
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    def _normalize_context_k(self, all_k):
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k
    return True


def _speculative_config(args) -> dict | None:
    if args.drafter is None:
        return None
    spec = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    if args.spec_extra:
        spec.update(json.loads(args.spec_extra))
    return spec


def _gap(entry) -> float:
    """Top-1 minus top-2 log-probability at one generated position (inf when only one was returned)."""
    values = sorted((lp.logprob for lp in entry.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def spec_counters(llm) -> dict:
    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens")
    out = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[metric.name.split(":", 1)[1]] = int(metric.value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF checkpoint folder (`adaflash export vllm` OUT/target)")
    parser.add_argument("--drafter", default=None, help="drafter folder (OUT/drafter); omit for AR")
    parser.add_argument("--method", default="dflash", help="speculative_config method")
    parser.add_argument("--num-speculative-tokens", type=int, default=15)
    parser.add_argument("--spec-extra", default=None, help="JSON merged into speculative_config")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--sequential", action="store_true", help="generate the prompts one at a time")
    parser.add_argument("--fix-context-k-norm", action="store_true",
                        help="patch vLLM's DFlash context-key norm where its CPU rms_norm ignores per-layer weights "
                             "(runs the engine in this process so the patch applies)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.fix_context_k_norm:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process, before vllm is imported

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.load(open(args.prompts))
    spec = _speculative_config(args)
    per_row = grouped_rms_norm_is_per_row()
    fixed = fix_dflash_context_k_norm() if args.fix_context_k_norm else False
    start = time.perf_counter()
    llm = LLM(model=args.target, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len, seed=0,
              speculative_config=spec, disable_log_stats=False,
              per_request_spec_decode_metrics="detailed" if spec else "none",
              **({"distributed_executor_backend": "uni"} if args.fix_context_k_norm else {}))
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs or None)
    start = time.perf_counter()
    requests = [TokensPrompt(prompt_token_ids=p["ids"]) for p in prompts]
    if args.sequential:  # one request at a time: every step runs at batch size 1
        outputs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
    else:
        outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    results = []
    for p, out in zip(prompts, outputs):
        completion = out.outputs[0]
        row = {"id": p["id"], "token_ids": list(completion.token_ids), "text": completion.text,
               "finish_reason": completion.finish_reason}
        metrics = getattr(completion, "spec_decode_metrics", None)
        if metrics is not None:
            row["spec"] = metrics.to_dict()
        if args.logprobs and completion.logprobs:
            row["top2_gap"] = [_gap(entry) for entry in completion.logprobs]
        results.append(row)
    import torch
    import vllm

    generated = sum(len(r["token_ids"]) for r in results)
    report = {
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_model(), "cpus": os.cpu_count(),
        # the engine core's torch threads: OMP_NUM_THREADS when set (vLLM otherwise lowers 2 cores to 1 thread)
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "dtype": "float32",
        "enforce_eager": True, "speculative_config": spec,
        "rms_norm_per_row_weights": per_row, "context_k_norm_patched": fixed,
        "max_tokens": args.max_tokens, "prompts": len(prompts), "sequential": args.sequential,
        "load_s": load_s, "generate_s": elapsed, "output_tokens": generated,
        "output_tok_per_s": generated / elapsed if elapsed else None,
        "counters": spec_counters(llm), "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
