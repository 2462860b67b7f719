"""How much of the target's own output a trimmed draft vocabulary covers, and what each size costs to draft.

    adaflash eval vocab --data runs/data/smollm2-v2 --sizes 4096,8192,16384 --holdout 200 --out docs/results/drafter/draft_vocab

The vocabulary is ranked on the training samples' responses exactly as `train drafter` ranks it (the same
held-out split); coverage is measured on the held-out samples' responses, per domain: the share of the target's
tokens the drafter could ever propose (a ceiling on per-token acceptance). Cost: one batched draft step (the
drafter pass plus the head on every block position) at batch 1 and 32, per size, on the real target. With
`--drafter` (one trained with a trimmed vocabulary), also its held-out teacher-forced accept length with the head
cut to each size (the same weights, fewer rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash.cli_args import command_group
from adaflash.evaluation.offline import command_line, cpu_label, provenance
from adaflash.models.device.placement import synchronize
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.report import markdown_table, write_report
from adaflash.training.dataset import DraftDataset
from adaflash.training.trainer import data_vocab
from adaflash.training.validation import split_holdout


def coverage_by_domain(dataset: DraftDataset, sizes: list[int], holdout: int, vocab_size: int) -> dict:
    train_ids, held_ids = split_holdout(dataset.keys, holdout)
    biggest = data_vocab([dataset.samples[i] for i in train_ids], max(sizes), vocab_size)
    held: dict[str, list[torch.Tensor]] = {}
    for i in held_ids:
        s = dataset.samples[i]
        for key in {s.domain, "all"} if s.domain else {"all"}:
            held.setdefault(key, []).append(s.tokens[s.prompt_len :])
    out = {}
    for size in sizes:
        vocab = biggest.truncated(size)
        out[str(size)] = {domain: vocab.coverage(torch.cat(t)) for domain, t in sorted(held.items())}
    out["full"] = {domain: 1.0 for domain in held}
    return {"coverage": out, "train_samples": len(train_ids), "held_out_samples": len(held_ids),
            "held_out_tokens": {d: int(sum(x.numel() for x in t)) for d, t in held.items()}}


def draft_step_ms(target, sizes: list[int], batch: int, context: int = 256, repeats: int = 5) -> dict[str, float]:
    """Median ms of one draft step (drafter pass + head on the 15 draft positions of each block) per head size."""
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.speculative.proposer import DFlashProposer
    from adaflash.speculative.sampling import SamplingParams

    cfg = DrafterConfig.for_target(target.config, mask_token_id=16, num_layers=2, block_size=16)
    results = {}
    for size in [*sizes, None]:
        drafter = init_drafter(cfg, dtype=target.dtype)
        if size is not None:
            drafter.set_draft_vocab(DraftVocab(torch.randperm(target.config.vocab_size)[:size], target.config.vocab_size))
        proposer = DFlashProposer(drafter, target)
        cache = proposer.new_cache(batch, context + 32)
        features = torch.randn(batch * context, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=target.dtype)
        proposer.add_context(cache, features, RaggedBatch.build(list(range(batch)), [0] * batch, [context] * batch))
        times = []
        for _ in range(repeats + 1):
            synchronize(target.device)  # the clock read after the GPU's queued work, not at its launch
            start = time.perf_counter()
            proposer.propose(cache, list(range(batch)), [1] * batch, [15] * batch, [SamplingParams()] * batch, [None] * batch)
            synchronize(target.device)
            times.append((time.perf_counter() - start) * 1e3)
        results[str(size or "full")] = statistics.median(times[1:])
    return results


def accept_length_by_size(target, drafter_dir: str, dataset: DraftDataset, sizes: list[int], holdout: int) -> dict:
    """Held-out full-block greedy accept length per domain of one drafter, its head cut to each size."""
    from adaflash.models.drafters.draft_vocab import DraftHead
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.training.losses import BlockCrossEntropy
    from adaflash.training.trainer import TeacherCache, TrainConfig, _sequence_loss
    from adaflash.training.validation import holdout_accept_lengths

    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    if drafter.draft_vocab is None:
        raise ValueError(f"{drafter_dir} has no trimmed draft vocabulary to cut")
    _, held_ids = split_holdout(dataset.keys, holdout)
    cfg = TrainConfig(data_dir="", out_dir="", anchors_per_sequence=32)
    teachers, loss = TeacherCache(target, drafter.config.target_layer_ids), BlockCrossEntropy()
    full = drafter.draft_vocab
    out = {}
    for size in [s for s in sizes if s <= full.size] + ([full.size] if full.size not in sizes else []):
        head = DraftHead(target.lm_head, full.truncated(size))
        out[str(size)] = holdout_accept_lengths(
            lambda i, g: _sequence_loss(drafter, drafter.config, target, head, i, dataset.samples[i], cfg, loss, g, teachers),
            drafter, held_ids, [dataset.samples[i].domain for i in held_ids], dataset.keys)
    return out


def to_markdown(report: dict) -> str:
    cov, cost = report["coverage"], report["draft_step_ms"]
    domains = sorted(next(iter(cov.values())))
    lines = [
        "# Trimmed draft vocabulary: coverage of the target's own outputs, and drafting cost",
        "",
        f"Command: `{report['command']}`",
        f"Ranked on {report['train_samples']} training samples' responses; coverage on {report['held_out_samples']} "
        f"held-out samples ({report['held_out_tokens'].get('all', 0)} response tokens).",
        f"Machine: {cpu_label(report['machine'])}, {report['machine']['threads']} threads, {report['dtype']}.",
        "",
        markdown_table(["rows kept", *(f"coverage {d}" for d in domains), "draft step ms, batch 1", "batch 32"],
                       [[size, *(f"{100 * cov[size][d]:.1f}%" for d in domains), f"{cost['1'][size]:.1f}",
                         f"{cost['32'][size]:.1f}"] for size in cov]),
    ]
    accept = report.get("accept_length")
    if accept:
        lines += ["", f"Held-out teacher-forced full-block accept length of `{report['drafter']}` with its head cut to "
                  "each size (greedy, 32 random anchors per held-out sample):", "",
                  markdown_table(["rows kept", *domains],
                                 [[size, *(f"{by_domain.get(d, float('nan')):.3f}" for d in domains)]
                                  for size, by_domain in accept.items()])]
    return "\n".join(lines) + "\n"


def _cmd(args: argparse.Namespace) -> int:
    from adaflash.models.targets.registry import resolve_target
    from adaflash.models.targets.model import load_target_as

    sizes = sorted(int(s) for s in args.sizes.split(","))
    target = load_target_as(resolve_target(args.model), args.dtype)
    dataset = DraftDataset(args.data, tuple(int(x) for x in args.capture_layers.split(",")))
    report = coverage_by_domain(dataset, sizes, args.holdout, target.config.vocab_size)
    report["draft_step_ms"] = {str(b): draft_step_ms(target, sizes, b) for b in (1, 32)}
    if args.drafter:
        report["drafter"] = args.drafter
        report["accept_length"] = accept_length_by_size(target, args.drafter, dataset, sizes, args.holdout)
    report["dtype"] = str(target.dtype).removeprefix("torch.")
    cmd = command_line(["adaflash", "eval", "vocab"], [("--data", args.data), ("--sizes", args.sizes),
                                                       ("--holdout", args.holdout), ("--drafter", args.drafter),
                                                       ("--out", args.out)])
    report.update(provenance(cmd))
    write_report(args.out, report, to_markdown(report))
    print(to_markdown(report))
    return 0


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "eval", "evaluations").add_parser(
        "vocab", help="coverage and drafting cost of trimmed draft vocabularies on regenerated data")
    p.add_argument("--data", required=True, help="a `data generate` directory")
    p.add_argument("--sizes", default="4096,8192,16384")
    p.add_argument("--holdout", type=int, default=64,
                   help="held-out samples: use the drafter's training `holdout_samples` (same data), or the scores are "
                   "on samples it trained on")
    p.add_argument("--capture-layers", default="1,14,27")
    p.add_argument("--drafter", default=None, help="a drafter with a trimmed vocabulary: its accept length per size")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="docs/results/drafter/draft_vocab", help="writes OUT.json and OUT.md")
    p.set_defaults(func=_cmd)
