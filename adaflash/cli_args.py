"""Argument helpers shared by the CLI's command modules (so each subsystem can register its own commands)."""

from __future__ import annotations

import argparse

from adaflash.models.targets.registry import DEFAULT_TARGET
from adaflash.speculative.prompt_lookup import LOOKUP_LENGTHS


# --length-policy's default where a pipeline runs (a serving engine defaults to a policy: `serve`'s help says which).
REFERENCE_LOOP_DEFAULT = "the reference loop with --draft-length"
WITH_ADAFLASH_DEFAULT = f"{REFERENCE_LOOP_DEFAULT}; adaflash for --method adaflash"


def add_model_args(p: argparse.ArgumentParser, length_policy_default: str = REFERENCE_LOOP_DEFAULT) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, help=f"registry name or HF checkpoint dir (default {DEFAULT_TARGET})")
    p.add_argument("--drafter", default=None, help="DFlash drafter checkpoint dir (default: the shipped one, if any)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="an autoregressive draft model of the target's tokenizer drafts instead of a DFlash drafter "
                   "(registry name, GGUF or HF dir; llama.cpp's -md), in --dtype; e.g. qwen2.5-coder-0.5b for the 1.5B")
    p.add_argument("--draft-max", type=int, default=4, metavar="K",
                   help="with --draft-model: the most tokens it drafts a step (default 4; llama.cpp's --draft-max)")
    p.add_argument("--draft-vocab", default=None, metavar="K|full",
                   help="use only the K most frequent ids of the drafter's trimmed vocabulary, or 'full' to ignore it")
    p.add_argument("--dtype", default="auto", help="auto (on a CPU: fp32 where our kernels run, else bf16 if native; "
                   "bf16 on accelerators), bf16, fp32, or int8 (fp32, but the GGUF target's Q4_1/Q8_0 linears take "
                   "int8-rounded inputs, llama.cpp's arithmetic: a faster, slightly different model)")
    p.add_argument(
        "--length-policy", default=None,
        help="draft length per step: fixed:K, heuristic, throughput (profiled cost model, corrected by measured step "
        "times), throughput-profiled (the profile alone), adaflash (cost model + the "
        "drafter's per-position acceptance head), block-head (the paper's block-level head), ema-budget (SGLang's: one "
        "length a step from an EMA of acceptance) or adaflash-gated (adaflash only above 48 requests, else the whole "
        f"block, as the AdaFlash release runs); default: {length_policy_default}",
    )


def add_prompt_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help="prompt-lookup (n-gram) drafts first, up to K tokens a step (transformers' prompt_lookup_num_tokens, "
                   "vLLM's ngram): a request whose last 2-3 tokens occurred earlier verifies what followed them; the "
                   "others draft with the drafter (with --method ar: decode one token)")
    # Default None, read as PromptLookup's own default (throughput): so a length given without --prompt-lookup is
    # refused (speculative/config.py), not ignored.
    p.add_argument("--prompt-lookup-length", choices=LOOKUP_LENGTHS, default=None,
                   help="with --prompt-lookup: how many of a match's drafts a step verifies: throughput (default: as many "
                   "as pay for their verify cost, from each request's running lookup acceptance and the profiled cost "
                   "model; under load they shrink) or all (transformers' and vLLM's behaviour)")


def add_policy_state_arg(p: argparse.ArgumentParser) -> None:
    """For commands that run many prompts one by one (not `serve`: its engine always carries what it learned)."""
    p.add_argument("--carry-policy-state", action="store_true",
                   help="let a learning length policy carry what it learned from one prompt to the next, as a server "
                   "does (default: each prompt starts from the policy's prior, so results do not depend on prompt order)")


def command_group(subparsers, name: str, help: str):
    """The nested subparsers of top-level command `name`, created on first use so several modules can add to it."""
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, help=help)
        parser._adaflash_subcommands = parser.add_subparsers(dest=f"{name}_command", required=True)
    return parser._adaflash_subcommands


DEVICE_HELP = ("where the models run: auto (default: CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N "
               "(default $ADAFLASH_DEVICE, else auto); bf16 by default on CUDA")


def add_device_arg(p: argparse.ArgumentParser, top_level: bool = False) -> None:
    """--device on the top-level parser and on each command that runs a model (a command's own wins)."""
    p.add_argument("--device", default=None if top_level else argparse.SUPPRESS, help=DEVICE_HELP)


def configure_process(threads: int | None, device: str | None = None) -> int:
    """The compute set-up every command runs with: the device (--device, else $ADAFLASH_DEVICE, else auto: the one
    device decision, models/device/placement.py), threads (--threads, else $ADAFLASH_THREADS, else torch's default, one per
    core) and the allocator (large freed buffers kept, models/device/memory.py). Returns the threads in force."""
    import os

    import torch

    from adaflash.models.device.memory import keep_freed_buffers
    from adaflash.models.device.placement import use_device

    use_device(device)
    keep_freed_buffers()

    if threads is None and os.environ.get("ADAFLASH_THREADS"):
        try:
            threads = int(os.environ["ADAFLASH_THREADS"])
        except ValueError:
            raise ValueError(f"ADAFLASH_THREADS must be a whole number, got {os.environ['ADAFLASH_THREADS']!r}") from None
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
