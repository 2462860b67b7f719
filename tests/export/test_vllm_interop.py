"""vLLM's CPU build (`make peer-vllm`) serving the embedded SmolLM2-135M with our shipped DFlash drafter, exported by
`adaflash export vllm`, against vLLM without speculation and against our own runtime, on 24 held-out-style prompts
(eval splits of four datasets), greedy, fp32, 64 new tokens, 15 drafts per step.

1. Lossless there too: vLLM with the drafter returns the token ids vLLM returns alone, up to float ties (a
   divergence is allowed only where vLLM's own AR top-2 log-probabilities are within TIE_NATS).
2. The conventions match (layers, RoPE, mask, features, the trimmed vocabulary kept as lm_head + d2t): vLLM's
   acceptance rate (accepted / drafted, from its per-request counters) is within 10% of our runtime's with the same
   drafter and draft length. Counted the same way in both: vLLM drafts 15 tokens at every step, even when fewer are
   left before max_tokens, where our runtime drafts only up to the budget; so our runtime runs with 15 more tokens
   of budget and only its steps that start before token 64 are counted (the steps vLLM runs). Our runtime's own
   budget-capped rate is reported beside it.
3. Same drafts, step by step: vLLM 0.32.0's CPU `rms_norm` applies the first row of a 2-D weight to every group, so
   its DFlash norms the context keys of draft layer 1 with layer 0's k_norm (`_normalize_context_k`). Where that
   fault is present the runner is rerun with `--fix-context-k-norm` (each layer's own row); then vLLM's accepted
   count at every verify step equals ours on at least MIN_SAME_STEPS of the prompts. As shipped, it differs on
   some steps (the acceptance *rate* still lands close: the shipped drafter is rarely accepted past position 1).
The numbers go to docs/results/peers/vllm_interop.json. vLLM runs as a subprocess with its own venv's python.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import helpers
from tests.export.peer_paths import REPO

pytestmark = [pytest.mark.peer, pytest.mark.slow]

VLLM_PYTHON = Path(os.environ.get("ADAFLASH_PEER_DIR", REPO / ".peer")) / "vllm-venv" / "bin" / "python"
RUNNER = REPO / "benchmarks" / "vllm_offline.py"
RESULTS = REPO / "docs" / "results" / "peers" / "vllm_interop.json"
PROMPT_SETS = (("gsm8k", 6), ("humaneval", 6), ("mt-bench", 6), ("sharegpt-chat", 6))
MAX_PROMPT_TOKENS = 384
MIN_PROMPTS = 20
MAX_TOKENS = 64
NUM_SPEC = 15  # block_size - 1: the whole block, as our runtime drafts it
THREADS = os.environ.get("ADAFLASH_PEER_THREADS", "2")
TOLERANCE = 0.10
TIE_NATS = 0.01
MAX_TIE_DIVERGENCES = 0.25  # of the prompts
MIN_SAME_STEPS = 0.9  # of the prompts: per-step acceptance identical to ours (a float tie may move one)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} missing): run `make peer-vllm` (a few minutes, 3.5 GB)")
    return VLLM_PYTHON


def run_vllm(python: Path, target: Path, prompts: Path, out: Path, drafter: Path | None = None,
             extra: list[str] = (), logprobs: int = 0) -> dict:
    cmd = [str(python), str(RUNNER), "--target", str(target), "--prompts", str(prompts), "--out", str(out),
           "--max-tokens", str(MAX_TOKENS), "--num-speculative-tokens", str(NUM_SPEC), "--logprobs", str(logprobs),
           *extra]
    if drafter is not None:
        cmd += ["--drafter", str(drafter)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=THREADS, VLLM_CPU_KVCACHE_SPACE="2")
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out.parent, timeout=1800)
    assert proc.returncode == 0, f"vLLM failed ({proc.returncode}):\n{log.read_text()[-4000:]}"
    return json.loads(out.read_text())


def held_out_prompts(pipeline, sets=PROMPT_SETS) -> list[dict]:
    return [{"id": prompt.id, "dataset": prompt.dataset, "ids": ids}
            for prompt, ids in helpers.held_out_prompts(pipeline, sets, MAX_PROMPT_TOKENS)]


def steps_before(accept_lengths: list[int], draft_lengths: list[int], limit: int) -> tuple[int, int, list[int]]:
    """(accepted, drafted, per-step accepted) over the steps that start with fewer than `limit` tokens committed:
    the steps a max_tokens=limit run makes (the prefill commits the first token)."""
    committed, accepted, drafted, per_step = 1, 0, 0, []
    for a, k in zip(accept_lengths, draft_lengths):
        if committed >= limit:
            break
        accepted, drafted = accepted + a - 1, drafted + k
        per_step.append(a - 1)
        committed += a
    return accepted, drafted, per_step


def rate(accepted: int, drafted: int) -> dict:
    return {"accepted": accepted, "drafted": drafted, "rate": accepted / drafted if drafted else float("nan")}


def first_divergence(ar: dict, spec: dict) -> dict | None:
    a, b = ar["token_ids"], spec["token_ids"]
    if a == b:
        return None
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    gap = ar["top2_gap"][at] if at < len(ar.get("top2_gap", [])) else float("inf")
    return {"position": at, "ar_top2_gap_nats": gap, "tie": gap < TIE_NATS}


@pytest.fixture(scope="module")
def interop(vllm_python, smollm2_dir, tmp_path_factory) -> dict:
    from adaflash.export.vllm import export_vllm
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.pipeline import Pipeline

    work = tmp_path_factory.mktemp("vllm")
    drafter_dir = shipped_drafter("smollm2-135m")
    export = export_vllm(drafter_dir, work / "export", smollm2_dir)
    pipeline = Pipeline.load(smollm2_dir, drafter=drafter_dir, dtype="fp32")
    prompts = held_out_prompts(pipeline)
    assert len(prompts) >= MIN_PROMPTS, f"only {len(prompts)} held-out prompts of <= {MAX_PROMPT_TOKENS} tokens"
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps([{"id": p["id"], "ids": p["ids"]} for p in prompts]))

    ar = run_vllm(vllm_python, export.target, prompts_file, work / "ar.json", logprobs=2)
    dflash = run_vllm(vllm_python, export.target, prompts_file, work / "dflash.json", drafter=export.drafter)
    fixed = dflash  # as shipped, where vLLM's rms_norm honours per-layer weights
    if not dflash["rms_norm_per_row_weights"]:
        fixed = run_vllm(vllm_python, export.target, prompts_file, work / "dflash-fixed.json", drafter=export.drafter,
                         extra=["--fix-context-k-norm"])
        assert fixed["context_k_norm_patched"]

    ours_matched, ours_capped = [0, 0], [0, 0]
    for p, v_ar, v_spec, v_fixed in zip(prompts, ar["results"], dflash["results"], fixed["results"]):
        p["vllm_ar"], p["vllm_dflash"], p["vllm_fixed"] = v_ar, v_spec, v_fixed
        long = pipeline.generate_ids(p["ids"], "dflash", max_new_tokens=MAX_TOKENS + NUM_SPEC, draft_length=NUM_SPEC)
        acc, drafted, per_step = steps_before(long.stats.accept_lengths, long.stats.draft_lengths, MAX_TOKENS)
        p["ours"] = {"accepted": acc, "drafted": drafted, "per_step_accepted": per_step,
                     "tokens_equal_vllm_ar": long.token_ids[:MAX_TOKENS] == v_ar["token_ids"]}
        ours_matched = [ours_matched[0] + acc, ours_matched[1] + drafted]
        capped = pipeline.generate_ids(p["ids"], "dflash", max_new_tokens=MAX_TOKENS, draft_length=NUM_SPEC).stats
        ours_capped = [ours_capped[0] + sum(a - 1 for a in capped.accept_lengths), ours_capped[1] + capped.draft_tokens]
        p["divergence"] = first_divergence(v_ar, v_spec)
        p["divergence_fixed"] = first_divergence(v_ar, v_fixed)

    spec = [p["vllm_dflash"]["spec"] for p in prompts]
    vllm_rate = rate(sum(s["num_accepted_draft_tokens"] for s in spec), sum(s["num_draft_tokens"] for s in spec))
    ours = rate(*ours_matched)
    identical_steps = sum(p["ours"]["per_step_accepted"] == s.get("per_step_accepted") for p, s in zip(prompts, spec))
    fixed_spec = [p["vllm_fixed"]["spec"] for p in prompts]
    fixed_rate = rate(sum(s["num_accepted_draft_tokens"] for s in fixed_spec),
                      sum(s["num_draft_tokens"] for s in fixed_spec))
    identical_fixed = sum(p["ours"]["per_step_accepted"] == s.get("per_step_accepted")
                          for p, s in zip(prompts, fixed_spec))
    result = {
        "what": "vLLM 0.32.0 (vllm-cpu, `make peer-vllm`) serving SmolLM2-135M-Instruct (`adaflash export vllm` "
                "target) with the shipped DFlash drafter (`adaflash export vllm` drafter: 4096-row draft vocabulary "
                "kept as lm_head + d2t), speculative_config method dflash, against vLLM AR and our runtime",
        "command": "pytest -m peer tests/export/test_vllm_interop.py",
        "machine": {"cpu": dflash["cpu"], "cpus": dflash["cpus"], "threads": THREADS, "dtype": "float32",
                    "enforce_eager": True, "vllm": dflash["vllm"], "torch": dflash["torch"]},
        "drafter": str(drafter_dir.relative_to(REPO)) if drafter_dir.is_relative_to(REPO) else str(drafter_dir),
        "speculative_config": {**dflash["speculative_config"], "model": "<adaflash export vllm>/drafter"},
        "max_tokens": MAX_TOKENS, "prompts": len(prompts),
        "datasets": {name: sum(p["dataset"] == name for p in prompts) for name, _ in PROMPT_SETS},
        "lossless": {"vllm_dflash_tokens_equal_vllm_ar": sum(p["divergence"] is None for p in prompts),
                     "vllm_dflash_fixed_tokens_equal_vllm_ar": sum(p["divergence_fixed"] is None for p in prompts),
                     "of": len(prompts), "tie_nats": TIE_NATS,
                     "differing": {p["id"]: p["divergence"] for p in prompts if p["divergence"] is not None}},
        "our_tokens_equal_vllm_ar": sum(p["ours"]["tokens_equal_vllm_ar"] for p in prompts),
        "acceptance": {"vllm": vllm_rate, "vllm_engine_counters": dflash["counters"], "adaflash_runtime": ours,
                       "adaflash_runtime_budget_capped": rate(*ours_capped)},
        "relative_difference": abs(vllm_rate["rate"] - ours["rate"]) / ours["rate"] if ours["rate"] else float("nan"),
        "tolerance": TOLERANCE,
        "prompts_with_identical_per_step_acceptance": identical_steps,
        "vllm_rms_norm_per_row_weights": dflash["rms_norm_per_row_weights"],
        "context_k_norm_fixed": {"acceptance": fixed_rate,
                                 "prompts_with_identical_per_step_acceptance": identical_fixed,
                                 "relative_difference": abs(fixed_rate["rate"] - ours["rate"]) / ours["rate"]
                                 if ours["rate"] else float("nan"),
                                 "patched": fixed["context_k_norm_patched"]},
        "speed": {"vllm_ar_output_tok_per_s": ar["output_tok_per_s"],
                  "vllm_dflash_output_tok_per_s": dflash["output_tok_per_s"],
                  "note": f"{len(prompts)} prompts in one offline generate() call; load excluded; "
                                  "the AR run also returns top-2 log-probabilities"},
        "per_prompt": [{"id": p["id"], "dataset": p["dataset"], "prompt_tokens": len(p["ids"]),
                        "vllm": {"accepted": s["num_accepted_draft_tokens"], "drafted": s["num_draft_tokens"],
                                 "per_step_accepted": s.get("per_step_accepted")},
                        "vllm_fixed_per_step_accepted": p["vllm_fixed"]["spec"].get("per_step_accepted"),
                        "ours": p["ours"]} for p, s in zip(prompts, spec)],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return {"result": result, "prompts": prompts}


@pytest.mark.timeout(7200)
@pytest.mark.parametrize("run", ["divergence", "divergence_fixed"])
def test_vllm_with_our_drafter_reproduces_its_own_greedy_tokens(interop, run):
    prompts = interop["prompts"]
    diverged = [p for p in prompts if p[run] is not None]
    not_ties = [(p["id"], p[run]) for p in diverged if not p[run]["tie"]]
    assert not not_ties, f"vLLM's DFlash output leaves its AR output away from a float tie: {not_ties}"
    assert len(diverged) <= MAX_TIE_DIVERGENCES * len(prompts), [p["id"] for p in diverged]
    assert all(len(p["vllm_ar"]["token_ids"]) > 0 for p in prompts)


@pytest.mark.timeout(7200)
def test_acceptance_matches_our_runtime_within_ten_percent(interop):
    result = interop["result"]
    acceptance = result["acceptance"]
    assert acceptance["vllm"]["drafted"] > 0, "vLLM drafted nothing: was the drafter loaded?"
    # vLLM's engine-wide counters agree with the per-request ones the comparison uses.
    assert acceptance["vllm_engine_counters"]["spec_decode_num_accepted_tokens"] == acceptance["vllm"]["accepted"]
    assert result["relative_difference"] <= TOLERANCE, (
        f"vLLM accepts {acceptance['vllm']['rate']:.4f} of drafts, our runtime "
        f"{acceptance['adaflash_runtime']['rate']:.4f} (relative difference {result['relative_difference']:.1%}): "
        f"see {RESULTS}"
    )


@pytest.mark.timeout(7200)
def test_with_per_layer_key_norms_vllm_accepts_what_we_accept_at_every_step(interop):
    result = interop["result"]
    fixed = result["context_k_norm_fixed"]
    assert fixed["prompts_with_identical_per_step_acceptance"] >= MIN_SAME_STEPS * result["prompts"], fixed
    assert fixed["relative_difference"] <= TOLERANCE, fixed
