"""On-policy trajectories: what the serving system actually generated, as token ids.

The serving engine (target + current drafter, on the prompts it actually sees) appends one JSON line per
finished request; distillation trains on these. Only token ids are kept: the trainer re-runs the target
on each trajectory to get the drafter's context features and the teacher logits (teacher forcing), so a
buffer stays small and never goes stale when the capture layers change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from adaflash.formats.json_lines import append_lines, read_lines

TRAJECTORY_GLOB = "*.jsonl"


@dataclass(frozen=True)
class Trajectory:
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    source: str = ""  # dataset or endpoint the prompt came from
    drafter_version: str = ""  # which drafter was serving when it was generated
    accept_lengths: tuple[int, ...] = field(default=())  # tokens committed per target pass

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


def append_trajectories(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Append as JSON lines, flushed to disk (a crash loses at most the line being written)."""
    return append_lines(path, (asdict(t) for t in trajectories))


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.rglob(TRAJECTORY_GLOB))  # a buffer of rounds: one subdirectory each
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no trajectories at {path}")


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """One JSONL file or every *.jsonl under a directory. A torn last line (killed writer) is skipped; any other
    bad line is an error naming the file and line."""
    return read_lines(_files(Path(path)), _trajectory, "a trajectory record")


def _trajectory(d: dict) -> Trajectory:
    return Trajectory(
        prompt_ids=tuple(int(t) for t in d["prompt_ids"]), output_ids=tuple(int(t) for t in d["output_ids"]),
        source=str(d.get("source", "")), drafter_version=str(d.get("drafter_version", "")),
        accept_lengths=tuple(int(a) for a in d.get("accept_lengths", ())),
    )
