"""Regenerate the result tables in docs/results/<topic>/README.md from the files beside them (stdlib only).

    python benchmarks/results_tables.py            # rewrite every topic README below its marker line
    python benchmarks/results_tables.py --check    # exit 1 if a README is out of date or a file is unlisted

Each README keeps its hand-written header down to MARKER; everything after the marker is written here. A JSON
result gives its own row (what, headline number, machine, command, files): the headline is read from the JSON's
fields by its shape (a `bench sweep`, a runtime benchmark, a step profile, ...). Files that share a JSON's stem
(`X.md`, `X.png`, `X_scaling.png`, `X.py`) are listed in its row. A result with no JSON (a log of an A/B) or a JSON
that does not record its command or machine takes them from NOTES below. Every file in the folder appears in the
table, so a result nobody describes still shows up.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "docs" / "results"
SCRIPTS = REPO / "benchmarks"  # benchmarks/<topic>/ holds the scripts of docs/results/<topic>/
TOPICS = ("runtime", "drafter", "serving", "adaflash", "peers", "simulation", "reliability", "testing")
MARKER = "<!-- tables below are written by benchmarks/results_tables.py; edit above this line -->"

# What a JSON does not record about itself, and the results that are not JSON: stem -> fields.
NOTES: dict[str, dict[str, str]] = {
    "simulation/validation_cpu_int8_table": {
        "what": "this CPU's step-cost table (contexts x batch x new tokens, prefill grid, drafter) with the last "
                "round's in-engine fit: `adaflash bench simulate --cost-model FILE` reads it",
        "headline": "measured by the validation run beside it; its fit by round under engine_fits_by_round",
        "machine": "AMD EPYC, 2 threads, int8",
        "command": "python benchmarks/simulation/simulation_validation.py --dtype int8 --threads 2 --concurrency 1,8,32,64 "
                   "--rounds 3 --out docs/results/simulation/validation_cpu_int8"},
    "runtime/malloc_ab": {"what": "prefill passes with glibc's malloc thresholds vs the raised ones (`models/device/memory.py`)",
                          "headline": "raised thresholds: no page faults, a pass 0.91-0.98x the time, same peak memory",
                          "machine": "Intel Xeon (AVX-512 + AMX), 2 threads",
                          "command": "python benchmarks/runtime/malloc_ab.py {default|keep} 16 128 6"},
    "runtime/kernel_phases": {"what": "where a batch-1 int8 forward's time goes (rdtsc counters in an instrumented build)",
                              "headline": "16-token verify at 256 keys: 13.1 ms in the kernel call (linears 7.4, attention 2.9, head 1.7)",
                              "machine": "Intel Xeon (AVX-512 + AMX), 2 threads",
                              "command": "python benchmarks/runtime/kernel_phases.py"},
    "runtime/huge_pages_ab": {"what": "int8 packed weights in huge pages vs 4 KB pages",
                              "headline": "huge / 4k: 0.994 a decode step, same logits",
                              "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                              "command": "python benchmarks/runtime/huge_pages_ab.py"},
    "runtime/draft_ab": {"what": "the drafter's block pass + norm + head in one kernel call vs two",
                         "headline": "propose 0.87-0.89x the time, same tokens",
                         "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                         "command": "python benchmarks/runtime/draft_ab.py 2 8"},
    "runtime/engine_speed": {"what": "the batched engine's AR throughput vs transformers' batched generate (--dtype int8)"},
    "drafter/bf16_probe": {"what": "drafter training steps in bf16 autocast vs fp32 (30-step probe, same data and anchors)"},
    "drafter/depth_cost": {"what": "what a deeper drafter costs: draft-pass and verify seconds by drafter depth"},
    "drafter/dflash2_cost": {"what": "one proposal of a DFlash 2 drafter (selector rank 64 / 256) vs DFlash 1, same width",
                             "headline": "1.13-1.41x DFlash 1's time (our fused layer kernel does not take the convolutions)",
                             "machine": "AMD EPYC (Zen 4), 1 thread, fp32"},
    "drafter/training": {"what": "held-out accept length while training the shipped drafter (v9)",
                         "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                         "command": "adaflash train drafter --config configs/smollm2-drafter-v9.toml; "
                                    "python benchmarks/drafter/scaling_curve.py runs/train/smollm2-drafter-v9 "
                                    "--out docs/results/drafter/training"},
    "drafter/datagen": {"what": "target-regenerated training data under --dtype int8 (batch 64)",
                        "headline": "541 tok/s; 5069 samples, 1.08M response tokens in 33 minutes",
                        "command": "adaflash data generate ... --dtype int8 (first line of the file)"},
    "drafter/loss_ab": {"what": "CE vs CE+KL at equal steps from v9 (held-out accept length)",
                        "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                        "command": "python benchmarks/drafter/loss_ab.py (after the two runs its docstring names)"},
    "drafter/holdout_live_check": {"what": "v9 full-block greedy decoding of its 64 held-out prompts (live tokens per pass)",
                                   "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                                   "command": "python benchmarks/drafter/holdout_live_check.py int8 64"},
    "drafter/holdout_depth": {"what": "held-out accept length: v9, a 2-layer continuation, a 4-layer continuation",
                              "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                              "command": "python benchmarks/drafter/holdout.py --data-dir runs/data/smollm2-v4 "
                                         "runs/data/smollm2-v5 --holdout 64 --drafter DIR... --json OUT"},
    "drafter/holdout_block8": {"what": "held-out accept length of a block-8 continuation of v9",
                               "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                               "command": "python benchmarks/drafter/holdout.py --data-dir runs/data/smollm2-v4 "
                                          "runs/data/smollm2-v5 --holdout 64 --drafter DIR --json OUT"},
    "reliability/schemathesis": {"what": "schemathesis, every check, against a real `adaflash serve` (the OpenAPI contract)",
                                 "headline": "1025 requests, 0 failures, 0 errors",
                                 "machine": "AMD EPYC, 2 threads",
                                 "command": "schemathesis run http://127.0.0.1:18431/openapi.json --checks all "
                                            "--max-examples 50 --seed 53 --workers 1 (the file has the full command)"},
    "reliability/soak": {"what": "soak: concurrent clients for 30 minutes, mixed streaming / non-streaming, chat / "
                                 "completions, the drafter with prompt lookup, 10% hang-ups",
                         "machine": "AMD EPYC, 2 threads, fp32; the client on the same cores"},
    "reliability/soak_qwen15": {"what": "soak of Qwen2.5-Coder-1.5B (int8) with its whole 32K context a slot on the paged "
                                        "KV cache: 16 clients for 30 minutes, mixed streaming / chat / completions, "
                                        "the drafter with prompt lookup, 10% hang-ups"},
    "reliability/faults": {"what": "faults done for real: SIGKILL mid-stream and mid-training-step, a full disk at a "
                                   "checkpoint, truncated drafter / length head / GGUF, a hot swap to a truncated drafter"},
    "reliability/overload": {"what": "overload: 4x the batch limit of clients with --max-queue, against the batch limit"},
    "serving/prompt_lookup_served": {"what": "served prompt lookups sized by the throughput policy vs verified whole "
                                             "(gsm8k, 3 rounds, max batch 8)"},
    "serving/prefill_pass_size": {"what": "prefill tok/s by the size of a prefill pass (64 prompts, 7250 tokens)",
                                  "headline": "one 7250-token pass 778 tok/s; passes of 450-1800 tokens 929-1023 tok/s",
                                  "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                                  "command": "python benchmarks/serving/prefill_pass_size.py"},
    "serving/engine_profile": {"what": "offline engine, c = 32, 96 six-mix prompts, with and without prompt-prefix reuse (int8)",
                               "headline": "median 356.8 vs 300.0 tok/s (1.19x)",
                               "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                               "command": "python benchmarks/serving/engine_profile.py 32 96 > engine_profile_c32.txt",
                               "files": "engine_profile_c32.txt"},
    "serving/prompt_lookup_sim_sized": {"what": "prompt lookups verified whole vs sized by the throughput policy, replayed on the target's responses",
                                        "headline": "K=3 sized 1.42 / 1.48 / 1.40 / 2.06x (chat / code / math / multilingual); K=15 whole 1.18 / 1.27 / 1.01 / 2.20x",
                                        "command": "python benchmarks/serving/prompt_lookup_sim_sized.py"},
    "adaflash/adaptive_vs_ar_fp32": {"what": "every adaptive policy against our AR at batch 1, per domain, 4 prompts each, 3 rounds "
                                             "(fp32, 1 thread; every variant over one copy of the target; commit 29d3641)",
                                     "headline": "throughput 0.988, throughput-profiled 0.987, heuristic 0.992, adaflash 0.991 "
                                                 "(every domain cell >= 0.982), throughput+lookup 1.067x AR (multilingual "
                                                 "1.428x; lookups verified whole 1.367x); fixed:0 (the engine path, never "
                                                 "drafting) 0.994x"},
    "adaflash/adaptive_vs_ar_int8": {"what": "every adaptive policy against our AR at batch 1, per domain, 6 prompts each, 3 rounds "
                                             "(int8, 1 thread; every variant over one copy of the target; commit 29d3641)",
                                     "headline": "throughput 1.009 (math 1.275), throughput-profiled 1.016, heuristic 1.012, "
                                                 "adaflash 0.989, throughput+lookup 1.271x AR (multilingual 1.759x; lookups "
                                                 "verified whole 1.654x); 17 of 20 policy-domain cells >= 0.98, the rest "
                                                 "0.968-0.980; fixed:0 (the engine path, never drafting) 0.987x"},
    "adaflash/policy_overhead": {"what": "a length policy's own work per engine step (check, decide, feedback, calibration) "
                                         "beside the plain decode step, warm and in place (after an engine step), batch "
                                         "1-64; and whole plain-arm engine steps (plain runs) against AR's, with the "
                                         "runs' replay (fp32; commit e029a5f)",
                                 "headline": "in place at batch 1: heuristic 29 µs (0.39%), throughput 69 µs (0.93%), adaflash "
                                             "73 µs (0.98%), lookup sizing 45 µs; warm 4-15 µs. A plain-arm engine step, "
                                             "replay included: +0.02 to +0.10% of AR's at batch 1, +0.30 to +0.42% at batch 8"},
    "adaflash/policy_overhead_int8": {"what": "the same, int8 (commit d1f2ef4)",
                                      "headline": "in place at batch 1: heuristic 24 µs (0.68% of a 3.5 ms step), throughput "
                                                  "70 µs (2.03%), adaflash 58 µs (1.66%); a plain-arm engine step, replay "
                                                  "included: -0.12 to +0.75% of AR's at batch 1, +0.40 to +0.69% at batch 8"},
    "adaflash/main_table": {"what": "main table: AR, DFlash fixed-16 / fixed-2, throughput, adaflash, adaflash + lookup; "
                                    "served, six-mix, 64 tokens, --dtype int8 (adaflash before its look fix)"},
    "adaflash/look_feedback": {"what": "throughput, adaflash (after its look fix), adaflash + lookup; served, six-mix, int8"},
    "adaflash/ablation": {"what": "ablation on gsm8k: base fixed-16, + distillation, + length head, both (int8)"},
    "adaflash/distill_training": {"what": "reverse-KL distillation of the AdaFlash drafter (the `make adaflash-drafter` recipe)",
                                  "command": "make adaflash-drafter"},
    "adaflash/length_head": {"what": "the AdaFlash drafter's per-position length head (held-out calibration)",
                             "command": "make adaflash-drafter"},
    "adaflash/online": {"what": "online adaptation: 5 rounds of serve -> distill -> refit -> score -> promote or roll back",
                        "machine": "AMD EPYC (AVX2), 2 threads",
                        "command": "adaflash online --out runs/online-v6 --rounds 5"},
    "adaflash/drafting_rhythm": {"what": "the target pass's cost by how often the drafter runs around it (batch 1, int8)",
                                 "headline": "a 3-token pass 5.08-5.14 ms drafting every step, 4.52-4.56 ms every fourth; AR's 1-token pass 3.30-3.43 ms",
                                 "command": "python benchmarks/adaflash/drafting_rhythm.py"},
    "adaflash/throughput_policy_ab": {"what": "the throughput policy at batch 1 before / after the drafting check",
                                      "headline": "gsm8k 0.86-0.87x AR before, 0.87-0.92x after; chat 0.82-0.89x before, 0.85-0.88x after",
                                      "command": "python benchmarks/runtime/step_profile.py --dtype int8 --dataset gsm8k|sharegpt-chat "
                                                 "--limit 4 --max-new-tokens 96 --lengths 1 --policies throughput --repeats 4"},
    "adaflash/demo": {"what": "`make demo` (`adaflash demo`, fp32, 5 rounds), three runs in a row: AR vs full block, 2 "
                              "drafts, adaptive, adaptive + prompt lookup (commit 29d3641)",
                      "headline": "full block 0.32-0.33x AR, 2 drafts 0.78-0.79x, adaptive 0.97-0.98x, adaptive + lookup "
                                  "0.98-0.99x (multilingual 1.47-1.51x)",
                      "machine": "AMD EPYC (AVX-512, BF16), 2 threads",
                      "command": "make demo"},
    "adaflash/served_engines_fp32": {"what": "serve's engines fed waves of c requests in one process, the variants alternating "
                                             "wave by wave (fp32, six-mix, 64 tokens, 4 rounds; every variant over one copy "
                                             "of the target; commit d1f2ef4)",
                                     "headline": "c = 1 / 8 / 32 / 64: throughput 0.988 / 1.001 / 0.999 / 0.970x AR, "
                                                 "throughput-profiled 0.995 / 1.007 / 1.000 / 0.989x, heuristic 0.997 / "
                                                 "1.004 / 0.998 / 0.989x, adaflash 0.997 / 1.000 / 1.005 / 1.007x, "
                                                 "throughput+lookup 1.064 / 0.990 / 0.987 / 1.014x (medians of 16 / 8 / 4 / "
                                                 "4 waves; 19 of 20 cells >= 0.98, throughput at c = 64 verifying no draft)"},
    "adaflash/served_engines_int8": {"what": "the same, int8 (six-mix, 64 tokens, 4 rounds; commit d1f2ef4)",
                                     "headline": "c = 1 / 8 / 32 / 64: throughput 1.036 / 0.995 / 0.976 / 1.020x AR, "
                                                 "throughput-profiled 1.022 / 0.977 / 0.978 / 1.047x, heuristic 1.023 / "
                                                 "0.991 / 1.009 / 1.002x, adaflash 1.001 / 0.995 / 1.003 / 1.002x, "
                                                 "throughput+lookup 1.323 / 1.008 / 0.998 / 1.025x; from c = 8 on every "
                                                 "variant verifies 0.00-0.02 drafts a step"},
    "adaflash/engine_path": {"what": "the engine's path at batch 1 (no drafter; a drafter at fixed:0) against the reference "
                                     "AR loop: `make demo`'s code prompt, 48 tokens, fp32, 2 threads, 40 rounds",
                             "headline": "reference / engine time 0.994x, with a drafter at fixed:0 0.994x",
                             "machine": "AMD EPYC (AVX-512, BF16), 2 threads",
                             "command": "python benchmarks/adaflash/engine_path.py"},
    "adaflash/engine_path_int8": {"what": "the same on six humaneval prompts, int8, 1 thread, 3 rounds: the prefill alone (1 "
                                          "token) and 96 tokens",
                                  "headline": "fixed:0 1.030x the reference loop's speed on the prefill, 0.990x over 96 "
                                              "tokens (the engine without a drafter 1.002x and 0.968x)",
                                  "machine": "AMD EPYC (AVX-512, BF16), 1 thread",
                                  "command": "python benchmarks/adaflash/engine_path.py --dtype int8 --threads 1 --prompts "
                                             "humaneval --new-tokens 1,96 --rounds 3"},
    "peers/served_ar": {"what": "our AR server (--dtype int8) beside llama-server's AR: same GGUF, same 2 cores, six-mix, 64 tokens"},
    "peers/served_ar_peak": {"what": "our AR server (--dtype int8) beside llama-server built without AMX, with the matmul peak "
                                     "of the same run (six-mix, 64 tokens)"},
    "peers/peer_sweep": {"what": "llama-server AR and DFlash (our exported drafter, draft lengths 1 and up) beside our "
                                 "servers (fp32, before the quantized kernels)"},
    "peers/vllm_policy_lossless": {"headline": "greedy tokens = vLLM AR on 32 of 32 prompts (1424 draft steps, 592 of 4272 drafts accepted)"},
    "peers/llamacpp_interop": {"what": "llama.cpp (DFlash) running the exported shipped drafter: acceptance vs ours, losslessness",
                               "command": "pytest -m peer tests/export/test_llamacpp_interop.py"},
    "peers/llamacpp_dflash": {"what": "llama.cpp's DFlash with the v9 drafter by draft length, and llama-bench",
                              "headline": "see the file: every draft length slower than llama.cpp's AR",
                              "machine": "AMD EPYC (Zen 3, AVX2), 2 threads",
                              "command": "llama-bench / llama-speculative-simple (in the file)"},
    "peers/llamacpp_amx_build": {"what": "llama.cpp's native build on an AMX CPU: SIGILL at the first multi-token batch",
                                 "headline": "native build cannot serve here; the no-AMX build decodes 2.2-2.5x slower at batch 1",
                                 "command": ".peer/bin/llama-server ... (in the file)"},
}


def _f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _machine(d: dict) -> str:
    m = d.get("machine") or d.get("cpu")
    if isinstance(m, dict):
        parts = [m.get("cpu") or m.get("processor")]
        if m.get("cpu_capability"):
            parts.append(m["cpu_capability"])
        if m.get("threads"):
            parts.append(f"{m['threads']} threads")
        return ", ".join(str(p) for p in parts if p)
    return str(m) if m else ""


def _sweep(d: dict) -> str:
    names = list(d["servers"]) + list(d.get("peers") or {})
    base = d.get("baseline", names[0])
    names = [base] + [n for n in names if n != base]
    out = []
    for ds in dict.fromkeys(c["dataset"] for c in d["cells"]):
        cells = [c for c in d["cells"] if c["dataset"] == ds]
        cs = "/".join(str(c["concurrency"]) for c in cells)
        parts = [f"{base} " + " / ".join(_f(c["results"][base]["output_tokens_per_s"], 1) for c in cells) + " tok/s"]
        for n in names[1:]:
            rs = []
            for c in cells:
                r, b = c["results"].get(n), c["results"][base]
                rs.append("-" if r is None else _f(r.get("ratio") or r["output_tokens_per_s"] / b["output_tokens_per_s"]))
            parts.append(f"{n} " + " / ".join(rs) + "x")
        out.append(f"{ds}, c={cs}: " + "; ".join(parts))
    return " ".join(out)


def _runtime_speed(d: dict) -> str:
    v = d["by_dtype"]["fp32"].get("variants", {})
    parts = [f"{k} {_f(x['decode_tokens_per_s'], 1)}" for k, x in v.items() if "decode_tokens_per_s" in x]
    s = "decode tok/s at batch 1: " + ", ".join(parts)
    if d.get("llama_cpp", {}).get("tokens_per_s"):
        s += f"; llama-bench {_f(d['llama_cpp']['tokens_per_s'], 1)}"
    return s


def _step_profile(d: dict) -> str:
    rows = d["rows"]
    ar = rows.get("ar", {})
    parts = [f"{k} {_f(r['vs_ar'])}x" for k, r in rows.items() if k != "ar" and "vs_ar" in r]
    return f"{d.get('dataset')}: AR {_f(ar.get('step_ms'))} ms a step; " + ", ".join(parts) + " AR"


def _curve(d: dict) -> str:
    if d.get("holdout_curve"):
        h = d["holdout_curve"][-1]
        doms = ", ".join(f"{k} {_f(v)}" for k, v in h.items() if k not in ("step", "train_tokens_seen", "all"))
        return f"step {h['step']}: held-out accept length all {_f(h['all'])} ({doms})"
    return (f"{d['steps']} steps: loss {_f(d['first_loss'])} -> {_f(d['final_loss'])}, "
            f"expected accept length {_f(d['final_expected_accept_len'])}")


def _tau(d: dict) -> str:
    t = d["tau"]
    bs = ", ".join(f"{b['benchmark']} {_f(b['accept_len_mean'])}" for b in t["benchmarks"])
    return f"accept length all {_f(t['overall']['accept_len_mean'], 3)} ({bs})"


def _holdout_scores(d: dict) -> str:
    parts = []
    for k, v in d["scores"].items():
        name = k.split("/")[-2] if "/" in k else k
        dec = v.get("holdout_decoded", {}).get("all")
        parts.append(f"{name} {_f(v['holdout']['all'], 3)}" + (f" (decoded {_f(dec, 3)})" if dec else ""))
    return "random anchors: " + "; ".join(parts)


def _drafters(d: dict) -> str:
    parts = []
    for n, x in d["drafters"].items():
        accs = [b["accept_len"] for b in x["benchmarks"].values()]
        parts.append(f"{n} {_f(sum(accs) / len(accs), 3)}")
    return "mean accept length over benchmarks: " + ", ".join(parts)


def _context(d: dict) -> str:
    parts = []
    for n, by in d["drafters"].items():
        g = by.get("gsm8k")
        if g:
            parts.append(f"{n} " + " -> ".join(_f(c["accept_len"]) for c in g))
    return f"gsm8k accept length at context levels {d['levels']}: " + "; ".join(parts)


def _headline(d: dict) -> str:
    if isinstance(d, dict) and "cells" in d and "servers" in d:
        return _sweep(d)
    shapes = [("headline", lambda d: d["headline"] if isinstance(d["headline"], str) else ""),  # the result's own
              ("faults", lambda d: f"{d['caught']} of {d['faults']} faults caught by their guard tests"),
              ("total_s", lambda d: f"install {_f(d['install_s'], 0)} s + suite {_f(d['pytest_s'], 0)} s = "
               f"{_f(d['total_s'], 0)} s ({d['summary']})"),
              ("cost_models", lambda d: "; ".join(
                  f"{m}: median |error| {_f(100 * x['median_abs_error'], 1)}%, largest {_f(100 * x['max_abs_error'], 1)}%, "
                  f"{x['within_10_percent']} of {len(d['rows'])} cells within 10%" for m, x in d["summary"].items())),
              ("summary", lambda d: f"median |error| {_f(100 * d['summary']['median_abs_error'], 1)}%, "
               f"largest {_f(100 * d['summary']['max_abs_error'], 1)}%, {d['summary']['within_15_percent']} of "
               f"{d['summary']['cells']} cells within 15%"),
              ("acceptance", _simulated),
              ("fresh_process", lambda d: "; ".join(
                  f"{dtype}: {sum(bool(r['vs_ar']) for v in x['variants'].values() for r in v)} of "
                  f"{sum(len(v) for v in x['variants'].values())} fresh-process runs ({len(x['variants'])} variants) "
                  "differ from AR" for dtype, x in d["fresh_process"].items())
               + ("; served: " + ", ".join(f"{dt} {sum(bool(r) for rs in s.values() for r in rs)} rounds differ"
                                          for dt, s in d["served"].items()) if d.get("served") else "")),
              ("step_s", lambda d: "ms a step at batch 1 / 8 / 32 / 64 by drafts k: " + "; ".join(
                  f"k={k} " + " / ".join(_f(1e3 * d["step_s"][b][k], 0) for b in ("1", "8", "32", "64"))
                  for k in d["step_s"]["1"]) + (f"; schedule {d['schedule']}" if "schedule" in d else "")),
              ("by_dtype", _runtime_speed), ("engine_tokens_per_s", lambda d: f"batch {d['batch']}: "
               f"{_f(d['engine_tokens_per_s'], 1)} tok/s, {_f(d['speedup'])}x transformers"),
              ("tau", _tau), ("final_loss", _curve), ("scores", _holdout_scores),
              ("ece_after", lambda d: f"ECE {_f(d['ece_before'], 3)} -> {_f(d['ece_after'], 3)} at T {_f(d['temperature'])}, "
               f"Brier {_f(d['brier'], 3)} vs {_f(d['brier_constant'], 3)} constant, accepted-drafts MAE "
               f"{_f(d['accepted_mae'])} vs {_f(d['accepted_mae_constant'])}"),
              ("levels", _context), ("drafters", _drafters),
              ("rounds", lambda d: f"served version {_f(d['rounds'][0]['held_out_accept_len'], 3)} held out; candidates "
               + ", ".join(f"{_f(r['candidate_held_out_accept_len'], 3)}{' (promoted)' if r.get('promoted') else ''}"
                           for r in d["rounds"][1:]) + f"; {sum(bool(r.get('promoted')) for r in d['rounds'][1:])} promoted"),
              ("distillation", lambda d: "gsm8k accept length by alpha: " + ", ".join(
                  f"{a['value']}: {_f(a['gsm8k_accept_len'])}" for a in d["distillation"].get("alpha", []))),
              ("rss_growth_pct", lambda d: f"{d['completed']} completed, {d['failed']} lost, {d['duplicated']} duplicated, "
               f"{d['server_errors']} server errors, {_f(d.get('leaked_slots', 0), 0)} slots leaked; RSS "
               f"{_f(d['rss_growth_pct'], 2)}% after warm-up; p99 latency {_f(d['p99_drift_pct'], 1)}% last window vs first"),
              ("results", lambda d: f"{sum(r['passed'] for r in d['results'].values())} of {len(d['results'])} pass: "
               + ", ".join(f"{k} {'pass' if r['passed'] else 'FAIL'}" for k, r in d["results"].items())),
              ("ratios", lambda d: f"{d['phases'][1]['load'] if d['phases'][0]['load'] == 'batch limit' else d['phases'][0]['load']} "
               f"load: {_f(d['ratio'], 3)}x the batch limit's tok/s, {d['lost']} lost, "
               f"{sum(q['refused'] for q in d['phases'])} refused with Retry-After"),
              ("rss_growth_last_half_mb", lambda d: f"{d['completed']} completed, {d['refused']} refused, {d['failed']} failed, "
               f"{_f(d.get('leaked_slots', 0), 0)} slots leaked; RSS +{_f(d['rss_growth_last_half_mb'], 1)} MB over the last half"),
              ("rss_after_mb", lambda d: f"{d['completed']} completed, {d['refused']} refused, {d['failed']} failed; "
               f"{_f(d['free_slots_after'], 0)} of {_f(d['max_slots'], 0)} slots free after"),
              ("rows", _step_profile_or_rows), ("coverage", lambda d: "coverage of held-out tokens: " + ", ".join(
                  f"{k} rows {_f(v['all'], 3)}" for k, v in d["coverage"].items())),
              ("draft_pass_ms_by_width", lambda d: "draft pass ms by width: " + ", ".join(
                  f"{k}: {v}" for k, v in d["draft_pass_ms_by_width"].items())),
              ("shapes_ms", lambda d: f"{len(d['shapes_ms'])} weight shapes x row buckets {d['row_buckets']}, ms per kernel"),
              ("steps", lambda d: "; ".join(f"{k}: {v['wall_ms']} ms" for k, v in d["steps"].items()
                                            if isinstance(v, dict) and "wall_ms" in v)),
              ("bf16_speedup", lambda d: f"bf16 {d['bf16_speedup']}x fp32 a step, loss "
               + " vs ".join(f"{k} {v['loss_at_30']}" for k, v in d["runs"].items())),
              ("by_depth", lambda d: "2-token draft pass ms by depth: " + ", ".join(
                  f"{k}: {_f(1e3 * v['draft_width_s']['2'])}" for k, v in d["by_depth"].items())
               + f"; 1-token verify {_f(1e3 * next(iter(d['by_depth'].values()))['verify_1_s'], 1)} ms"),
              ("acceptance", lambda d: f"acceptance " + ", ".join(f"{k} {_f(100 * v['rate'], 2)}%" for k, v in d["acceptance"].items())
               + f"; lossless {d['lossless']['server_dflash_tokens_equal_server_ar']} of {d['lossless']['of']}"),
              ("winner", lambda d: f"final step {d['final_step']}: " + ", ".join(
                  f"{k} {_f(v[str(d['final_step'])]['all'], 3)}" for k, v in d["holdout"].items()) + f"; kept: {d['winner']}"),
              ("all", lambda d: f"tokens per target pass all {_f(d['all']['tau_tokens_per_pass'], 3)}"),
              ("runs", lambda d: f"{len(d['runs'])} simulated settings over {d.get('samples')} responses")]
    for key, fn in shapes:
        if key in d:
            try:
                h = fn(d)
            except (KeyError, TypeError, AttributeError, ZeroDivisionError, IndexError):
                continue
            if h:
                return h
    return ""


def _simulated(d: dict) -> str:
    """`bench simulate`: each variant's speedup over AR at the highest concurrency, labelled simulated."""
    if not d.get("simulated"):
        raise KeyError("simulated")
    top = max(r["concurrency"] for r in d["rows"])
    return f"simulated, c={top}: " + ", ".join(f"{r['variant']} {_f(r['speedup_vs_ar'])}x" for r in d["rows"]
                                               if r["concurrency"] == top and r["method"] != "ar")


def _step_profile_or_rows(d: dict) -> str:
    if isinstance(d["rows"], dict):
        return _step_profile(d)
    by = d.get("by_domain") or {}
    parts = [f"{k} ours {_f(v.get('ours_speedup'))}x vs transformers' lookup {_f(v.get('prompt_lookup_speedup'))}x"
             for k, v in by.items() if isinstance(v, dict) and "ours_speedup" in v]
    return "; ".join(parts)


def _first_line(p: Path) -> str:
    for line in p.read_text(errors="replace").splitlines():
        s = line.strip().lstrip("#").strip().strip('"').strip()
        if s:
            return s[:160]
    return ""


def rows_for(topic: Path) -> list[dict[str, str]]:
    # every file, in subfolders too (a recorded trace's folder joins the row of the result named like it)
    files = sorted(p for p in topic.rglob("*") if p.is_file() and p != topic / "README.md")
    stems: dict[str, list[Path]] = {}
    for p in files:
        stems.setdefault(p.relative_to(topic).parts[0].split(".")[0], []).append(p)
    # a plot or log named after a result (X_scaling.png, X_c32.txt) joins X's row
    for s in sorted(stems, key=len, reverse=True):
        base = next((b for b in stems if b != s and s.startswith(b + "_") and any(q.suffix == ".json" for q in stems[b])
                     and not any(q.suffix == ".json" for q in stems[s]) and f"{topic.name}/{s}" not in NOTES), None)
        if base is None:
            base = next((b for b in stems if b != s and f"{topic.name}/{b}" in NOTES
                         and s in NOTES[f"{topic.name}/{b}"].get("files", "")), None)
        if base:
            stems[base] += stems.pop(s)
    rows = []
    for stem, group in sorted(stems.items()):
        note = NOTES.get(f"{topic.name}/{stem}", {})
        js = next((p for p in group if p.suffix == ".json" and p.stem == stem), None)
        d: dict = {}
        if js:
            try:
                d = json.loads(js.read_text())
            except ValueError:
                d = {}
        script = SCRIPTS / topic.name / f"{stem}.py"  # a script named like its result, where the result names none
        texts = [p for p in group if p.suffix in (".md", ".txt")] + ([script] if script.is_file() else [])
        what = note.get("what") or (d.get("what") if isinstance(d.get("what"), str) else "") or \
            (_first_line(texts[0]) if texts else stem)
        headline = (_headline(d) if d else "") or note.get("headline", "")
        cmd = d.get("command") if isinstance(d.get("command"), str) else ""
        rows.append({"what": what, "headline": headline or "-", "machine": _machine(d) or note.get("machine", "-"),
                     "command": cmd or note.get("command", "-"),
                     "files": ", ".join([f"[{p.relative_to(topic).as_posix()}]({p.relative_to(topic).as_posix()})"
                                         for p in sorted(group, key=lambda p: (p.suffix != ".json", p.name))]
                                        + ([f"script: [{script.name}](../../../benchmarks/{topic.name}/{script.name})"]
                                           if script.is_file() else []))})
    return rows


def table(topic: Path) -> str:
    lines = ["", "| what | headline | machine | command | files |", "|---|---|---|---|---|"]
    for r in rows_for(topic):
        cells = [r["what"], r["headline"], r["machine"], f"`{r['command']}`" if r["command"] != "-" else "-", r["files"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report READMEs that would change; write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name in TOPICS:
        topic = ROOT / name
        readme = topic / "README.md"
        if not topic.is_dir():
            continue
        head = readme.read_text().split(MARKER)[0].rstrip("\n") if readme.exists() else f"# docs/results/{name}"
        text = f"{head}\n\n{MARKER}\n{table(topic)}"
        if not readme.exists() or readme.read_text() != text:
            stale.append(str(readme.relative_to(ROOT.parent.parent)))
            if not args.check:
                readme.write_text(text)
    for s in stale:
        print(("stale: " if args.check else "wrote ") + s)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
