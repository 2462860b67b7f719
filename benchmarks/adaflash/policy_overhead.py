"""What a length policy's own work costs a step, beside the plain decode step it rides on.

    python benchmarks/adaflash/policy_overhead.py --dtype fp32 --threads 2 --out docs/results/adaflash/policy_overhead.json

Per batch size: our engine's plain decode step (`fixed:0`, every slot busy; the median of timed steps) and, timed
apart in the same process, each adaptive policy's bookkeeping for one step of that batch as the engine runs it: the
drafting check's decision and record, the policy's `decide` (a learned head's forward included, on block hidden states
handed to it: the drafter pass that makes them is the drafter's cost, not the policy's), every request's feedback, and
the step's observation (the calibration's update); `lookup sizing` is `LookupLength` over 8-token matches. Outcomes are
drawn at a 50% per-position acceptance and the check kept in its drafting arm, the dearer one (a plain-arm step skips
`decide`). Run with nothing else on the cores.

Each is timed twice: warm (its steps back to back) and in place (a plain decode step of the engine before each, as the
engine runs it: the step's weights have streamed through the caches, so the policy's code and data are fetched afresh,
and the same work costs several times its warm time).

Then, whole: at the batch sizes up to 8 (1 and 8 by default), the AR engine and each policy's engine held in its
check's plain arm (what a request the check keeps from drafting costs: the drafter's features captured and kept, and,
since a chosen plain stretch runs as a plain run, its steps' bookkeeping replayed at the run's end, engine/drafting.py),
stepped in turn on the same requests: how much longer than AR's step a plain-arm step runs, and what the replay adds
to each step (timed when the run ends, after the rounds).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Callable

import torch

from adaflash.cli_args import configure_process
from adaflash.engine.engine_factory import EngineConfig, build_engine, length_policy_factory
from adaflash.engine.request import Request
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.report import markdown_table, write_report
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks
from adaflash.speculative.length_policy import LookupLength
from adaflash.speculative.policies import build_length_policy

POLICIES = ("heuristic", "throughput", "throughput-profiled", "adaflash")


def decoding_engine(pipeline: Pipeline, batch: int, steps: int, speculative: SpeculativeConfig | None = None,
                    checks: DraftingChecks | None = None):
    """`speculative`'s engine (default `fixed:0`: a drafter's engine that never drafts) with `batch` slots busy for
    `steps` steps, past its prefill; `checks`: its drafting checks (None: the factory's)."""
    speculative = speculative or SpeculativeConfig.of("dflash", "fixed:0")
    config = EngineConfig(speculative, max_batch=batch, max_len=64 + steps + 32)
    engine = build_engine(config, pipeline.engine_models(), checks=checks)
    for i in range(batch):
        engine.add_request(Request(f"r{i}", [(7 * i + j) % 1000 + 100 for j in range(64)], steps + 8))
    engine.step()  # the prefill
    return engine


def decode_step_s(engine, steps: int) -> float:
    """The median of `steps` plain decode steps of `engine`."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _accepted(rng: random.Random, drafted: int) -> int:
    """Drafts kept of `drafted`, each position accepted with probability 0.5 while the ones before it were."""
    return next((j for j in range(drafted) if rng.random() > 0.5), drafted)


def policy_step_s(policy, batch: int, max_draft: int, hidden: torch.Tensor, steps: int, seed: int = 0,
                  before: Callable[[], object] = lambda: None) -> float:
    """The median seconds of one step's bookkeeping: check, decide, feedback, observe; `before` runs untimed ahead of
    each (an engine's decode step: the policy in place)."""
    rng = random.Random(seed)
    checks = DraftingChecks(DraftingCheck(drafting_chosen=True, stretch=10 ** 6))  # always the drafting arm
    requests = [Request(f"r{i}", [1, 2], 10 ** 6) for i in range(batch)]
    times = []
    for _ in range(steps):
        before()
        start = time.perf_counter()
        checks.decide(batch)
        lengths = policy.decide(requests, max_draft, lambda rows: hidden[: len(rows)])
        accepted = [_accepted(rng, k) for k in lengths]
        for r, k, a in zip(requests, lengths, accepted):
            policy.feedback(r, k, a)
        policy.observe_step(lengths, 0.01 * batch)
        checks.record(sum(accepted) + batch, 0.01 * batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def lookup_step_s(cost, batch: int, steps: int, seed: int = 0, before: Callable[[], object] = lambda: None) -> float:
    rng = random.Random(seed)
    sizing = LookupLength(cost)
    requests = [Request(f"r{i}", [1, 2], 10 ** 6) for i in range(batch)]
    proposals = [list(range(8))] * batch
    times = []
    for _ in range(steps):
        before()
        start = time.perf_counter()
        lengths = sizing.decide(requests, proposals)
        for r, k in zip(requests, lengths):
            sizing.feedback(r, k, _accepted(rng, k))
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def paired_excess_s(steppers: dict[str, Callable[[], object]], rounds: int, baseline: str = "ar") -> dict[str, float]:
    """The steppers called in turn for `rounds` rounds (the order rotated each round): the baseline's median seconds,
    and per other stepper the median of its excess over the baseline's call in the same round. A round's calls run
    within milliseconds of each other, so this VM's drift cancels out of the pairs."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    names = list(steppers)
    for k in range(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            start = time.perf_counter()
            steppers[name]()
            times[name].append(time.perf_counter() - start)
    base = times[baseline][2:]  # past the first rounds' warm-up
    excess = {name: statistics.median(a - b for a, b in zip(t[2:], base)) for name, t in times.items()
              if name != baseline}
    return {baseline: statistics.median(base), **excess}


def plain_arm_steps_s(pipeline: Pipeline, batch: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """AR's engine step and each policy's engine step in its check's plain arm (`paired_excess_s`), and per policy the
    seconds a step its plain run's replay takes."""
    engines = {"ar": decoding_engine(pipeline, batch, steps, SpeculativeConfig.of("ar"))}
    for name in POLICIES:  # each check held in its plain arm for longer than this runs
        held = DraftingChecks(DraftingCheck(stretch=10 ** 6, longest=10 ** 6))
        engines[name] = decoding_engine(pipeline, batch, steps, SpeculativeConfig.of("dflash", name), held)
    excess = paired_excess_s({name: engine.step for name, engine in engines.items()}, steps)
    replay = {}
    for name in POLICIES:
        start = time.perf_counter()
        engines[name].drafting.close_run()
        replay[name] = (time.perf_counter() - start) / (steps - 1)  # the first step decided: the run holds the rest
    return excess, replay


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "int8"])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    threads = configure_process(args.threads, "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    pipeline = Pipeline.load("smollm2-135m", shipped_drafter("smollm2-135m", "adaflash"), args.dtype)
    models = pipeline.engine_models()
    config = EngineConfig(SpeculativeConfig.of("dflash", "throughput"), max_batch=max(batches))
    cost = length_policy_factory(config, models).cost
    block = models.proposer.block_size
    hidden = torch.randn(max(batches), block, pipeline.length_head.config.hidden_size)
    rows, report = [], {"decode_step_s": {}, "policy_step_s": {}, "policy_in_place_s": {}}
    for batch in batches:
        engine = decoding_engine(pipeline, batch, args.steps * (len(POLICIES) + 2))  # the decode steps, each in place
        decode = decode_step_s(engine, args.steps)
        report["decode_step_s"][batch] = decode
        timed = {}
        for place, before in (("warm", lambda: None), ("in place", engine.step)):
            timed[place] = {name: policy_step_s(build_length_policy(name, cost, pipeline.length_head), batch,
                                                block - 1, hidden, args.steps, before=before) for name in POLICIES}
            timed[place]["lookup sizing"] = lookup_step_s(cost.profile, batch, args.steps, before=before)
        report["policy_step_s"][batch], report["policy_in_place_s"][batch] = timed["warm"], timed["in place"]
        rows += [[str(batch), f"{decode * 1e3:.2f}", name, f"{s * 1e6:.0f}", f"{timed['in place'][name] * 1e6:.0f}",
                  f"{100 * timed['in place'][name] / decode:.2f}%"] for name, s in timed["warm"].items()]
    plain_rows, report["plain_arm_step_s"], report["plain_run_replay_s"] = [], {}, {}
    for batch in [b for b in batches if b <= 8]:
        measured, replay = plain_arm_steps_s(pipeline, batch, 25 * args.steps)
        report["plain_arm_step_s"][batch], report["plain_run_replay_s"][batch] = measured, replay
        ar = measured["ar"]
        plain_rows += [[str(batch), f"{ar * 1e3:.3f}", name, f"{excess * 1e6:+.0f}", f"{replay[name] * 1e6:.1f}",
                        f"{100 * (excess + replay[name]) / ar:+.2f}%"]
                       for name, excess in measured.items() if name != "ar"]
    report.update(command=" ".join(["python", "benchmarks/adaflash/policy_overhead.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
                  machine={"cpu": cpu_model(), "threads": threads, "dtype": args.dtype})
    text = (f"A length policy's own work per engine step beside the plain decode step, {report['machine']['cpu']}, "
            f"{threads} threads, {args.dtype}. Command: `{report['command']}`\n\n"
            + markdown_table(["batch", "decode step ms", "policy", "µs a step, warm", "µs a step, in place",
                              "in place, of the decode step"], rows)
            + "\n\nWhole engine steps: each policy's engine held in its check's plain arm against AR's engine, stepped "
              f"in turn ({25 * args.steps} rounds; the median of a round's excess over AR's step), and the plain run's "
              "replay of their bookkeeping, a step:\n\n"
            + markdown_table(["batch", "AR step ms", "policy", "plain-arm excess µs a step", "replay µs a step",
                              "both, of AR's step"], plain_rows) + "\n")
    write_report(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
