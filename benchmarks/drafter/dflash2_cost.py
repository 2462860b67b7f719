"""What DFlash 2's additions cost to draft with on this CPU: one proposal (a drafter pass over the block and the drafts'
tokens) of random SmolLM2-width drafters - DFlash 1 as shipped (2 layers, 3 context layers) and DFlash 2 of the same
width (grouped dynamic causal convolutions of 2 taps in groups of 16, a top-16 candidate selector at rank 64 and 256)
- over the full vocabulary and the shipped 16K-row draft vocabulary, at 15 drafts (the whole block of 16) and 7, batch
1 and 8. Arms alternate in each round; medians. Weights do not change a pass's cost, so random ones stand in for
trained ones.

    .venv/bin/python benchmarks/drafter/dflash2_cost.py --threads 1 --out docs/results/drafter/dflash2_cost
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.device.cpu import cpu_model
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.registry import resolve_target
from adaflash.models.targets.model import load_target
from adaflash.report import markdown_table, write_report
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import SamplingParams

ARMS = {"DFlash 1": {}, "DFlash 2, rank 64": {"selector_rank": 64}, "DFlash 2, rank 256": {"selector_rank": 256}}


def _proposer(target, arm: dict, vocab: int | None) -> DFlashProposer:
    cfg = DrafterConfig.for_target(target.config, mask_token_id=16, num_layers=2, block_size=16,
                                   target_layer_ids=(1, 14, 27))
    if arm:
        cfg = replace(cfg, conv_kernel_size=2, conv_group_size=16, selector_top_k=16, **arm)
    drafter = init_drafter(cfg, seed=0)
    if vocab is not None:
        drafter.set_draft_vocab(DraftVocab(torch.arange(vocab), target.config.vocab_size))
    return DFlashProposer(drafter, target)


def _timer(target, proposer: DFlashProposer, batch: int, drafts: int, context: int):
    cache = proposer.new_cache(batch, context + 32)
    width = len(proposer.capture_layers) * target.config.hidden_size
    proposer.add_context(cache, torch.randn(batch * context, width), RaggedBatch.build(
        list(range(batch)), [0] * batch, [context] * batch))
    slots, anchors = list(range(batch)), [42 + i for i in range(batch)]

    def once() -> float:
        start = time.perf_counter()
        proposer.propose(cache, slots, anchors, [drafts] * batch, [SamplingParams()] * batch, [None] * batch)
        return time.perf_counter() - start

    return once


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", required=True, help="STEM: writes STEM.json and STEM.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(resolve_target("smollm2-135m"), dtype=torch.float32, device="cpu")
    rows = []
    for vocab in (None, 16384):
        for batch, drafts in ((1, 15), (1, 7), (8, 15)):
            timers = {name: _timer(target, _proposer(target, arm, vocab), batch, drafts, args.context)
                      for name, arm in ARMS.items()}
            times: dict[str, list[float]] = {name: [] for name in ARMS}
            for _ in range(3):  # warm-up
                for once in timers.values():
                    once()
            for _ in range(args.rounds):
                for name, once in timers.items():
                    times[name].append(once())
            base = statistics.median(times["DFlash 1"])
            for name in ARMS:
                ms = statistics.median(times[name]) * 1e3
                rows.append({"draft_vocab": vocab or "full", "batch": batch, "drafts": drafts, "arm": name,
                             "propose_ms": round(ms, 3), "vs_dflash1": round(ms / (base * 1e3), 3)})
                print(rows[-1], flush=True)
    params = {name: sum(t.numel() for t in _proposer(target, arm, None).drafter.state_dict().values())
              for name, arm in ARMS.items()}
    report = {"command": " ".join(["python", "benchmarks/drafter/dflash2_cost.py", *(argv or sys.argv[1:])]),
              "cpu": cpu_model(), "threads": args.threads, "dtype": "fp32", "context": args.context,
              "target": "smollm2-135m (fp32)", "parameters": params, "rows": rows}
    table = markdown_table(["draft vocabulary", "batch", "drafts", "drafter", "propose (ms, median)", "x DFlash 1"],
                           [[r["draft_vocab"], r["batch"], r["drafts"], r["arm"], r["propose_ms"], r["vs_dflash1"]]
                            for r in rows], align="lrrlrr")
    md = (f"# DFlash 2's drafting cost on this CPU\n\nOne proposal (drafter pass + drafted tokens), random "
          f"SmolLM2-width drafters, context {args.context}, {cpu_model()}, {args.threads} thread(s), fp32; medians of "
          f"{args.rounds} alternating rounds.\n\n`{report['command']}`\n\n{table}\n\nParameters: "
          + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in params.items()) + "\n")
    write_report(args.out, report, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
