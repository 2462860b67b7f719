"""`adaflash bench sweep`: several `adaflash serve` configurations under the same load, side by side.

    adaflash bench sweep --server "ar=--method ar" --server "dflash-fixed16=--method dflash --length-policy fixed:15" \
        --server "dflash-throughput=--method dflash --length-policy throughput" \
        --datasets gsm8k,mt-bench --concurrency 1,8,32,64 --out docs/results/serving/serve_sweep

Starts one real server per configuration (each on its own port, same --max-batch), then for every dataset
and concurrency level runs the `bench serve` client against each server in turn, so the methods of one
cell are measured minutes apart, not an hour apart (these machines drift). Writes OUT.json, OUT.md (table
with each method's throughput as a ratio of the baseline server's (the first, or --baseline), and each server's
achieved GFLOP/s against an fp32 matmul peak timed in the same run) and OUT.png (throughput vs concurrency).

`--peer NAME="llama-server args"` puts llama.cpp beside them (built by `make peer`; the same target GGUF unless
the args give -m; one parallel slot per client at the highest concurrency), e.g.
`--peer "llama-ar=" --peer "llama-dflash=-md drafter.gguf --spec-type draft-dflash --spec-draft-n-max 3"`.
`--vllm NAME="vLLM server args"` puts vLLM's CPU build beside them (built by `make peer-vllm`; it serves
`--vllm-model`, the target folder `adaflash export vllm` writes, fp32, same max batch), e.g.
`--vllm "vllm-ar=" --vllm 'vllm-dflash=--speculative-config {"method": "dflash", "model": "OUT/drafter", ...}'`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import httpx

from adaflash.cli_args import command_group
from adaflash.evaluation.flops import matmul_peak_gflops, served_gflops
from adaflash.evaluation.peer import (LLAMA_SERVER, launched_process, llama_server_command, peer_bin_dir, peer_env,
                                      require_binary, VLLM_BUILD, vllm_bin_dir, vllm_env, vllm_server_command)
from adaflash.evaluation.serve_bench import run_level
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.device.cpu import cpu_model
from adaflash.report import beside, markdown_table, write_report


def launched_server(name: str, serve_args: list[str], port: int, max_batch: int, log_dir: Path, threads: int | None = None,
                    timeout_s: float = 600):
    """A real `adaflash serve` subprocess; yields its base URL once /health answers, stops it on exit."""
    cmd = [sys.executable, "-m", "adaflash.cli", "serve", *serve_args, "--port", str(port),
           "--max-batch", str(max_batch), "--log-level", "warning"]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    return _serving(name, cmd, port, log_dir, env, timeout_s)


def launched_peer(name: str, peer_args: list[str], port: int, parallel: int, ctx_per_slot: int, log_dir: Path,
                  threads: int | None, model_gguf: Path | None, timeout_s: float = 600):
    """A llama-server from `make peer` (.peer/bin) serving the same target GGUF; yields its base URL."""
    bin_dir = peer_bin_dir()
    cmd = llama_server_command(bin_dir, peer_args, port, parallel, ctx_per_slot, threads, model_gguf)
    return _serving(name, cmd, port, log_dir, peer_env(bin_dir), timeout_s)


def launched_vllm(name: str, vllm_args: list[str], port: int, model_dir: Path, served_name: str, max_batch: int,
                  max_model_len: int, log_dir: Path, threads: int | None, timeout_s: float = 900):
    """vLLM's OpenAI server from `make peer-vllm` (.peer/vllm-venv) on an exported target folder; yields its base URL."""
    cmd = vllm_server_command(vllm_bin_dir(), vllm_args, port, model_dir, served_name, max_batch, max_model_len)
    return _serving(name, cmd, port, log_dir, vllm_env(threads), timeout_s)


@contextmanager
def _serving(name: str, cmd: list[str], port: int, log_dir: Path, env: dict[str, str], timeout_s: float):
    url = f"http://127.0.0.1:{port}"
    with launched_process(name, cmd, f"{url}/health", log_dir / f"{name}.log", env, timeout_s):
        yield url


def _parse_server(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--server expects NAME=SERVE_ARGS, got {text!r}")
    return name, shlex.split(rest)


def measure_cell(names: list[str], run: Callable[[str], dict], rounds: int = 1, warmup: int = 0) -> dict[str, dict]:
    """Every server's result in one cell, `run(name)` each, `rounds` times, after `warmup` untimed runs of each (a
    server's first run of a cell's prompts finds no prompt prefix to reuse and its drafting check at a new batch size
    opening: a long-running server is past both). The baseline (names[0]) runs before each
    round and once more after the last, so what drifts during a cell (warm-up, the machine's clock) lands on both
    sides of every ratio: a server's `ratio` is the median over rounds of its throughput over the mean of the two
    baseline runs around it. Each round starts with the next server (A B C, B C A, ...), so no server always runs
    right after the baseline. Throughputs are medians over the runs, every run kept (`runs_tok_s`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    others = names[1:]
    for _ in range(warmup):
        for n in names:
            run(n)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    runs[names[0]].append(run(names[0]))
    for r in range(rounds if others else 0):
        for n in others[r % len(others):] + others[: r % len(others)]:
            runs[n].append(run(n))
        runs[names[0]].append(run(names[0]))
    base = [b["output_tokens_per_s"] for b in runs[names[0]]]
    results = {}
    for n in names:
        tok_s = [x["output_tokens_per_s"] for x in runs[n]]
        results[n] = {**runs[n][0], "failed": sum(x["failed"] for x in runs[n])}
        if len(tok_s) > 1 or n != names[0]:
            results[n].update(output_tokens_per_s=statistics.median(tok_s), runs_tok_s=tok_s)
        if n != names[0]:
            ratios = [t / ((base[i] + base[i + 1]) / 2) for i, t in enumerate(tok_s)]
            results[n].update(ratio=statistics.median(ratios), ratios=ratios)
    return results


def sweep_table(cells: list[dict], names: list[str]) -> str:
    """Per cell: each server's tok/s, the others' ratio to the baseline (`names[0]`), their accept / verify length."""
    base, others = names[0], names[1:]
    rows = []
    for cell in cells:
        by = cell["results"]
        acc = []
        for n in others:
            a, v = by[n]["accept_len_mean"], by[n]["verify_len_mean"]
            acc.append("-" if a is None else f"{a:.2f} / {v:.2f}")
        rows.append([cell["dataset"], cell["concurrency"], *(f"{by[n]['output_tokens_per_s']:.1f}" for n in names),
                     *(_ratio_cell(by[n]) for n in others), *acc])
    return markdown_table(["dataset", "concurrency", *(f"{n} tok/s" for n in names), *(f"{n} / {base}" for n in others),
                           *(f"{n} accept / verify" for n in others)], rows) + "\n"


def _ratio_cell(result: dict) -> str:
    """The median ratio, with the spread over rounds where there were several."""
    ratios = result["ratios"]
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{result['ratio']:.2f}x{spread}"


def plot_sweep(cells: list[dict], names: list[str], path: Path) -> None:
    from adaflash.plots import pyplot

    plt = pyplot()
    datasets = list(dict.fromkeys(c["dataset"] for c in cells))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        rows = [c for c in cells if c["dataset"] == ds]
        for n in names:
            ax.plot([c["concurrency"] for c in rows], [c["results"][n]["output_tokens_per_s"] for c in rows],
                    marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens / s")
        ax.set_title(ds)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SIX_MIX = "six-mix"


def prompt_pool(name: str) -> list[list[dict]]:
    """A dataset's eval prompts; `six-mix` interleaves the six benchmarks (one of each in turn)."""
    from adaflash.data import EVAL_BENCHMARKS, load_prompts

    if name != SIX_MIX:
        return [list(p.messages) for p in load_prompts(name, "eval")]
    sets = [load_prompts(b, "eval") for b in EVAL_BENCHMARKS]
    return [list(s[i].messages) for i in range(min(map(len, sets))) for s in sets]


def prompt_size(model: str) -> Callable[[list[dict]], int]:
    """A prompt's chat-templated length in --model's tokens."""
    from adaflash.models.targets.registry import load_tokenizer, resolve_target

    tok = load_tokenizer(resolve_target(model))
    return lambda m: len(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))


def _fitting(pool: list[list[dict]], size: Callable[[list[dict]], int], max_tokens: int) -> list[list[dict]]:
    """The prompts whose chat-templated length fits (so every server can take every prompt)."""
    return [m for m in pool if size(m) <= max_tokens]


def fitting_prompts(name: str, model: str, max_tokens: int) -> list[list[dict]]:
    """`prompt_pool(name)`'s prompts whose chat-templated length in `model`'s tokens is at most `max_tokens`."""
    return _fitting(prompt_pool(name), prompt_size(model), max_tokens)


def _cmd(args: argparse.Namespace) -> int:
    servers = [_parse_server(s) for s in args.server]
    peers = [_parse_server(s) for s in args.peer or []]
    vllms = [_parse_server(s) for s in args.vllm or []]
    names = [n for n, _ in servers + peers + vllms]
    if len(set(names)) != len(names):
        raise SystemExit(f"server names must be distinct, got {names}")
    if args.baseline is not None:
        if args.baseline not in names:
            raise SystemExit(f"--baseline {args.baseline!r} is none of the servers {names}")
        names = [args.baseline] + [n for n in names if n != args.baseline]
    if peers:
        require_binary(peer_bin_dir(), LLAMA_SERVER)  # before any server starts: fail in a second, not minutes
        if not args.max_prompt_tokens:
            raise ValueError("--peer needs --max-prompt-tokens: llama-server's per-slot context is sized from it")
    if vllms:
        require_binary(vllm_bin_dir(), "python", VLLM_BUILD)
        if not args.vllm_model or not args.max_prompt_tokens:
            raise ValueError("--vllm needs --vllm-model (an `adaflash export vllm` target folder) and "
                             "--max-prompt-tokens (vLLM's context length is sized from it)")
    peer_cmds = {n: ["llama-server", *a] for n, a in peers} | {n: ["vllm", *a] for n, a in vllms}
    levels = [int(c) for c in args.concurrency.split(",")]
    datasets = args.datasets.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = {ds: prompt_pool(ds) for ds in datasets}
    size = prompt_size(args.model)
    if args.max_prompt_tokens:
        prompts = {ds: _fitting(pool, size, args.max_prompt_tokens) for ds, pool in prompts.items()}
    peaks: list[float] = []
    config = None  # the model's shapes, for the compute table's FLOPs
    if args.matmul_peak:
        from adaflash.models.targets.registry import resolve_target

        config = TransformerConfig.from_dir(resolve_target(args.model))
    cells: list[dict] = []
    with ExitStack() as stack:
        log_dir = Path(args.log_dir)
        if args.record_trace:  # each server's verification trace in a folder of its own
            servers = [(n, [*a, "--record-trace", str(Path(args.record_trace) / n)]) for n, a in servers]
        urls = {n: stack.enter_context(launched_server(n, a, args.port + i, args.max_batch, log_dir, args.threads))
                for i, (n, a) in enumerate(servers)}
        if peers:
            from adaflash.models.targets.registry import target_gguf

            gguf = Path(args.peer_model) if args.peer_model else target_gguf(args.model)
            # One llama.cpp slot per concurrent client; each slot's context fits a prompt and its answer.
            parallel, ctx = max(levels), args.max_prompt_tokens + args.max_tokens + 64
            for i, (n, a) in enumerate(peers):
                urls[n] = stack.enter_context(launched_peer(n, a, args.port + len(servers) + i, parallel, ctx, log_dir,
                                                            args.threads, gguf))
        model = httpx.get(f"{urls[servers[0][0]]}/v1/models", timeout=30).json()["data"][0]["id"]
        for i, (n, a) in enumerate(vllms):  # served under our server's model name
            urls[n] = stack.enter_context(launched_vllm(
                n, a, args.port + len(servers) + len(peers) + i, Path(args.vllm_model), model, args.max_batch,
                args.max_prompt_tokens + args.max_tokens + 64, log_dir, args.threads))
        if args.matmul_peak:  # with every server up and idle: the cores' peak in this run, for the compute table
            peaks.append(matmul_peak_gflops())
        for ds in datasets:
            for c in levels:
                n_prompts = max(args.min_prompts, args.waves * c)
                pool = (prompts[ds] * (n_prompts // len(prompts[ds]) + 1))[:n_prompts]

                def run(n: str) -> dict:
                    r = asyncio.run(run_level(urls[n], model, pool, c, args.max_tokens))
                    print(f"{ds:>10} c={c:<3} {n:>20}: {r.output_tokens_per_s:7.1f} tok/s  failed {r.failed}  "
                          f"accept {r.accept_len_mean}  verify {r.verify_len_mean}", flush=True)
                    return asdict(r)

                results = measure_cell(names, run, args.rounds, args.warmup)
                cells.append({"dataset": ds, "concurrency": c, "num_prompts": n_prompts,
                              "prompt_tokens": sum(map(size, pool)), "results": results})
                _write(out, args, names, servers, peer_cmds, cells, peaks, config)  # partial results survive an interruption
        if args.matmul_peak:
            peaks.append(matmul_peak_gflops())
    _write(out, args, names, servers, peer_cmds, cells, peaks, config)
    plot_sweep(cells, names, beside(out, ".png"))
    print(f"wrote {beside(out, '.json')}, {beside(out, '.md')}, {beside(out, '.png')}")
    return 0 if all(r["failed"] == 0 for c in cells for r in c["results"].values()) else 1


def _write(out: Path, args: argparse.Namespace, names: list[str], servers, peers: dict[str, list[str]],
           cells: list[dict], peaks: list[float], config: TransformerConfig | None) -> None:
    compute = compute_table(cells, names, config, peaks) if peaks and config is not None else None
    meta = {"command": "adaflash " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
            "servers": {n: a for n, a in servers}, "peers": peers, "baseline": names[0],
            "max_batch": args.max_batch, "max_tokens": args.max_tokens,
            "threads_per_server": args.threads or "torch default",
            **({"matmul_peak_gflops": peaks} if peaks else {})}
    report = {**meta, "cells": cells, **({"compute": compute[0]} if compute else {})}
    warmup = f" after {args.warmup} untimed run(s) of each" if args.warmup else ""
    markdown = (
        f"# Serving sweep\n\n`{meta['command']}`\n\nMachine: {meta['machine']}. Greedy, streaming chat completions, "
        f"{args.max_tokens} max tokens, max batch {args.max_batch}; each cell runs the servers one after another on "
        f"the same prompts, {args.rounds} round(s){warmup}. Ratios are against `{names[0]}`, which runs before every round "
        f"and after the last: a ratio is the median over rounds of a server's throughput over the mean of the two "
        f"baseline runs around it (with several rounds, their range in brackets); throughputs are medians over runs, "
        f"every run in the JSON.\n\n" + sweep_table(cells, names) + (compute[1] if compute else ""))
    write_report(out, report, markdown)


def compute_table(cells: list[dict], names: list[str], config: TransformerConfig,
                  peaks: list[float]) -> tuple[list[dict], str]:
    """Each server's achieved matmul GFLOP/s per cell - its output tokens alone, and with the prompts it prefilled -
    against the fp32 matmul peak measured in the same run (the higher of the measurements before and after the
    cells: the conservative fraction). Rows for the JSON, and the markdown section."""
    peak = max(peaks)
    rows, table = [], []  # the JSON's rows, the markdown's
    for cell in cells:
        for n in names:
            r = cell["results"][n]
            output_tokens = r["output_tokens_per_s"] * r["duration_s"]
            if not output_tokens:
                continue
            g = served_gflops(config, r["output_tokens_per_s"], cell["prompt_tokens"] / output_tokens)
            row = {"dataset": cell["dataset"], "concurrency": cell["concurrency"], "server": n, **g,
                   "output_fraction_of_peak": g["output_gflops"] / peak,
                   "with_prompts_fraction_of_peak": g["with_prompts_gflops"] / peak}
            rows.append(row)
            table.append([row["dataset"], row["concurrency"], n, f"{r['output_tokens_per_s']:.1f}",
                          f"{g['output_gflops']:.1f} ({100 * row['output_fraction_of_peak']:.0f}%)",
                          f"{g['with_prompts_gflops']:.1f} ({100 * row['with_prompts_fraction_of_peak']:.0f}%)"])
    text = ("\n## Compute\n\nThe linears' matmul FLOPs served per second (2 per weight a token meets; attention left "
            "out): output tokens alone (the LM head included), and with the prompt tokens each cell prefilled, against "
            f"the fp32 matmul peak measured in this run with the servers idle "
            f"({', '.join(f'{p:.1f}' for p in peaks)} GFLOP/s "
            f"before / after the cells; the higher, {peak:.1f}, is the yardstick). The prompt share uses each server's "
            "first run's token count.\n\n"
            + markdown_table(["dataset", "concurrency", "server", "output tok/s", "output GFLOP/s (of peak)",
                              "with prompts GFLOP/s (of peak)"], table) + "\n")
    return rows, text


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "bench", help="benchmarks").add_parser(
        "sweep", help="start several servers and bench them side by side over datasets x concurrency")
    p.add_argument("--server", action="append", required=True,
                   help='NAME="adaflash serve args"; the first is the baseline unless --baseline names another')
    p.add_argument("--baseline", default=None, help="the server (ours or a peer) every ratio is against")
    p.add_argument("--peer", action="append", default=None,
                   help='NAME="llama-server args": a llama.cpp server from `make peer` beside ours (same GGUF unless -m)')
    p.add_argument("--peer-model", default=None, help="GGUF the peers load (default: --model's embedded GGUF)")
    p.add_argument("--vllm", action="append", default=None,
                   help='NAME="vLLM server args": vLLM\'s CPU build from `make peer-vllm` beside ours, serving --vllm-model')
    p.add_argument("--vllm-model", default=None, help="the HF target folder vLLM serves (`adaflash export vllm` OUT/target)")
    p.add_argument("--datasets", default="gsm8k,mt-bench", help=f"eval prompt sets; {SIX_MIX} = the six benchmarks interleaved")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="leave out longer prompts (tokenised for --model)")
    p.add_argument("--model", default="smollm2-135m", help="tokenizer for --max-prompt-tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--waves", type=int, default=2, help="prompts per level = max(--min-prompts, waves x concurrency)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every server this many times per cell, the baseline between rounds: ratios are medians "
                   "over rounds (on a machine whose speed drifts, 3 or more)")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed runs of every server per cell before the rounds (the steady state of a long-running "
                   "server: prompt prefixes to reuse, drafting checks past their opening)")
    p.add_argument("--port", type=int, default=8310, help="first server's port; the others follow")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per server (pin to 1 when other work shares the machine: OpenMP stalls under contention)")
    p.add_argument("--log-dir", default="runs/logs/sweep", help="server logs")
    p.add_argument("--record-trace", default=None, metavar="DIR",
                   help="each of our servers records its verification trace to DIR/NAME (`serve --record-trace`): "
                   "what `bench simulate --drafter trace:DIR/NAME` replays")
    p.add_argument("--matmul-peak", action=argparse.BooleanOptionalAction, default=True,
                   help="time an fp32 matmul with the servers idle, before and after the cells, and report each "
                   "server's achieved GFLOP/s against it (--no-matmul-peak: skip)")
    p.add_argument("--out", required=True, help="path stem for .json, .md and .png")
    p.set_defaults(func=_cmd)
