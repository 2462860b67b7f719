"""Held-out-style prompts as token ids (our chat template, our tokenizer) for the vLLM scripts (vllm_offline.py,
vllm_step_cost.py), so vLLM and our runtime see the same inputs: the first `--per-set` eval-split prompts of each set
that fit in `--max-prompt-tokens`.

    .venv/bin/python benchmarks/peers/vllm_prompts.py --out runs/vllm/prompts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaflash.data import load_prompts
from adaflash.models.targets.registry import load_tokenizer, resolve_target
from adaflash.models.targets.text_codec import TextCodec

SETS = ("gsm8k", "humaneval", "mt-bench", "sharegpt-chat")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    codec = TextCodec(load_tokenizer(resolve_target(args.model)), eos_token_ids=())  # encoding only: no stop tokens
    chosen = []
    for name in args.sets.split(","):
        fitting = []
        for prompt in load_prompts(name, "eval", limit=4 * args.per_set):
            ids = codec.encode(messages=prompt.messages)
            if len(ids) <= args.max_prompt_tokens:
                fitting.append({"id": prompt.id, "dataset": name, "ids": list(ids)})
        chosen += fitting[: args.per_set]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(chosen))
    print(f"wrote {len(chosen)} prompts to {args.out}")


if __name__ == "__main__":
    main()
