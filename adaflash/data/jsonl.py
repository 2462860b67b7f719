"""User prompt files: one JSON object per line.

Each line is either `{"prompt": "..."}` (a single user turn) or `{"messages": [{"role": ..., "content":
...}, ...]}` (a transcript ending with a user turn), with optional `"id"` (default `<file stem>/<line>`),
`"domain"` (any label, e.g. "math", "code", "chat", "multilingual"; default "chat"), `"dataset"` (default the file stem) and
`"reference"`. Blank lines are skipped. Any problem raises `ValueError` naming the file and line.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from adaflash.data.prompt import Prompt, user_messages

DEFAULT_DOMAIN = "chat"


def _messages(obj: dict[str, Any]) -> tuple[dict[str, str], ...]:
    if "prompt" in obj and "messages" in obj:
        raise ValueError('give either "prompt" or "messages", not both')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError('"prompt" must be a non-empty string')
        return user_messages(obj["prompt"])
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list')
        if not all(isinstance(m, dict) and set(m) >= {"role", "content"} for m in messages):
            raise ValueError('every message needs "role" and "content"')
        return tuple({"role": m["role"], "content": m["content"]} for m in messages)
    raise ValueError('each line needs a "prompt" or a "messages" key')


def _prompt(obj: Any, stem: str, lineno: int) -> Prompt:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    reference = obj.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise ValueError('"reference" must be a string')
    return Prompt(  # Prompt validates roles, domain and that the transcript ends with a user turn
        id=str(obj.get("id", f"{stem}/{lineno}")),
        domain=obj.get("domain", DEFAULT_DOMAIN),
        dataset=str(obj.get("dataset", stem)),
        messages=_messages(obj),
        reference=reference,
    )


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """The prompts of a JSONL file, gzip-compressed where its name ends in .gz (a prepared set that travels)."""
    path = Path(path)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    opened = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with opened as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompt = _prompt(json.loads(line), path.stem, lineno)
                if prompt.id in seen:
                    raise ValueError(f"duplicate id {prompt.id!r}")
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{lineno}: {e}") from e
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts
