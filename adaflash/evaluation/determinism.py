"""Greedy output must not depend on the run: every length policy, each command in a fresh process, N times, against AR.

What a user does to check lossless decoding - the same command twice, and the speculative command against plain
decoding - done systematically: `adaflash generate --json` in a new process per run (a warm interpreter would share
the kernel scratch, the cost model and the kernel choice read once), with the user cache's measured state varied run by
run, because that is what differs between a user's processes: the cost model and the kernel-choice timings present
(read from disk), absent (measured in this process) or stale (every timing multiplied by a random factor in
[1/4, 4], as a busy or another machine would have left them). The converted target and the built kernel library are
linked in from the user cache (they are inputs, not measurements). And through the server: each policy's server
against the AR server, every prompt sent at once (batched), twice (the second round reuses cached prompt prefixes
where the target allows it).

Used by `benchmarks/runtime/determinism.py` (the 16-prompt figures) and `tests/test_determinism.py` (a few prompts, in
`make test`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import httpx

CACHE_STATES = ("present", "absent", "stale")

# name -> `adaflash generate` arguments. The reference loop (dflash with a fixed draft length), the engine under each
# length policy, prompt lookup with and without the drafter.
VARIANTS: dict[str, tuple[str, ...]] = {
    "ar": ("--method", "ar"),
    "dflash fixed:15 (reference loop)": ("--method", "dflash", "--draft-length", "15"),
    "fixed:3": ("--method", "dflash", "--length-policy", "fixed:3"),
    "heuristic": ("--method", "dflash", "--length-policy", "heuristic"),
    "throughput": ("--method", "dflash", "--length-policy", "throughput"),
    "throughput-profiled": ("--method", "dflash", "--length-policy", "throughput-profiled"),
    "adaflash": ("--method", "adaflash"),
    "throughput + lookup": ("--method", "dflash", "--length-policy", "throughput", "--prompt-lookup", "8"),
    "lookup (ar)": ("--method", "ar", "--prompt-lookup", "8"),
}


def prepare_cache(cache: Path, state: str, seed: int, source: Path | None = None) -> None:
    """Put `cache` (a private ADAFLASH_CACHE) in `state` for the next process: the measured files (cost models, kernel
    choices) kept, removed or scaled at random; the converted targets and the kernel library linked from `source`."""
    if state not in CACHE_STATES:
        raise ValueError(f"cache state must be one of {CACHE_STATES}, got {state!r}")
    from adaflash.models.files import cache_root

    source = cache_root() if source is None else source
    (cache / "kernels").mkdir(parents=True, exist_ok=True)
    if not (cache / "targets").is_symlink() and (source / "targets").is_dir():
        (cache / "targets").symlink_to((source / "targets").resolve(), target_is_directory=True)
    for lib in (source / "kernels").glob("*.so"):
        if not (cache / "kernels" / lib.name).is_symlink():
            (cache / "kernels" / lib.name).symlink_to(lib.resolve())
    measured = [*(cache / "kernels").glob("choices-*.json"), *(cache / "cost_models").glob("*.json")]
    if state == "absent":
        for path in measured:
            path.unlink()
    elif state == "stale":
        rng = random.Random(seed)
        for path in measured:
            path.write_text(json.dumps(_scaled(json.loads(path.read_text()), rng)))


def _scaled(obj, rng: random.Random):
    """Every positive float in `obj` times a random factor in [1/4, 4] (counts, thread numbers and names kept)."""
    if isinstance(obj, dict):
        return {k: _scaled(v, rng) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scaled(v, rng) for v in obj]
    if isinstance(obj, float) and obj > 0:
        return obj * 4 ** rng.uniform(-1, 1)
    return obj


def generate(prompts_file: Path, args: Sequence[str], dtype: str, max_new_tokens: int, cache: Path,
             threads: int | None = None, timeout_s: float = 900) -> list[dict]:
    """`adaflash generate --json` in a fresh process with ADAFLASH_CACHE=`cache`: each prompt's record (token_ids,
    stats)."""
    cmd = [sys.executable, "-m", "adaflash.cli", *(["--threads", str(threads)] if threads else []), "generate",
           "--prompts-file", str(prompts_file), "--dtype", dtype, "--max-new-tokens", str(max_new_tokens), "--json",
           *args]
    env = dict(os.environ, ADAFLASH_CACHE=str(cache))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def drafting(records: Sequence[dict]) -> dict:
    """What a run drafted: tokens sent to verification and accepted per target pass, over its prompts."""
    passes = sum(r["stats"]["target_passes"] for r in records)
    tokens = sum(r["num_tokens"] for r in records)
    return {"draft_tokens": sum(r["stats"]["draft_tokens"] for r in records),
            "tokens_per_pass": round(tokens / passes, 3) if passes else None}


def differences(want: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> list[dict]:
    """Per prompt whose tokens differ: its index and the first position where they do."""
    if len(want) != len(got):
        raise ValueError(f"{len(got)} outputs for {len(want)} prompts")
    out = []
    for i, (a, b) in enumerate(zip(want, got)):
        if list(a) != list(b):
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"prompt": i, "first_token": first})
    return out


def fresh_process_runs(prompts_file: Path, variants: Sequence[str], dtypes: Sequence[str], runs: int,
                       max_new_tokens: int, work: Path, threads: int | None = None, log=print,
                       states: Sequence[str] = CACHE_STATES) -> dict:
    """Per dtype: AR once (the reference), then `runs` fresh processes of every variant, the cache state cycling
    through `states` (present / absent / stale). {dtype: {"ar_tokens": ..., "variants": {variant: [{"cache", "vs_ar", "vs_first_run",
    "draft_tokens", "tokens_per_pass"}, ...]}}}."""
    report: dict[str, dict] = {}
    for dtype in dtypes:
        cache = work / f"cache-{dtype}"
        prepare_cache(cache, "absent", 0)
        reference = [r["token_ids"] for r in generate(prompts_file, VARIANTS["ar"], dtype, max_new_tokens, cache,
                                                      threads)]
        report[dtype] = {"ar_tokens": reference, "variants": {}}
        for variant in variants:
            first, rows = None, []
            for i in range(runs):
                state = states[i % len(states)]
                prepare_cache(cache, state, seed=i)
                records = generate(prompts_file, VARIANTS[variant], dtype, max_new_tokens, cache, threads)
                tokens = [r["token_ids"] for r in records]
                first = tokens if first is None else first
                row = {"run": i, "cache": state, "vs_ar": differences(reference, tokens),
                       "vs_first_run": differences(first, tokens), **drafting(records)}
                rows.append(row)
                log(f"{dtype} {variant} run {i} ({state}): {len(row['vs_ar'])} prompts differ from AR, "
                    f"{len(row['vs_first_run'])} from run 0; {row['draft_tokens']} drafts, "
                    f"{row['tokens_per_pass']} tokens a pass")
            report[dtype]["variants"][variant] = rows
    return report


# The policies served (`adaflash serve` takes the same flags; the reference loop and AR-only lookup are not servers).
SERVED_VARIANTS = {v: VARIANTS[v] for v in ("throughput", "adaflash", "heuristic", "throughput + lookup")}


async def _complete_all(url: str, prompts: Sequence[list[dict]], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def one(messages):
            r = await client.post("/v1/chat/completions", json={
                "model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]
        return list(await asyncio.gather(*(one(m) for m in prompts)))


def served_runs(prompts: Sequence[list[dict]], variants: Sequence[str], dtypes: Sequence[str], max_tokens: int,
                work: Path, port: int = 8470, rounds: int = 2, threads: int | None = None, log=print) -> dict:
    """Per dtype: the AR server's texts (every prompt at once, `rounds` times), then each variant's server the same
    way; {dtype: {variant: [prompts differing from AR, per round]}} (and AR's own rounds against its first)."""
    from adaflash.evaluation.serve_sweep import launched_server

    report: dict[str, dict] = {}
    for dtype in dtypes:
        cache = work / f"cache-{dtype}"
        prepare_cache(cache, "present", 0)
        before = os.environ.get("ADAFLASH_CACHE")
        os.environ["ADAFLASH_CACHE"] = str(cache)  # what the launched servers inherit
        try:
            texts: dict[str, list[list[str]]] = {}
            for name, args in {"ar": ("--method", "ar"), **{v: SERVED_VARIANTS[v] for v in variants}}.items():
                with launched_server(name.replace(" ", ""), [*args, "--dtype", dtype], port, len(prompts),
                                     work / "logs", threads) as url:
                    texts[name] = [asyncio.run(_complete_all(url, prompts, max_tokens)) for _ in range(rounds)]
            want = texts["ar"][0]
            report[dtype] = {name: [[i for i, (a, b) in enumerate(zip(want, r)) if a != b] for r in rs]
                             for name, rs in texts.items()}
            for name, per_round in report[dtype].items():
                log(f"served {dtype} {name}: prompts differing from the AR server per round {per_round}")
        finally:
            if before is None:
                os.environ.pop("ADAFLASH_CACHE", None)
            else:
                os.environ["ADAFLASH_CACHE"] = before
    return report
