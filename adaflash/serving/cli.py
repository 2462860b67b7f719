"""`adaflash serve`: the OpenAI-compatible server on one machine."""

from __future__ import annotations

import argparse
import sys

from adaflash.cli_args import add_model_args
from adaflash.pipeline import METHODS


def _drafter_for(args: argparse.Namespace) -> str | None:
    from adaflash.models.registry import shipped_drafter

    if args.method == "ar":
        return None
    if args.drafter is not None:
        return args.drafter
    shipped = shipped_drafter(args.model)
    if shipped is None:
        raise SystemExit(f"error: --method dflash needs --drafter PATH (no drafter ships for {args.model}); "
                         "or serve plain decoding with --method ar")
    return str(shipped)


def build_runner(args: argparse.Namespace):
    """Pipeline -> Engine (with its length policy) -> EngineRunner, from the parsed `serve` arguments."""
    from adaflash.pipeline import Pipeline
    from adaflash.serving.engine import Engine
    from adaflash.serving.length_policy import build_length_policy, cost_model_for
    from adaflash.serving.runner import EngineRunner

    if args.method == "ar" and args.length_policy is not None:
        raise ValueError("--length-policy applies to --method dflash only")
    spec = args.length_policy or "throughput"
    # Check a bad policy before the (slow) model load; throughput needs the loaded models to profile.
    policy = build_length_policy(spec) if args.method == "dflash" and spec != "throughput" else None
    pipeline = Pipeline.load(args.model, _drafter_for(args), args.dtype)
    if pipeline.proposer is not None and policy is None:
        print("adaflash serve: loading or profiling the cost model (once per machine)", file=sys.stderr, flush=True)
        # The largest verify pass: every slot's anchor plus a full block of drafts.
        cost = cost_model_for(pipeline, max_tokens=args.max_batch * pipeline.proposer.block_size)
        policy = build_length_policy(spec, cost)
    # Positions past the model's trained range would decode garbage, not fail: never cache that far.
    max_len = min(args.max_len, pipeline.target.config.max_position_embeddings)
    engine = Engine(pipeline.target, pipeline.proposer, policy, max_batch=args.max_batch,
                    max_queue=args.max_queue, max_len=max_len)
    return pipeline, EngineRunner(engine)


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from adaflash.serving.server import create_app

    pipeline, runner = build_runner(args)
    name = args.served_model_name or args.model
    policy = runner.engine.policy.name if args.method == "dflash" else "none (autoregressive)"
    print(f"adaflash serve: model {name!r}, method {args.method}, length policy {policy}, "
          f"max batch {args.max_batch}, queue {args.max_queue}, context {runner.context_tokens} tokens, "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    app = create_app(runner, pipeline.tokenizer, name)
    with runner:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def register_cli(subparsers) -> None:
    """Add `serve` to the top-level subparsers of the adaflash CLI."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (continuous batching, speculative decoding)",
        description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "With --method dflash the length policy defaults to throughput (its cost model is profiled once per "
        "machine and cached under the adaflash cache).",
    )
    add_model_args(p, length_policy_default="throughput")  # --model, --drafter, --dtype, --length-policy
    p.add_argument("--method", choices=METHODS, default="dflash",
                   help="dflash (default; needs --drafter or a shipped drafter) or ar (plain decoding)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s")
    p.add_argument("--max-len", type=int, default=2048,
                   help="KV cache length per slot: prompt + output + drafts (at most the model's positions)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)
