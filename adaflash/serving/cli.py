"""`adaflash serve`: the OpenAI-compatible server on one machine."""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

from adaflash.cli_args import add_model_args
from adaflash.pipeline import METHODS


def build_runner(args: argparse.Namespace):
    """Pipeline -> Engine (with its length policy) -> EngineRunner, from the parsed `serve` arguments."""
    from adaflash.pipeline import Pipeline
    from adaflash.serving.engine import Engine
    from adaflash.serving.length_policy import build_length_policy, cost_model_for
    from adaflash.serving.runner import EngineRunner

    from adaflash.models.drafter_checkpoint import latest_version
    from adaflash.models.registry import resolve_drafter

    if args.method == "ar" and args.length_policy is not None:
        raise ValueError("--length-policy applies to --method dflash or adaflash only")
    spec = args.length_policy or ("adaflash" if args.method == "adaflash" else "throughput")
    # Check a bad policy before the (slow) model load; cost-model policies need the loaded models to profile.
    needs_cost = spec in ("throughput", "adaflash")
    policy = build_length_policy(spec) if args.method != "ar" and not needs_cost and spec != "block-head" else None
    # With --watch-versions the newest published version, if any, is what serves first.
    published = latest_version(args.watch_versions) if args.watch_versions and args.method != "ar" else None
    drafter = str(published) if published else resolve_drafter(args.model, args.drafter, args.method)
    pipeline = Pipeline.load(args.model, drafter, args.dtype)
    make_policy = None
    if pipeline.proposer is not None and policy is None:
        cost = None
        if needs_cost:
            print("adaflash serve: loading or profiling the cost model (once per machine)", file=sys.stderr, flush=True)
            # The largest verify pass: every slot's anchor plus a full block of drafts.
            cost = cost_model_for(pipeline, max_tokens=args.max_batch * pipeline.proposer.block_size)
        make_policy = lambda head: build_length_policy(spec, cost, head)  # noqa: E731 (also for hot swaps)
        policy = make_policy(pipeline.length_head)
    # Positions past the model's trained range would decode garbage, not fail: never cache that far.
    max_len = min(args.max_len, pipeline.target.config.max_position_embeddings)
    recorder = None
    if args.record:
        from adaflash.serving.recorder import TrajectoryRecorder

        recorder = TrajectoryRecorder(args.record, drafter_version=Path(drafter).name if drafter else "",
                                      record_outcomes=pipeline.proposer is not None)
    engine = Engine(pipeline.target, pipeline.proposer, policy, max_batch=args.max_batch,
                    max_queue=args.max_queue, max_len=max_len, recorder=recorder)
    runner = EngineRunner(engine)
    watcher = None
    if args.watch_versions and args.method != "ar":
        from adaflash.serving.hot_swap import VersionWatcher

        watcher = VersionWatcher(runner, args.watch_versions, make_policy or (lambda head: policy), Path(drafter))
    return pipeline, runner, watcher


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from adaflash.serving.server import create_app

    pipeline, runner, watcher = build_runner(args)
    name = args.served_model_name or args.model
    policy = runner.engine.policy.name if args.method != "ar" else "none (autoregressive)"
    print(f"adaflash serve: model {name!r}, method {args.method}, length policy {policy}, "
          f"max batch {args.max_batch}, queue {args.max_queue}, context {runner.context_tokens} tokens, "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    app = create_app(runner, pipeline.tokenizer, name)
    with runner:
        if watcher is not None:
            watcher.start()
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
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
    add_model_args(p, length_policy_default="throughput for dflash, adaflash for adaflash")  # --model, --drafter, --dtype, --length-policy
    p.add_argument("--method", choices=METHODS, default="dflash",
                   help="dflash (default), adaflash (drafter + its length head + adaflash policy) or ar (plain "
                   "decoding); the speculative ones use --drafter or the drafter shipped for the target")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s")
    p.add_argument("--max-len", type=int, default=2048,
                   help="KV cache length per slot: prompt + output + drafts (at most the model's positions)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    p.add_argument("--watch-versions", default=None, metavar="DIR",
                   help="serve DIR's LATEST drafter version and hot-swap each newly published one between steps")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="on-policy buffer: append finished requests to DIR/trajectories.jsonl and verification "
                   "outcomes to DIR/outcomes-*.safetensors (the data of `train distill` and `train length-head`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)
