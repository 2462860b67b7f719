"""The on-policy buffer: what the serving engine generated and how its drafts fared, written as it serves.

`Engine(recorder=TrajectoryRecorder(dir))` appends every finished request to `trajectories.jsonl` (token
ids; the distillation data) and every verified draft block to `outcomes-NNNNN.safetensors` (the drafter's
detached block hidden states, drafted and accepted counts: the length head's data). Called only on the
engine thread. A verification trace (`--record-trace`, the simulator's replay) is `TraceRecorder`'s
(trace_recorder.py); `Recorders` puts several behind the engine's one recorder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaflash.engine.request import Request
from adaflash.formats.outcomes import Outcomes, save_outcomes
from adaflash.formats.trajectories import Trajectory, append_trajectories

TRAJECTORIES_FILE = "trajectories.jsonl"


class TrajectoryRecorder:
    wants_blocks = False  # the drafter's whole blocks are the trace recorder's (engine/trace_recorder.py)

    def __init__(self, out_dir: str | Path, drafter_version: str = "", source: str = "",
                 outcomes_per_shard: int = 2048, record_outcomes: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.drafter_version, self.source = drafter_version, source
        self.outcomes_per_shard, self.record_outcomes = outcomes_per_shard, record_outcomes
        self._hidden: list[torch.Tensor] = []
        self._drafted: list[int] = []
        self._accepted: list[int] = []
        self.num_trajectories = 0
        self._shard = len(list(self.out_dir.glob("outcomes-*.safetensors")))  # resume numbering

    def on_step(self, hidden: torch.Tensor, drafted: list[int], accepted: list[int]) -> None:
        """hidden [n, B, d] of the requests that drafted this step, with their verification outcomes."""
        if not self.record_outcomes:
            return
        self._hidden.append(hidden.detach().to(torch.bfloat16).clone())
        self._drafted += drafted
        self._accepted += accepted
        if len(self._drafted) >= self.outcomes_per_shard:
            self.flush()

    def on_finish(self, request: Request) -> None:
        if request.finish_reason == "abort" or not request.output_ids:
            return
        append_trajectories(self.out_dir / TRAJECTORIES_FILE, [Trajectory(
            tuple(request.prompt_ids), tuple(request.output_ids), source=self.source,
            drafter_version=self.drafter_version, accept_lengths=tuple(request.accept_lengths),
        )])
        self.num_trajectories += 1

    def flush(self) -> Path | None:
        """Write the buffered outcomes as one shard (atomic); None when there is nothing to write."""
        if not self._drafted:
            return None
        path = self.out_dir / f"outcomes-{self._shard:05d}.safetensors"
        save_outcomes(path, Outcomes(torch.cat(self._hidden), torch.tensor(self._drafted), torch.tensor(self._accepted)))
        self._shard += 1
        self._hidden, self._drafted, self._accepted = [], [], []
        return path


class Recorders:
    """Several recorders as the engine's one (`--record` with `--record-trace`): each hears every call it takes."""

    def __init__(self, recorders) -> None:
        self.recorders = tuple(recorders)
        self.wants_blocks = any(r.wants_blocks for r in self.recorders)

    def on_step(self, hidden: torch.Tensor, drafted: list[int], accepted: list[int]) -> None:
        for r in self.recorders:
            r.on_step(hidden, drafted, accepted)

    def on_blocks(self, blocks) -> None:
        for r in self.recorders:
            if r.wants_blocks:
                r.on_blocks(blocks)

    def on_finish(self, request: Request) -> None:
        for r in self.recorders:
            r.on_finish(request)

    def flush(self) -> None:
        for r in self.recorders:
            r.flush()

    @property
    def drafter_version(self) -> str:
        return self.recorders[0].drafter_version

    @drafter_version.setter
    def drafter_version(self, version: str) -> None:  # a hot swap relabels what every recorder writes next
        for r in self.recorders:
            r.drafter_version = version
