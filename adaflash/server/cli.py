"""`adaflash serve`: the OpenAI-compatible server on one machine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import sys
from typing import TYPE_CHECKING

from adaflash.cli_args import add_model_args, add_prompt_lookup_arg
from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE
from adaflash.speculative.config import METHODS, SpeculativeConfig, draft_model_of

if TYPE_CHECKING:
    from adaflash.engine.engine_factory import EngineConfig


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the parsed `serve` arguments, checked before the (slow) model load."""
    from adaflash.engine.engine_factory import EngineConfig

    return EngineConfig(SpeculativeConfig.parse(args), max_batch=args.max_batch, max_queue=args.max_queue,
                        max_len=args.max_len, record_dir=args.record, max_prefill_tokens=args.max_prefill_tokens,
                        trace_dir=args.record_trace, kv_dtype=args.kv_dtype, kv_memory_gib=args.kv_memory,
                        kv_block_size=args.kv_block_size)


def build_runner(args: argparse.Namespace, config: EngineConfig | None = None):
    """(pipeline, runner, watcher) from the parsed `serve` arguments (and their `engine_config`, if made already):
    models loaded and the engine built on the engine thread, which is running (EngineRunner.launch: one thread does
    all the compute); the watcher not started."""
    from adaflash.engine.engine_factory import build_engine, length_policy_factory
    from adaflash.engine.runner import EngineRunner
    from adaflash.models.drafters.checkpoint import latest_version
    from adaflash.models.targets.registry import resolve_drafter
    from adaflash.pipeline import Pipeline

    config = config or engine_config(args)
    drafts = config.speculative.uses_drafter
    # With --watch-versions the newest published version, if any, is what serves first.
    published = latest_version(args.watch_versions) if args.watch_versions and drafts else None
    drafter = None  # plain decoding loads none, even if --drafter names one
    draft_model = draft_model_of(args, config.speculative)
    if draft_model and args.watch_versions:
        raise ValueError("--watch-versions hot-swaps DFlash drafters; a --draft-model is not swapped")
    if drafts and not draft_model:
        drafter = str(published) if published else resolve_drafter(args.model, args.drafter, config.speculative.drafter)

    def build():
        pipeline = Pipeline.load(args.model, drafter, args.dtype, draft_vocab=args.draft_vocab, draft_model=draft_model,
                                 draft_max=args.draft_max)
        models = pipeline.engine_models(drafter_version=Path(drafter).name if drafter else (draft_model or ""))
        if config.needs_cost_model:
            print("adaflash serve: loading or profiling the cost model (once per machine)", file=sys.stderr, flush=True)
        policies = length_policy_factory(config, models)  # also what each hot-swapped drafter's policy comes from
        policy, checks = (policies(models.length_head), policies.checks) if policies else (None, None)
        return build_engine(config, models, policy, checks), (pipeline, policies)

    runner, (pipeline, policies) = EngineRunner.launch(build)
    watcher = None
    if args.watch_versions and drafter:
        from adaflash.engine.hot_swap import VersionWatcher

        watcher = VersionWatcher(runner, args.watch_versions, policies, Path(drafter), draft_vocab=args.draft_vocab)
    return pipeline, runner, watcher


def server_config(args: argparse.Namespace):
    """The HTTP layer's settings (checked before the slow model load); the key from --api-key or the env."""
    from adaflash.server.gate import API_KEY_ENV, ServerConfig

    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    return ServerConfig(api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, metrics_open=args.metrics_open,
                        request_timeout_s=args.request_timeout)


def build_app(args: argparse.Namespace):
    """(app, runner, watcher) from the parsed `serve` arguments: the runner and watcher not started yet."""
    from adaflash.server.server import create_app

    config, engine = server_config(args), engine_config(args)
    method = engine.speculative.name  # as the user named it: the label of /metrics and the startup line
    pipeline, runner, watcher = build_runner(args, engine)
    app = create_app(runner, pipeline.tokenizer, args.served_model_name or args.model, config=config, method=method)
    if watcher is not None:
        metrics = app.state.metrics

        def on_hot_swap(swapped: bool) -> None:  # the label follows the policy the new version runs
            metrics.observe_hot_swap(swapped)
            metrics.set_length_policy(runner.snapshot.policy_name, method)

        watcher.observer = on_hot_swap
    app.state.watcher, app.state.speculative = watcher, engine.speculative
    return app, runner, watcher


def _describe(args: argparse.Namespace, app, runner) -> str:
    """The startup line (the key itself never appears in it, nor anywhere else in the output)."""
    config, speculative = app.state.config, app.state.speculative
    policy = runner.snapshot.policy_name if speculative.uses_drafter else "none (autoregressive)"
    lookup = speculative.prompt_lookup
    if lookup is not None:
        sized = "sized by throughput" if lookup.length == "throughput" else "all verified"
        policy += f", prompt lookup up to {lookup.num_tokens} tokens ({sized})"
    auth = "bearer key required" + (" (/metrics open)" if config.metrics_open else " (also /metrics)") \
        if config.api_key else "none"
    timeout = f"{config.request_timeout_s:g} s" if config.request_timeout_s else "none"
    return (f"adaflash serve: model {args.served_model_name or args.model!r}, method {speculative.name}, length policy "
            f"{policy}, max batch {args.max_batch}, queue {args.max_queue}, context {runner.context_tokens} tokens, "
            f"auth {auth}, request timeout {timeout}, drain {args.drain_timeout:g} s, http://{args.host}:{args.port}/v1")


def _cmd_serve(args: argparse.Namespace) -> int:
    from adaflash.server import shutdown

    app, runner, watcher = build_app(args)
    print(_describe(args, app, runner), file=sys.stderr, flush=True)
    if app.state.config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"adaflash serve: warning: listening on {args.host} without an API key: anyone who can reach the port "
              "can use this server (set ADAFLASH_API_KEY or --api-key)", file=sys.stderr, flush=True)
    with runner:
        if watcher is not None:
            watcher.start()
        try:
            shutdown.serve(app, app.state.admission, host=args.host, port=args.port, log_level=args.log_level,
                           drain_timeout_s=args.drain_timeout)
        finally:
            if watcher is not None:
                watcher.stop()
    if runner.engine.recorder is not None:
        runner.engine.recorder.flush()  # the engine thread has stopped: the last outcomes shard is safe to write
    return 0


def register_cli(subparsers) -> None:
    """Add `serve` to the top-level subparsers of the adaflash CLI."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (continuous batching, speculative decoding)",
        description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "With --method dflash the length policy defaults to throughput (its cost model is profiled once per "
        "machine and cached under the adaflash cache).",
    )
    engines = [SpeculativeConfig.of(method) for method in METHODS]
    defaults = ", ".join(f"{c.engine_policy} for {c.name}" for c in engines if c.engine_policy is not None)
    add_model_args(p, length_policy_default=defaults)  # --model, --drafter, --dtype, --length-policy
    add_prompt_lookup_arg(p)
    p.add_argument("--method", choices=METHODS, default="dflash",
                   help="dflash (default), adaflash (dflash with the AdaFlash drafter and its length head under the "
                   "adaflash length policy) or ar (plain decoding); the speculative ones use --drafter or the drafter "
                   "shipped for the target")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s")
    p.add_argument("--max-len", type=int, default=2048,
                   help="KV cache length per slot: prompt + output + drafts (at most the model's positions)")
    p.add_argument("--kv-dtype", choices=("auto", "fp32", "fp16", "bf16", "int8"), default="auto",
                   help="what the KV cache stores (llama.cpp's -ctk/-ctv): auto is the model's dtype, fp16 for "
                   "--dtype int8; int8 keeps a scale per head row (q8_0-like); a narrower cache holds more tokens and "
                   "streams less, and changes the numbers a little (greedy output equals plain decoding's at the same "
                   "setting)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="the KV cache pool's size: its blocks are shared by all requests and taken as they grow; a "
                   "request waits in the queue until the pool can hold its prompt and max_tokens (default: every "
                   "slot's --max-len, at most half the memory free after loading; untouched blocks cost no memory)")
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="positions a KV cache block holds (a power of two >= 8); prompt prefixes are shared in whole "
                   "blocks")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens one prefill pass takes at most: admitted prompts are prefilled in passes of up "
                   "to this many (vLLM's --max-num-batched-tokens for prompts)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    p.add_argument("--watch-versions", default=None, metavar="DIR",
                   help="serve DIR's LATEST drafter version and hot-swap each newly published one between steps")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="on-policy buffer: append finished requests to DIR/trajectories.jsonl and verification "
                   "outcomes to DIR/outcomes-*.safetensors (the data of `train distill` and `train length-head`)")
    p.add_argument("--record-trace", default=None, metavar="DIR",
                   help="append each finished request's verification trace to DIR/traces.jsonl: prompt and output ids "
                   "and, per step, the drafter's whole block, drafts verified, accept length and the length head's "
                   "prediction (what `bench simulate --drafter trace:DIR` replays)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1 request (and /metrics unless --metrics-open); "
                   "default: the ADAFLASH_API_KEY environment variable, which is better than this flag (a command line "
                   "is visible to every user of the machine)")
    p.add_argument("--metrics-open", action="store_true",
                   help="with an API key, serve /metrics without it (for a scraper on a trusted network); /health is "
                   "always open")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="per-request deadline from admission: a request still running is aborted in the engine (its "
                   "slot freed) and answered 504 request_timeout (a stream ends with that error). Default: none")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C: refuse new requests (503) and let running ones finish for up to this "
                   "long, then abort the rest and exit 0 (default 30)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)
