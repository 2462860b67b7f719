"""CHAMP competition math problems (package `champ-dataset`, file `dataset_files/v0.json`).

270 problems in 5 categories (number theory, inequality, polynomial, sequence, combinatorics), with
final answers. Split by problem identifier: `splits.EVAL_FRACTION["champ"]` = 0.37 of the hash range
goes to eval (~100 problems), the rest to train. Both splits are returned in hash order, so a
`limit` takes a category mix rather than the first category of the file.

The 73 MB file (mostly model annotations we do not use) takes a second or two to parse, so the
extracted prompts are cached as JSONL (see `cache.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
from functools import lru_cache

from adaflash.data.cache import cached_package_prompts
from adaflash.data.prompt import Prompt, package_file, user_messages
from adaflash.data.splits import EVAL, EVAL_FRACTION, check_split, split_of

DIST = "champ-dataset"
PIP_SPEC = "champ-dataset==1.0.0"
_FILE = "champ_dataset/dataset_files/v0.json"
INSTRUCTION = "Solve the following math problem step by step. Put your final answer in \\boxed{}."


def _build() -> list[Prompt]:
    path = package_file(DIST, _FILE, PIP_SPEC)
    with path.open(encoding="utf-8") as f:
        problems = json.load(f)["problems"]
    return [
        Prompt(
            id=f"champ/{pid}",
            domain="math",
            dataset="champ",
            # `_text` is the problem with the dataset's `@@` math markers removed.
            messages=user_messages(f"{INSTRUCTION}\n\n{p['_text'].strip()}"),
            reference=p.get("_answer"),
        )
        for pid, p in problems.items()
    ]


@lru_cache(maxsize=1)
def _all_problems() -> tuple[Prompt, ...]:
    version = importlib.metadata.version(DIST)
    return cached_package_prompts(DIST, _FILE, PIP_SPEC, f"champ-{version}", "champ-order", _build)


def load_champ(split: str = EVAL) -> list[Prompt]:
    check_split(split, dataset="champ")
    return [p for p in _all_problems() if split_of(p.id, "champ", EVAL_FRACTION["champ"]) == split]
