"""Time vLLM's own engine step at each batch size and draft length, as JSON for `adaflash export vllm-schedule`.

Runs with the *vLLM* virtual environment's python (`make peer-vllm`), like vllm_offline.py, and imports nothing
from adaflash. For every draft length k (0: vLLM without a speculative config; k >= 1: DFlash with the drafter and
`num_speculative_tokens = k`) one engine is started; for every batch size B, B prompts run together twice, with
`ignore_eos` and a short and a long `max_tokens`, and the step time is the difference of the two runs' times over the
difference of their step counts (prefill and start-up cancel), the median of `--repeats` such pairs. A DFlash step is draft + verify of B * (k + 1) tokens:
what our throughput policy weighs against the tokens a step is expected to commit.

    .peer/vllm-venv/bin/python benchmarks/peers/vllm_step_cost.py --target OUT/target --drafter OUT/drafter \
        --prompts prompts.json --out vllm_step_cost.json

prompts.json: [{"id": str, "ids": [int, ...]}, ...] as for vllm_offline.py (cycled to fill a batch).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from vllm_offline import cpu_model, spec_counters


def _steps(llm, batch: int, tokens: int) -> float:
    """Engine steps of a run of `batch` requests in lockstep for `tokens` tokens: from vLLM's draft counter when it
    drafts (draft steps per request), else one step per token."""
    drafts = spec_counters(llm).get("spec_decode_num_drafts")
    return float(tokens) if drafts is None else drafts / batch


def _timed_run(llm, requests, tokens: int) -> tuple[float, float]:
    """(seconds, engine steps) of one generate call of `requests` for `tokens` tokens each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    before = _steps(llm, len(requests), 0)
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, _steps(llm, len(requests), tokens) - before


def time_steps(llm, prompts: list[list[int]], batch: int, short: int, long: int, repeats: int) -> dict:
    """The median over `repeats` (short run, long run) pairs of their time difference over their step difference."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(batch)]
    pairs = [(_timed_run(llm, requests, short), _timed_run(llm, requests, long)) for _ in range(repeats)]
    per_step = sorted((t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in pairs if s1 > s0)
    if not per_step:
        raise RuntimeError(f"batch {batch}: the long run took no more steps than the short one")
    return {"step_s": per_step[len(per_step) // 2], "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF checkpoint folder (`adaflash export vllm` OUT/target)")
    parser.add_argument("--drafter", required=True, help="drafter folder (OUT/drafter)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--drafts", default="0,1,2,3", help="draft lengths k to time (0: no speculative config)")
    parser.add_argument("--short", type=int, default=4, help="max_tokens of the short run")
    parser.add_argument("--long", type=int, default=36, help="max_tokens of the long run")
    parser.add_argument("--repeats", type=int, default=3, help="(short, long) pairs per cell; the median is kept")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import LLM
    from vllm.inputs import TokensPrompt

    prompts = [p["ids"] for p in json.load(open(args.prompts))]
    batches = [int(b) for b in args.batches.split(",")]
    table: dict[str, dict[str, dict]] = {}
    for k in (int(x) for x in args.drafts.split(",")):
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": k} if k else None
        # No prefix caching: the long run would find the short run's prompts cached and skip their prefill, which
        # must cancel in the difference.
        llm = LLM(model=args.target, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len, seed=0,
                  speculative_config=spec, disable_log_stats=False, max_num_seqs=max(batches),
                  enable_prefix_caching=False)
        _timed_run(llm, [TokensPrompt(prompt_token_ids=prompts[0])], args.short)  # warm-up
        for b in batches:
            table.setdefault(str(b), {})[str(k)] = row = time_steps(llm, prompts, b, args.short, args.long, args.repeats)
            print(f"k={k} B={b}: {1000 * row['step_s']:.1f} ms a step", flush=True)
        del llm
    import torch
    import vllm

    report = {"vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_model(), "cpus": os.cpu_count(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "dtype": "float32", "enforce_eager": True,
              "what": "vLLM engine step time by batch size B and draft length k (k = 0: no speculative config)",
              "step_s": {b: {k: row["step_s"] for k, row in by_k.items()} for b, by_k in table.items()},
              "runs": table}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
