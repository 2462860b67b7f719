"""Where a speculative engine step's time goes at batch 1, beside a plain decode step.

    python benchmarks/runtime/step_profile.py --dataset gsm8k --limit 4 --max-new-tokens 96 --lengths 1,2,3 \
        --json docs/results/runtime/step_profile.json

The engine `serve` runs (one slot) generates greedily for the same prompts under AR and under each fixed draft length
k, alternating, in one process. Timers around the engine's parts split every decode step's wall time: the drafter's
context feed (the target features of the last accepted tokens), the drafter's block pass, the draft LM head (counted
with the block pass where the two run as one kernel call, `DFlashProposer.draft_logits`: then 0), the target's verify
pass, and the rest (verification, commit, cache rollback, Python). From a step's cost and the tokens it commits follow
tokens/s and the ratio to AR; the acceptance a draft needs to pay is the arithmetic below the table. Prefill steps
are left out. Run with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.engine.request import Request
from adaflash.evaluation.offline import command_line, cpu_label, machine_info, provenance
from adaflash.models.device.placement import synchronize
from adaflash.report import markdown_table, write_report
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.cost_model import CalibratedCost

PARTS = ("context_feed", "draft_pass", "draft_head", "target_pass")


class PartTimers:
    """Wall time per named part, accumulated over one step at a time (`take` returns and clears it). The clock is read
    after `device`'s queued work (a GPU's kernels run after their launch returns: the time would be another part's)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.ms: dict[str, float] = {}
        self.device = device

    def timed(self, fn, part: str):
        def wrapper(*args, **kwargs):
            synchronize(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.ms[part] = self.ms.get(part, 0.0) + 1e3 * (time.perf_counter() - start)
        return wrapper

    def take(self) -> dict[str, float]:
        ms, self.ms = self.ms, {}
        return ms


@contextmanager
def instrumented(engine, timers: PartTimers):
    """Timers around the engine's parts, as instance attributes that shadow the methods (removed on exit)."""
    patched = [(engine.target, "forward", "target_pass")]
    drafter = engine.drafting.drafter  # the drafter's draft source: context feed, block pass, draft head
    if drafter is not None:
        # (where the drafter pass and the draft head run as one kernel call, draft_logits, both count as draft_pass)
        patched += [(drafter, "feed_context", "context_feed"), (drafter.proposer, "draft_hidden", "draft_pass"),
                    (drafter.proposer, "draft_tokens", "draft_head"), (drafter.proposer, "draft_logits", "draft_pass")]
    for obj, name, part in patched:
        object.__setattr__(obj, name, timers.timed(getattr(obj, name), part))
    try:
        yield
    finally:
        for obj, name, _ in patched:
            object.__delattr__(obj, name)


def profile_generation(engine, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> tuple[list[dict], list[int]]:
    """Generate one request; per decode step: wall ms, each part's ms and the tokens it committed."""
    device = engine.target.device
    timers = PartTimers(device)
    request = Request("profile", list(prompt_ids), max_new_tokens, stop_token_ids=stop_ids)
    engine.add_request(request)
    steps = []
    with instrumented(engine, timers):
        first = True
        while engine.has_work():
            before = len(request.output_ids)
            synchronize(device)
            start = time.perf_counter()
            engine.step()
            synchronize(device)
            wall = 1e3 * (time.perf_counter() - start)
            parts = timers.take()
            if not first:  # the first step is the prefill
                steps.append({"wall_ms": wall, "tokens": len(request.output_ids) - before,
                              "drafts": request.draft_lengths[-1], **parts})
            first = False
    return steps, request.output_ids


def summarize(steps: list[dict]) -> dict:
    """Mean ms per step of each part (the rest = wall - parts), tokens per step, tokens/s."""
    n = len(steps)
    wall = sum(s["wall_ms"] for s in steps) / n
    parts = {p: sum(s.get(p, 0.0) for s in steps) / n for p in PARTS}
    parts["rest"] = wall - sum(parts.values())
    tokens = sum(s["tokens"] for s in steps) / n
    return {"steps": n, "step_ms": round(wall, 3), "tokens_per_step": round(tokens, 4),
            "drafts_per_step": round(sum(s["drafts"] for s in steps) / n, 3),
            "tokens_per_s": round(1e3 * tokens / wall, 2), "ms": {k: round(v, 3) for k, v in parts.items()}}


def run(args: argparse.Namespace) -> dict:
    from adaflash.models.targets.registry import resolve_drafter
    from adaflash.pipeline import Pipeline

    pipeline = Pipeline.load(args.model, resolve_drafter(args.model, args.drafter), args.dtype,
                             draft_vocab=args.draft_vocab)
    stop = list(pipeline.stop_token_ids)
    prompts = [pipeline.encode(messages=p.messages) for p in load_prompts(args.dataset, "eval", limit=args.limit)]
    max_len = max(map(len, prompts)) + args.max_new_tokens + pipeline.proposer.block_size + 1
    methods = {"ar": EngineConfig(max_batch=1, max_len=max_len)}
    for spec in [f"fixed:{k}" for k in args.lengths] + args.policies:
        methods[spec] = EngineConfig(SpeculativeConfig.of("dflash", spec), max_batch=1, max_len=max_len)
    engines = {name: build_engine(config, pipeline.engine_models()) for name, config in methods.items()}
    steps: dict[str, list[dict]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for ids in prompts[:1]:  # warm-up: kernel buffers, caches
        for engine in engines.values():
            profile_generation(engine, ids, 8, stop)
    for _ in range(args.repeats):
        for ids in prompts:
            for name, engine in engines.items():  # alternating: drift falls on every method alike
                s, out = profile_generation(engine, ids, args.max_new_tokens, stop)
                steps[name] += s
                outputs[name].append(out)
    rows = {name: summarize(s) for name, s in steps.items()}
    for name, engine in engines.items():
        cost = getattr(engine.policy, "step_cost", None)
        if isinstance(cost, CalibratedCost):  # what the policy learned of this machine's step times
            rows[name]["calibration"] = {"scale": round(cost.scale, 3),
                                         "per_draft_ms": round(1e3 * cost.per_draft_s, 3),
                                         "per_extra_draft_ms": round(1e3 * cost.per_extra_draft_s, 3)}
    ar = rows["ar"]
    for name, row in rows.items():
        row["vs_ar"] = round(row["tokens_per_s"] / ar["tokens_per_s"], 3)
        row["identical_to_ar"] = outputs[name] == outputs["ar"]
    return {"rows": rows, "dataset": args.dataset, "prompts": len(prompts), "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "dtype": str(pipeline.target.dtype).removeprefix("torch."),
            "machine": machine_info()}


def to_markdown(report: dict) -> str:
    rows, ar = report["rows"], report["rows"]["ar"]
    table = [[name, r["steps"], f"{r['step_ms']:.2f}", *(f"{r['ms'][p]:.2f}" for p in (*PARTS, "rest")),
              f"{r['drafts_per_step']:.2f}", f"{r['tokens_per_step']:.3f}", f"{r['tokens_per_s']:.1f}", f"{r['vs_ar']:.2f}x",
              "yes" if r["identical_to_ar"] else "NO"] for name, r in rows.items()]
    lines = [
        f"# Where a speculative engine step's time goes (batch 1, {report['dataset']})", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {cpu_label(report['machine'])}, {report['dtype']}, nothing else running. "
        f"{report['prompts']} eval prompts x {report['repeats']}, up to {report['max_new_tokens']} new tokens, "
        "greedy; mean ms per decode step (prefill left out).", "",
        markdown_table(["method", "steps", "step ms", *PARTS, "rest", "drafts / step", "tokens / step", "tok/s", "vs AR",
                        "identical to AR"], table),
    ]
    lines += ["", "Break-even: a speculative step pays when its tokens per step exceed its step ms / AR's step ms "
              f"(AR: {ar['step_ms']:.2f} ms for 1 token):", ""]
    for name, r in rows.items():
        if name != "ar":
            lines.append(f"- {name}: needs {r['step_ms'] / ar['step_ms']:.3f} tokens per step, commits "
                         f"{r['tokens_per_step']:.3f}")
    calibrated = {name: r["calibration"] for name, r in rows.items() if "calibration" in r}
    if calibrated:
        lines += ["", "What the calibrated policies learned of this machine's steps (`CalibratedCost`): "
                  + "; ".join(f"{name}: the profile x {c['scale']:.3f}, +{c['per_draft_ms']:.2f} ms per drafting "
                              f"request, +{c.get('per_extra_draft_ms', 0.0):.2f} ms per draft after its first"
                              for name, c in calibrated.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None, help="drafter dir (default: the model's shipped DFlash drafter)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft-vocab", default=None, metavar="K|full", help="cut the drafter's trimmed vocabulary to K")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--lengths", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2, 3])
    p.add_argument("--policies", type=lambda s: s.split(",") if s else [], default=[],
                   help="other length policies of --method dflash to profile beside fixed:K (e.g. throughput)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write this JSON and the markdown beside it (.md)")
    args = p.parse_args(argv)
    configure_process(args.threads)
    report = run(args)
    report.update(provenance(command_line(
        ["python", "benchmarks/runtime/step_profile.py"],
        [("--dtype", args.dtype), ("--draft-vocab", args.draft_vocab), ("--dataset", args.dataset),
         ("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens),
         ("--lengths", ",".join(map(str, args.lengths))), ("--policies", ",".join(args.policies) or None),
         ("--repeats", args.repeats), ("--threads", args.threads),
         ("--json", args.json)])))
    text = to_markdown(report)
    print(text)
    if args.json:
        write_report(args.json, report, text)


if __name__ == "__main__":
    main()
