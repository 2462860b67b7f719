"""Does a draft block need all its positions? Accept length and drafter cost, whole block vs anchor + drafts.

    python benchmarks/runtime/draft_width.py --limit 4 --max-new-tokens 96 --json docs/results/runtime/draft_width.json

The DFlash drafter was trained on whole blocks (anchor + 15 masks, non-causal inside the block). Asked for k drafts,
the proposer can run the whole block or only anchor + k positions; later positions are masks whose keys the earlier
ones attend to, so their outputs may shift. For each eval domain and fixed draft length k both run greedily on the
same prompts in one process (the reference single-request loop): the mean accept length of each, their tokens
(must equal our AR's: lossless either way), and the drafter pass's cost at each width.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.evaluation.offline import command_line, cpu_label, provenance
from adaflash.models.device.placement import synchronize
from adaflash.report import markdown_table, write_report

DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "sharegpt-chat", "multilingual": "mgsm"}


def _draft_pass_ms(proposer, width: int, context: int = 256, repeats: int = 15) -> float:
    """Median ms of one drafter pass (block + LM head on its width - 1 drafts) after a `context`-token context."""
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.speculative.sampling import SamplingParams

    target = proposer.target
    cache = proposer.new_cache(1, context + proposer.block_size)
    features = torch.randn(context, len(proposer.capture_layers) * target.config.hidden_size, dtype=target.dtype)
    proposer.add_context(cache, features, RaggedBatch.build([0], [0], [context]))
    times = []
    for _ in range(repeats + 1):
        synchronize(target.device)  # the clock read after the GPU's queued work, not at its launch
        start = time.perf_counter()
        proposer.draft_tokens(proposer.draft_hidden(cache, [0], [100], width), [width - 1], [SamplingParams()], [None])
        synchronize(target.device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def run(args: argparse.Namespace) -> dict:
    from adaflash.models.targets.registry import resolve_drafter
    from adaflash.pipeline import Pipeline
    from adaflash.speculative.proposer import DFlashProposer
    from adaflash.speculative.reference import autoregressive_generate, speculative_generate

    pipeline = Pipeline.load(args.model, resolve_drafter(args.model, args.drafter), args.dtype)
    target, drafter = pipeline.target, pipeline.proposer.drafter
    proposers = {"whole block": DFlashProposer(drafter, target, whole_block=True),
                 "anchor + drafts": DFlashProposer(drafter, target)}
    lengths = [int(k) for k in args.lengths.split(",")]
    stop = list(pipeline.stop_token_ids)
    rows = []
    for domain, dataset in DOMAINS.items():
        prompts = [pipeline.encode(messages=p.messages) for p in load_prompts(dataset, "eval", limit=args.limit)]
        ar = [autoregressive_generate(target, ids, args.max_new_tokens, stop_token_ids=stop).token_ids for ids in prompts]
        for k in lengths:
            row = {"domain": domain, "dataset": dataset, "draft_length": k}
            for name, proposer in proposers.items():
                accepts, identical = [], True
                for ids, want in zip(prompts, ar):
                    r = speculative_generate(target, proposer, ids, args.max_new_tokens, draft_length=k,
                                             stop_token_ids=stop)
                    accepts += r.stats.accept_lengths
                    identical &= r.token_ids == want
                row[name] = {"accept_len": round(statistics.fmean(accepts), 4), "steps": len(accepts),
                             "identical_to_ar": identical}
            rows.append(row)
            print(row, flush=True)
    widths = sorted({2, 3, 4, 5, 8, proposers["whole block"].block_size})
    cost = {str(w): round(_draft_pass_ms(proposers["anchor + drafts"], w), 3) for w in widths}
    return {"rows": rows, "draft_pass_ms_by_width": cost, "dtype": str(target.dtype).removeprefix("torch."),
            "block_size": proposers["whole block"].block_size}


def to_markdown(report: dict) -> str:
    m = report["machine"]
    rows = []
    for r in report["rows"]:
        whole, narrow = r["whole block"], r["anchor + drafts"]
        same = "yes" if whole["identical_to_ar"] and narrow["identical_to_ar"] else "NO"
        rows.append([r["domain"], r["draft_length"], f"{whole['accept_len']:.3f}", f"{narrow['accept_len']:.3f}",
                     f"{narrow['accept_len'] - whole['accept_len']:+.3f}", same])
    cost = report["draft_pass_ms_by_width"]
    return "\n".join([
        "# Draft block width: whole block vs anchor + drafts (greedy, batch 1)", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {cpu_label(m)}, {m['threads']} threads, {report['dtype']}, nothing else running.", "",
        markdown_table(["domain", "drafts k", "accept, whole block", "accept, anchor + k", "difference",
                        "identical to AR"], rows), "",
        "Drafter pass (block + LM head on its drafts) by block width, ms, 256-token context:", "",
        markdown_table(["width", *cost], [["ms", *cost.values()]])]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--limit", type=int, default=4, help="eval prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--lengths", default="2,4,7", help="fixed draft lengths to compare at")
    p.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = p.parse_args()
    configure_process(None)
    report = run(args)
    cmd = command_line(["python", "benchmarks/runtime/draft_width.py"],
                       [("--drafter", args.drafter), ("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens),
                        ("--lengths", args.lengths), ("--json", args.json)])
    report.update(provenance(cmd))
    write_report(args.json, report, to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
