"""Verification traces: what a run drafted and verified, step by step, per finished request (`--record-trace DIR`).

The engine's trace recorder (engine/trace_recorder.py) appends one JSON line per finished request to
DIR/traces.jsonl, flushed to disk as it finishes; `adaflash bench simulate --drafter trace:DIR` replays them
(simulation/replay.py). A record holds the prompt, the target's output, how the request was run (its token budget,
stop tokens, greedy or not, the drafter's block size) and one entry per target pass after the prefill:

- `anchor`: the output index of the step's last committed token (the block drafts output indices anchor + 1 ...);
- `block`: the drafter's whole proposal at that anchor, block size - 1 token ids, before any length policy cut it
  (empty where the drafter ran no block for the request that step: a plain decode, a prompt-lookup draft);
- `verified`: the drafts the step verified; `accept_length`: the tokens the pass committed, the target's own
  included (as `Request.accept_lengths`: counted before a stop token or the budget cut the commit);
  (a run without a drafter records block size 1 and no blocks);
- `head`: the learned length head's per-position survival where one read the block that step, else empty.

Only token ids and counts are kept, so a trace is small and replays without the models that made it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from adaflash.formats.json_lines import append_lines, read_lines

TRACE_FILE = "traces.jsonl"


@dataclass(frozen=True)
class TraceStep:
    anchor: int
    verified: int
    accept_length: int
    block: tuple[int, ...] = ()
    head: tuple[float, ...] = ()

    def check(self, block_size: int) -> None:
        if self.anchor < 0 or self.verified < 0 or not 1 <= self.accept_length <= self.verified + 1:
            raise ValueError(f"step at anchor {self.anchor}: verified {self.verified} and accept length "
                             f"{self.accept_length} must satisfy 1 <= accept length <= verified + 1")
        if len(self.block) > block_size - 1 or len(self.head) > block_size - 1:
            raise ValueError(f"step at anchor {self.anchor}: a block of {block_size} holds at most {block_size - 1} "
                             f"drafts, got {len(self.block)} tokens and {len(self.head)} head values")


@dataclass(frozen=True)
class TraceRecord:
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    max_new_tokens: int
    block_size: int
    steps: tuple[TraceStep, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    finish_reason: str = "length"
    greedy: bool = True
    drafter_version: str = ""
    source: str = ""

    def check(self) -> None:
        if not self.prompt_ids or not self.output_ids:
            raise ValueError("empty prompt or output")
        if self.block_size < 1 or self.max_new_tokens < len(self.output_ids):
            raise ValueError(f"block size {self.block_size} < 1 or a budget of {self.max_new_tokens} below the "
                             f"{len(self.output_ids)} tokens output")
        for step in self.steps:
            step.check(self.block_size)
            if step.anchor >= len(self.output_ids):
                raise ValueError(f"step anchored at output index {step.anchor}, past the {len(self.output_ids)} "
                                 "tokens output")

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "steps"}
        d["steps"] = [{"anchor": s.anchor, "verified": s.verified, "accept_length": s.accept_length,
                       "block": list(s.block), "head": list(s.head)} for s in self.steps]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TraceRecord":
        steps = tuple(TraceStep(int(s["anchor"]), int(s["verified"]), int(s["accept_length"]),
                                tuple(int(t) for t in s.get("block", ())), tuple(float(x) for x in s.get("head", ())))
                      for s in d["steps"])
        record = cls(tuple(int(t) for t in d["prompt_ids"]), tuple(int(t) for t in d["output_ids"]),
                     int(d["max_new_tokens"]), int(d["block_size"]), steps,
                     tuple(int(t) for t in d.get("stop_token_ids", ())), str(d.get("finish_reason", "length")),
                     bool(d.get("greedy", True)), str(d.get("drafter_version", "")), str(d.get("source", "")))
        record.check()
        return record


def append_traces(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Append as JSON lines, flushed to disk (a crash loses at most the line being written)."""
    return append_lines(path, (r.as_dict() for r in records))


def trace_files(path: str | Path) -> list[Path]:
    """One JSONL file, or every traces.jsonl under a directory (a sweep writes one folder per server)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob(TRACE_FILE))
        if files:
            return files
    elif path.is_file():
        return [path]
    raise FileNotFoundError(f"no trace at {path} (expected {TRACE_FILE} in it or below it)")


def read_traces(path: str | Path) -> list[TraceRecord]:
    """Every record of a trace file or folder. A torn last line (a killed writer) is skipped; any other bad line is an
    error naming the file and line."""
    return read_lines(trace_files(path), TraceRecord.from_dict, "a trace record")
