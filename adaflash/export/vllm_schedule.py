"""`adaflash export vllm-schedule`: AdaFlash's throughput length policy as a vLLM batch-size schedule.

What vLLM 0.32.0's hooks can carry of our length policy (read from its source):
- `speculative_config.num_speculative_tokens_per_batch_size = [(start, end, k), ...]` (dynamic speculative decoding):
  one draft length for every request of a step, chosen by the step's batch size. The DFlash proposer drafts k for
  all requests; k = 0 turns drafting off at that batch size. This is what we export.
- `method: "custom_class"` loads a proposer by name, but vLLM calls it with token ids only (`propose(sampled_token_ids,
  num_tokens_no_spec, token_ids_cpu)`, like n-gram): no target hidden states, so it cannot run a DFlash drafter.
- The DFlash proposer returns a [batch, k] tensor: per-request lengths inside one step are not expressible without
  patching vLLM's model runner. Nor can our per-position length head run: it reads the drafter's hidden states,
  which vLLM does not expose to any hook.
So per request and per step, what is lost is the head's request-specific survival estimate and the per-request cut;
what is kept is the cost-aware choice under load: for each batch size B, the length that `allocate_drafts` (our
throughput policy, speculative/length_policy.py) picks for B requests with the drafter's measured per-position survival,
against a step-cost model.

Survival comes from vLLM's own acceptance counters (`benchmarks/peers/vllm_offline.py` output: per-request acceptance
histograms) or from our runtime's. The step cost is vLLM's own where it was timed (`benchmarks/peers/vllm_step_cost.py`:
its engine step at each batch size and draft length; the length per batch size is then the one with the most
expected tokens per second of step), else a `CostModel` JSON, else our runtime's profile (`cost_model_for`): a proxy
that misjudges vLLM, whose per-step overhead makes extra verified tokens far cheaper relative to a step than in our
runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def survival_from_histograms(histograms: Sequence[Sequence[int]]) -> list[float]:
    """P(drafts 1..j all accepted), j = 1..K, from acceptance histograms (count of verify steps with j accepted,
    j = 0..K), summed over requests: from a fixed-K run (vLLM drafts K at every step there)."""
    total = [sum(col) for col in zip(*histograms)]
    steps = sum(total)
    if steps == 0:
        raise ValueError("no verify steps in the acceptance histograms")
    k = len(total) - 1
    return [sum(total[j:]) / steps for j in range(1, k + 1)]


def length_for_batch(survival: Sequence[float], cost, batch: int, max_draft: int) -> int:
    """The draft length our throughput policy gives each of `batch` requests with this survival curve (identical
    requests: the greedy allocation gives them lengths at most one apart; the most common one is taken)."""
    from adaflash.speculative.length_policy import allocate_drafts

    lengths = allocate_drafts([list(survival[:max_draft])] * batch, cost, max_draft)
    return max(sorted(set(lengths)), key=lengths.count)


def _ranges(starts: Sequence[int], max_batch: int, length_at: Callable[[int], int]) -> list[list[int]]:
    """[[start, end, k], ...]: each start covers batch sizes up to the next start (the last up to max_batch) with the
    length `length_at(start)`; adjacent equal lengths merged."""
    entries: list[list[int]] = []
    for i, start in enumerate(starts):
        end = starts[i + 1] - 1 if i + 1 < len(starts) else max_batch
        k = length_at(start)
        if entries and entries[-1][2] == k:
            entries[-1][1] = end
        else:
            entries.append([start, end, k])
    return entries


def batch_schedule(survival: Sequence[float], cost, max_draft: int, max_batch: int) -> list[list[int]]:
    """[[start, end, k], ...] covering batch sizes 1..max_batch, one length per power-of-two bucket (evaluated at the
    bucket's lower end), adjacent equal lengths merged."""
    starts = [b for b in BUCKETS if b <= max_batch]
    return _ranges(starts, max_batch, lambda batch: length_for_batch(survival, cost, batch, max_draft))


def schedule_from_step_costs(survival: Sequence[float], step_s: dict[str, dict[str, float]],
                             max_batch: int) -> list[list[int]]:
    """[[start, end, k], ...] from vLLM's timed steps (`vllm_step_cost.py`'s `step_s[B][k]`, k = 0 without a
    speculative config): for each timed batch size B, the timed k with the most expected tokens per second,
    (1 + survival[0] + ... + survival[k-1]) / step_s[B][k]; B covers batch sizes up to the next timed one. A k = 0
    range inside a schedule that drafts elsewhere still runs with the speculative config, which costs vLLM more than
    the timed k = 0 (the drafter loaded, the target's hidden states kept every step): that loss is not priced here."""
    def best_length(batch: int) -> int:
        timed = step_s[str(batch)]
        return int(max((k for k in timed if int(k) <= len(survival)),
                       key=lambda k: (1 + sum(survival[: int(k)])) / timed[k]))

    starts = sorted(int(b) for b in step_s if int(b) <= max_batch)
    if not starts or starts[0] != 1:
        raise ValueError(f"the step costs must time batch size 1 (timed: {sorted(step_s)})")
    return _ranges(starts, max_batch, best_length)


def speculative_config(drafter: str, schedule: list[list[int]], max_draft: int) -> dict:
    return {"method": "dflash", "model": drafter, "num_speculative_tokens": max_draft,
            "num_speculative_tokens_per_batch_size": schedule}


def _histograms(path: Path) -> list[list[int]]:
    """Acceptance histograms from a vllm_offline.py output (`results[].spec.acceptance_histogram`)."""
    report = json.loads(path.read_text())
    hists = [r["spec"]["acceptance_histogram"] for r in report.get("results", []) if "spec" in r]
    if not hists:
        raise ValueError(f"{path} holds no per-request acceptance histograms (a vllm_offline.py run with a drafter)")
    return hists


def _cost_model(path: str | None, target: str, drafter: str | None, max_tokens: int):
    from adaflash.speculative.cost_model import CostModel, cost_model_for

    if path is not None:
        return CostModel.from_json(Path(path).read_text())
    from adaflash.pipeline import Pipeline

    pipeline = Pipeline.load(target, drafter=drafter, dtype="fp32")
    return cost_model_for(pipeline.target, pipeline.proposer, target, max_tokens)


def _cmd(args: argparse.Namespace) -> int:
    survival = survival_from_histograms(_histograms(Path(args.acceptance)))
    max_draft = min(args.max_draft, len(survival))
    if args.vllm_step_costs:
        step_s = json.loads(Path(args.vllm_step_costs).read_text())["step_s"]
        schedule = schedule_from_step_costs(survival[:max_draft], step_s, args.max_batch)
        max_draft = max(max(k for *_, k in schedule), 1)
    else:
        cost = _cost_model(args.cost_model, args.target, args.cost_drafter, args.max_tokens)
        schedule = batch_schedule(survival, cost, max_draft, args.max_batch)
    # Never drafting at any batch size: vLLM started with a speculative config still loads the drafter and captures
    # the target's hidden states every step (0.94x its AR at 32 requests on a CPU, docs/results/peers/vllm_schedule.md),
    # so the policy's choice is to serve without one.
    config = speculative_config(args.drafter_dir, schedule, max_draft) if any(k for *_, k in schedule) else None
    out = {"speculative_config": config, "schedule": schedule, "survival": survival[:max_draft]}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if config is None:
        print(f"the throughput policy drafts at no batch size up to {args.max_batch} with this drafter's survival "
              f"(P(first draft accepted) = {survival[0]:.2f}) and this step cost: serve without a speculative "
              "config", file=sys.stderr)
    print(json.dumps(config))
    return 0


def register_subcommand(export_sub) -> None:
    from adaflash.models.targets.registry import DEFAULT_TARGET

    cmd = export_sub.add_parser(
        "vllm-schedule", help="our throughput length policy as vLLM's num_speculative_tokens_per_batch_size",
        description="For each batch size, the draft length our throughput policy picks from the drafter's measured "
                    "per-position survival and a step-cost model; printed as a vLLM speculative_config.",
    )
    cmd.add_argument("--acceptance", required=True,
                     help="benchmarks/peers/vllm_offline.py output of a run with the drafter (its per-request acceptance "
                          "histograms)")
    cmd.add_argument("--drafter-dir", required=True, help="the exported drafter folder vLLM loads (OUT/drafter)")
    cost = cmd.add_mutually_exclusive_group()
    cost.add_argument("--vllm-step-costs", default=None,
                      help="vLLM's own step times (benchmarks/peers/vllm_step_cost.py output): the length per batch size "
                           "that gives vLLM the most expected tokens per second")
    cost.add_argument("--cost-model", default=None, help="CostModel JSON; default: profile our runtime here (cached)")
    cmd.add_argument("--target", default=DEFAULT_TARGET, help="target for the default cost profile")
    cmd.add_argument("--cost-drafter", default=None, help="our drafter folder for the default cost profile")
    cmd.add_argument("--max-tokens", type=int, default=1024, help="largest verify the cost profile covers")
    cmd.add_argument("--max-draft", type=int, default=15)
    cmd.add_argument("--max-batch", type=int, default=64)
    cmd.add_argument("--out", default=None, help="also write the config and the survival curve here (JSON)")
    cmd.set_defaults(func=_cmd)
