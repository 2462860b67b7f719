"""Append-only JSON-lines files, as the recorders write them and training and the simulator read them back.

A writer appends whole lines and flushes them to disk, so a killed writer leaves at most its last line torn: the
reader skips a torn last line and names the file and line of any other it cannot parse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")


def append_lines(path: str | Path, objects: Iterable[Any]) -> int:
    """Append each object as one JSON line, flushed to disk (a crash loses at most the line being written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a") as f:
        for obj in objects:
            f.write(json.dumps(obj) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def read_lines(files: Iterable[Path], parse: Callable[[Any], T], what: str) -> list[T]:
    """`parse(obj)` of every line of `files`; a torn last line is skipped, any other bad line is a ValueError naming
    the file and line (`what` says what the line should have been)."""
    out: list[T] = []
    for file in files:
        lines = file.read_text().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(parse(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                if lineno == len(lines) and not line.endswith("}"):
                    continue  # torn final line from an interrupted append
                raise ValueError(f"{file}:{lineno}: not {what} ({exc})") from exc
    return out
