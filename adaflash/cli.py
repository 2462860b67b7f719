"""`adaflash` command line: a thin layer over library calls."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Sequence

from adaflash.cli_args import (WITH_ADAFLASH_DEFAULT, add_device_arg, add_model_args, add_policy_state_arg,
                                add_prompt_lookup_arg, configure_process)
from adaflash.evaluation.context_length import register_cli as register_context_length_cli
from adaflash.evaluation.drafter_eval import register_cli as register_drafter_eval_cli
from adaflash.evaluation.load_test import register_cli as register_load_cli
from adaflash.evaluation.offline import register_cli as register_bench_cli
from adaflash.evaluation.sensitivity import register_cli as register_sensitivity_cli
from adaflash.evaluation.serve_bench import register_cli as register_serve_bench_cli
from adaflash.evaluation.serve_sweep import register_cli as register_sweep_cli
from adaflash.evaluation.tau import register_cli as register_eval_cli
from adaflash.evaluation.vocab_coverage import register_cli as register_vocab_cli
from adaflash.export.gguf import register_cli as register_export_cli
from adaflash.models.targets.registry import DEFAULT_TARGET, DEMO_TARGET, resolve_drafter
from adaflash.server.cli import register_cli as register_serve_cli
from adaflash.simulation.cli import register_cli as register_simulate_cli
from adaflash.speculative.config import METHODS, SpeculativeConfig, draft_model_of
from adaflash.training.cli import register_cli as register_train_cli

DEFAULT_DATA_MIX = "gsm-symbolic:300,sharegpt-chat:250,sharegpt-code:150,champ:100"


def _cmd_generate(args: argparse.Namespace) -> int:
    from adaflash.data.jsonl import read_prompts_file
    from adaflash.data.prompt import user_messages
    from adaflash.pipeline import Pipeline
    from adaflash.speculative.sampling import SamplingParams

    speculative = SpeculativeConfig.parse(args)  # every speculative flag checked, before the (slow) load
    if args.record_trace and not speculative.runs_on_engine:
        raise ValueError("--record-trace records the serving engine's steps: give --length-policy (fixed:K for a "
                         "fixed draft length) or --prompt-lookup")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = read_prompts_file(args.prompts_file) if args.prompts_file else None
    draft_model = draft_model_of(args, speculative)
    drafter = None if draft_model else resolve_drafter(args.model, args.drafter, speculative.drafter)
    pipeline = Pipeline.load(args.model, drafter, args.dtype, draft_vocab=args.draft_vocab,
                             carry_policy_state=args.carry_policy_state, draft_model=draft_model,
                             draft_max=args.draft_max)
    items = [(None, None, user_messages(args.prompt))] if prompts is None else [(p.id, p.domain, p.messages) for p in prompts]
    for prompt_id, domain, messages in items:
        completion = pipeline.complete(
            pipeline.encode(messages=messages),
            method=speculative,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            record_trace=args.record_trace,
        )
        if args.json:
            record = completion.as_dict()
            if prompt_id is not None:
                record.update(id=prompt_id, domain=domain)
            print(json.dumps(record), flush=True)
        else:
            print(completion.text, flush=True)
            s = completion.stats
            print(
                f"[{speculative.name}] {len(completion.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, "
                f"accept length {s['accept_len_mean']:.2f}, {s['target_passes']} target passes",
                file=sys.stderr,
            )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from adaflash.evaluation.demo import run_demo

    return run_demo(model=args.model, drafter=args.drafter, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                    draft_vocab=args.draft_vocab, rounds=args.rounds, draft_model=args.draft_model,
                    draft_max=args.draft_max)


def _cmd_data_list(args: argparse.Namespace) -> int:
    from adaflash.data import list_datasets

    def size(info, split: str) -> str:
        if split not in info.split_sizes:
            return "-"
        n = info.split_sizes[split]
        return "unlimited" if n is None else str(n)

    print(f"{'name':<16}{'domain':<8}{'eval':>10}{'train':>10}  package / description")
    for info in list_datasets():
        status = "" if info.available else "  [NOT INSTALLED]"
        print(f"{info.name:<16}{info.domain:<8}{size(info, 'eval'):>10}{size(info, 'train'):>10}  {info.package}{status}")
        print(f"{'':<44}{info.description}")
    return 0


def _parse_mix(text: str) -> list[tuple[str, int, int]]:
    """"gsm-symbolic:300,sharegpt-chat:2000-3500" -> [("gsm-symbolic", 0, 300), ("sharegpt-chat", 2000, 3500)]: the
    first COUNT train prompts of a dataset, or those in [START, END) (new prompts beyond an earlier run's)."""
    mix = []
    for item in text.split(","):
        name, _, span = item.partition(":")
        start, dash, end = span.partition("-")
        if not start.isdigit() or (dash and not end.isdigit()):
            raise ValueError(f"--mix items are NAME:COUNT or NAME:START-END, got {item!r}")
        first, stop = (int(start), int(end)) if dash else (0, int(start))
        if stop <= first:
            raise ValueError(f"--mix range {item!r} is empty")
        mix.append((name.strip(), first, stop))
    return mix


def _mix_prompts(mix: str | None, seed: int) -> list:
    """The train-split prompts a --mix names, round-robin over its datasets (a run stopped early holds every domain)."""
    from adaflash.data import load_prompts

    per_dataset = [load_prompts(name, "train", limit=stop, seed=seed)[first:]
                   for name, first, stop in _parse_mix(mix or DEFAULT_DATA_MIX)]
    return [p for group in itertools.zip_longest(*per_dataset) for p in group if p is not None]


def _cmd_data_export(args: argparse.Namespace) -> int:
    """A --mix as one JSONL prompt file (gzip-compressed for .gz): what `data generate --prompts-file` reads where the
    prompt-set packages are not installed (a GPU machine)."""
    import gzip

    prompts = _mix_prompts(args.mix, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"id": p.id, "domain": p.domain, "dataset": p.dataset, "messages": list(p.messages)},
                               ensure_ascii=False) + "\n" for p in prompts)
    out.write_bytes(gzip.compress(lines.encode(), mtime=0) if out.suffix == ".gz" else lines.encode())
    print(f"{out}: {len(prompts)} prompts, {out.stat().st_size / 1e6:.1f} MB")
    return 0


def _cmd_data_generate(args: argparse.Namespace) -> int:
    from adaflash.models.drafters.config import build_target_layer_ids
    from adaflash.pipeline import Pipeline
    from adaflash.training.datagen import DataGenConfig, generate_dataset

    from adaflash.data.jsonl import read_prompts_file

    pipeline = Pipeline.load(args.model, None, args.dtype)
    layers = (
        tuple(int(x) for x in args.capture_layers.split(","))
        if args.capture_layers
        else build_target_layer_ids(pipeline.target.config.num_layers, args.drafter_layers)
    )
    prompts = read_prompts_file(args.prompts_file) if args.prompts_file else _mix_prompts(args.mix, args.seed)
    config = DataGenConfig(
        model=args.model, capture_layers=layers, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
        temperature=args.temperature, seed=args.seed, top_logprobs=args.top_logprobs,
        store_features=not args.tokens_only,
    )
    manifest = generate_dataset(
        pipeline.target, lambda p: pipeline.encode(messages=p.messages), pipeline.stop_token_ids, prompts, args.out, config
    )
    samples = sum(s["num_samples"] for s in manifest["shards"])
    tokens = sum(s["response_tokens"] for s in manifest["shards"])
    size = sum(f.stat().st_size for f in Path(args.out).glob("shard-*.safetensors"))
    print(f"{args.out}: {samples} samples, {tokens} response tokens, {len(manifest['skipped'])} prompts skipped (too long), "
          f"{size / 1e9:.2f} GB on disk")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash", description="Lossless adaptive speculative decoding")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every command (default: $ADAFLASH_THREADS, else all cores); "
                        "benchmarks should run with nothing else on those cores")
    add_device_arg(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with AR or speculative decoding")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a user message (the chat template is applied)")
    src.add_argument("--prompts-file", help='JSONL with {"prompt": ...} or {"messages": [...]}, optional "domain"')
    add_model_args(gen, length_policy_default=WITH_ADAFLASH_DEFAULT)
    add_prompt_lookup_arg(gen)
    add_policy_state_arg(gen)
    gen.add_argument("--method", choices=METHODS, default="ar",
                     help="ar (default: plain decoding), dflash (the drafter's blocks) or adaflash (dflash with the "
                     "AdaFlash drafter and its length head under the adaflash length policy)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--draft-length", type=int, default=None, help="drafted tokens verified per step (default block_size-1)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument("--record-trace", default=None, metavar="DIR",
                     help="append each prompt's verification trace to DIR/traces.jsonl: its prompt and output ids and, "
                     "per step, the drafter's whole block, drafts verified, accept length and the length head's "
                     "prediction (what `bench simulate --drafter trace:DIR` replays; needs the engine: a "
                     "--length-policy or --prompt-lookup)")
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="AR vs speculative decoding on a few chat, code and math prompts")
    add_model_args(demo)
    demo.set_defaults(model=DEMO_TARGET)  # the real CPU target; --model smollm2-135m: the suite's small one
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--rounds", type=int, default=5, help="runs of every prompt and method; medians are reported")
    demo.set_defaults(func=_cmd_demo)

    data = sub.add_parser("data", help="prompt sets")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_sub.add_parser("list", help="list the prompt sets and their splits").set_defaults(func=_cmd_data_list)
    dexp = data_sub.add_parser("export", help="write a --mix of train-split prompts to one JSONL(.gz) prompt file")
    dexp.add_argument("--mix", default=None, help=f"as `data generate --mix` (default {DEFAULT_DATA_MIX})")
    dexp.add_argument("--out", required=True, help="the prompt file: .jsonl, or .jsonl.gz (gzip)")
    dexp.add_argument("--seed", type=int, default=0)
    dexp.set_defaults(func=_cmd_data_export)
    dgen = data_sub.add_parser("generate", help="regenerate training responses with the target (resumable)")
    dgen.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    prompt_source = dgen.add_mutually_exclusive_group()
    prompt_source.add_argument("--mix", default=None, help="train-split prompts per dataset: NAME:COUNT (the first COUNT) "
                               f"or NAME:START-END, comma-separated (default {DEFAULT_DATA_MIX})")
    prompt_source.add_argument("--prompts-file", default=None,
                               help="a JSONL prompt file (.jsonl or .jsonl.gz, as `generate --prompts-file` reads) "
                               "instead of the registered sets: `adaflash data export` writes one from a --mix")
    dgen.add_argument("--model", default=DEFAULT_TARGET)
    dgen.add_argument("--dtype", default="auto")
    dgen.add_argument("--drafter-layers", type=int, default=2, help="capture the layers a drafter of this depth reads")
    dgen.add_argument("--capture-layers", default=None, help="explicit comma-separated target layer ids")
    dgen.add_argument("--max-new-tokens", type=int, default=256)
    dgen.add_argument("--max-prompt-tokens", type=int, default=512)
    dgen.add_argument("--batch-size", type=int, default=64, help="sequences kept running (slots refilled as they finish)")
    dgen.add_argument("--top-logprobs", type=int, default=0,
                      help="also keep the target's top-k log-probabilities per response token (soft targets)")
    dgen.add_argument("--tokens-only", action="store_true",
                      help="store the responses' tokens, not the target's features: training recomputes them with the "
                      "target inside its step (what a GPU does faster than reading ~3.5 KB a token back)")
    dgen.add_argument("--shard-size", type=int, default=64)
    dgen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    dgen.add_argument("--seed", type=int, default=0)
    dgen.set_defaults(func=_cmd_data_generate)
    register_bench_cli(sub)  # bench offline
    register_serve_bench_cli(sub)  # bench serve
    register_load_cli(sub)  # bench load
    register_sweep_cli(sub)  # bench sweep
    register_simulate_cli(sub)  # bench simulate
    register_eval_cli(sub)  # eval tau
    register_vocab_cli(sub)  # eval vocab
    register_drafter_eval_cli(sub)  # eval drafters, eval rkl-picture
    register_context_length_cli(sub)  # eval context-length
    register_sensitivity_cli(sub)  # eval sensitivity
    register_serve_cli(sub)  # serve
    register_train_cli(sub)  # train drafter, train distill
    register_export_cli(sub)  # export gguf
    for command in _commands(parser):
        if " ".join(command.prog.split()[1:]) not in _NO_MODEL_COMMANDS:
            add_device_arg(command)
    return parser


# Commands that run no model here (clients, listings, file conversions): no --device of their own.
_NO_MODEL_COMMANDS = {"data list", "data export", "bench serve", "bench load", "export gguf", "export vllm",
                      "export vllm-schedule"}


def _commands(parser: argparse.ArgumentParser):
    """The leaf command parsers under `parser` (generate, train drafter, ...)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        yield parser
        return
    for action in actions:
        for child in dict.fromkeys(action.choices.values()):
            yield from _commands(child)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure_process(args.threads, args.device)
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad input or a file that cannot be read or written: the message says which
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
