"""Our speculative speedup vs transformers' prompt-lookup decoding speedup, per domain, in one run.

    python benchmarks/serving/prompt_lookup.py --per-domain 3 --max-new-tokens 96 --json docs/results/serving/prompt_lookup.json

For each eval prompt the runs alternate in one process: transformers `generate` greedy, transformers with
`prompt_lookup_num_tokens` (n-gram drafts from the prompt), our AR, our speculative method (the shipped DFlash
drafter under `--length-policy`, default throughput) and, with `--ours-lookup K[,K2...]`, the same with our own
prompt-lookup drafts first (`--prompt-lookup K`), once per K. Each side's speedup is over its own AR on the same
prompt; the medians per domain are compared, and the summary says which of our configurations beats transformers'
on every domain. `--skip N` starts each domain's prompts at the N-th (choose a configuration on one slice, report
it on another). Both transformers runs must produce the same tokens (its lossless check), and so must all of ours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.evaluation.offline import command_line, cpu_label, provenance
from adaflash.report import markdown_table, write_report
from adaflash.speculative.prompt_lookup import PromptLookup

DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench", "multilingual": "mgsm"}


def _hf_generate(model, ids: list[int], max_new_tokens: int, eos: list[int], lookup: int | None) -> tuple[list[int], float]:
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:

    from adaflash.models.targets.registry import resolve_drafter, resolve_target, transformers_model
    from adaflash.pipeline import Pipeline

    pipeline = Pipeline.load(args.model, resolve_drafter(args.model, args.drafter), args.dtype, args.length_policy)
    with_lookup = {k: pipeline.with_prompt_lookup(PromptLookup(k)) for k in args.ours_lookup}
    hf = transformers_model(resolve_target(args.model), pipeline.target.dtype)
    eos = list(pipeline.stop_token_ids)
    rows = []
    for domain, dataset in DOMAINS.items():
        for prompt in load_prompts(dataset, "eval", limit=args.skip + args.per_domain)[args.skip:]:
            ids = pipeline.encode(messages=prompt.messages)
            hf_ar, hf_ar_s = _hf_generate(hf, ids, args.max_new_tokens, eos, None)
            hf_pld, hf_pld_s = _hf_generate(hf, ids, args.max_new_tokens, eos, args.lookup)
            ours_ar = pipeline.generate_ids(ids, "ar", args.max_new_tokens)
            ours_spec = pipeline.generate_ids(ids, "dflash", args.max_new_tokens)
            ours_lookup = {k: p.generate_ids(ids, "dflash", args.max_new_tokens) for k, p in with_lookup.items()}
            rows.append({
                "domain": domain, "prompt_id": prompt.id, "tokens": len(ours_ar.token_ids),
                "hf_ar_tok_s": len(hf_ar) / hf_ar_s, "hf_pld_tok_s": len(hf_pld) / hf_pld_s,
                "ours_ar_tok_s": len(ours_ar.token_ids) / ours_ar.stats.elapsed_s,
                "ours_spec_tok_s": len(ours_spec.token_ids) / ours_spec.stats.elapsed_s,
                "ours_accept_len": ours_spec.stats.accept_len_mean,
                "hf_lossless": hf_ar == hf_pld,
                "ours_lossless": all(r.token_ids == ours_ar.token_ids for r in [ours_spec, *ours_lookup.values()]),
                "lookup": {str(k): {"tok_s": len(r.token_ids) / r.stats.elapsed_s, "accept_len": r.stats.accept_len_mean}
                           for k, r in ours_lookup.items()},
            })
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    by_domain = {}
    for domain in DOMAINS:
        mine = [r for r in rows if r["domain"] == domain]
        pld = statistics.median(r["hf_pld_tok_s"] / r["hf_ar_tok_s"] for r in mine)
        ours = statistics.median(r["ours_spec_tok_s"] / r["ours_ar_tok_s"] for r in mine)
        by_domain[domain] = {"prompt_lookup_speedup": pld, "ours_speedup": ours, "ours_beats_prompt_lookup": ours > pld,
                             "ours_accept_len": statistics.fmean(r["ours_accept_len"] for r in mine)}
        by_domain[domain]["lookup"] = {}
        for k in with_lookup:
            speedup = statistics.median(r["lookup"][str(k)]["tok_s"] / r["ours_ar_tok_s"] for r in mine)
            by_domain[domain]["lookup"][str(k)] = {
                "speedup": speedup, "beats_prompt_lookup": speedup > pld,
                "accept_len": statistics.fmean(r["lookup"][str(k)]["accept_len"] for r in mine)}
    configs = {"dflash": [m["ours_beats_prompt_lookup"] for m in by_domain.values()]}
    configs.update({f"dflash + lookup {k}": [m["lookup"][str(k)]["beats_prompt_lookup"] for m in by_domain.values()]
                    for k in with_lookup})
    return {"rows": rows, "by_domain": by_domain, "dtype": pipeline.target.numerics,
            "length_policy": args.length_policy, "lookup": args.lookup, "ours_lookup": list(with_lookup),
            "beats_on_every_domain": {name: all(beats) for name, beats in configs.items()}}


def to_markdown(report: dict) -> str:
    lines = [
        "# Our speculative speedup vs transformers' prompt-lookup decoding (batch 1, greedy)",
        "",
        f"Command: `{report['command']}`",
        f"Machine: {cpu_label(report['machine'])}, {report['machine']['threads']} threads, {report['dtype']}; "
        f"ours: DFlash drafter, length policy {report['length_policy']}; transformers: prompt_lookup_num_tokens="
        f"{report['lookup']}. Each speedup is over its own AR on the same prompts (median).",
        "",
    ]
    lookups = report["ours_lookup"]
    headers = ["domain", "transformers PLD / AR", "ours / our AR", "our accept length", "ours better"]
    for k in lookups:
        headers += [f"ours + lookup {k} / our AR", "accept length", "better"]
    yes = {True: "yes", False: "no"}
    rows = []
    for d, m in report["by_domain"].items():
        row = [d, f"{m['prompt_lookup_speedup']:.2f}x", f"{m['ours_speedup']:.2f}x", f"{m['ours_accept_len']:.2f}",
               yes[m["ours_beats_prompt_lookup"]]]
        for k in lookups:
            mk = m["lookup"][str(k)]
            row += [f"{mk['speedup']:.2f}x", f"{mk['accept_len']:.2f}", yes[mk["beats_prompt_lookup"]]]
        rows.append(row)
    lines.append(markdown_table(headers, rows))
    every = [name for name, ok in report["beats_on_every_domain"].items() if ok]
    lines += ["", "Ours beats transformers' prompt lookup on every domain with: "
              + (", ".join(every) if every else "no configuration") + "."]
    lossless = all(r["ours_lossless"] for r in report["rows"])
    hf_same = sum(r["hf_lossless"] for r in report["rows"])
    lines += ["", f"Our outputs identical to our AR on every prompt: {'yes' if lossless else 'NO'}. "
              f"transformers' prompt-lookup output identical to its AR on {hf_same} of {len(report['rows'])} prompts."]
    return "\n".join(lines) + "\n"


def _lookup_lengths(text: str) -> list[int]:
    return [int(k) for k in text.split(",") if k.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--length-policy", default="throughput")
    p.add_argument("--per-domain", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--ours-lookup", type=_lookup_lengths, default=[], metavar="K[,K2...]",
                   help="also run ours with our prompt-lookup drafts first (--prompt-lookup K), once per K")
    p.add_argument("--skip", type=int, default=0, help="start each domain's prompts at this index")
    p.add_argument("--json", required=True, help="writes this JSON and the markdown beside it (.md)")
    args = p.parse_args()
    configure_process(None)
    report = run(args)
    cmd = command_line(["python", "benchmarks/serving/prompt_lookup.py"],
                       [("--per-domain", args.per_domain), ("--max-new-tokens", args.max_new_tokens),
                        ("--dtype", args.dtype), ("--length-policy", args.length_policy), ("--lookup", args.lookup),
                        ("--ours-lookup", ",".join(map(str, args.ours_lookup)) or None), ("--skip", args.skip or None),
                        ("--json", args.json)])
    report.update(provenance(cmd))
    write_report(args.json, report, to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
