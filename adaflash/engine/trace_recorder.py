"""A verification trace of what the engine serves (`--record-trace DIR`): per finished request its prompt, output and,
for every target pass, the drafter's whole block, the drafts verified, the accept length and the learned head's
prediction, appended to DIR/traces.jsonl (formats/traces.py) as the request finishes.

It is the engine's recorder (beside `TrajectoryRecorder`, both behind `Recorders` when both are asked for), hooked
where that one is: the drafter source hands it each step's whole blocks (`on_blocks`, since it `wants_blocks`) and the
engine each finished request (`on_finish`). The counts come from the request itself (`accept_lengths`,
`draft_lengths`: one entry a target pass), so a step with no block (a plain decode, a prompt-lookup draft) is recorded
too. The head's prediction is what the learned policy left in the request's policy state that step
(`length_policy.HEAD_SURVIVAL`), taken as the block is recorded, so it is never read twice. Called only on the engine
thread.

What recording changes: the drafter drafts every drafting request's whole block (an LM head over block size - 1 rows,
not k) from block hidden states of the whole width (as `--record` also does; without a recorder a proposal is only as
wide as its longest draft). Greedy outputs are the target's own either way; sampled ones keep the target's law but
not the same draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from adaflash.engine.request import Request
from adaflash.formats.traces import TRACE_FILE, TraceRecord, TraceStep, append_traces
from adaflash.speculative.length_policy import HEAD_SURVIVAL


class TraceRecorder:
    wants_blocks = True

    def __init__(self, out_dir: str | Path, block_size: int, drafter_version: str = "", source: str = "") -> None:
        """`block_size`: the drafter's (1 where the engine has none: its steps carry no block)."""
        self.path = Path(out_dir) / TRACE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.block_size, self.drafter_version, self.source = block_size, drafter_version, source
        # id(request) -> (the request, held so its id is not reused; its pass index -> (block, head))
        self._open: dict[int, tuple[Request, dict[int, tuple[tuple[int, ...], tuple[float, ...]]]]] = {}
        self.num_records = 0

    def on_step(self, hidden, drafted, accepted) -> None:
        pass  # the blocks' hidden states and outcomes are TrajectoryRecorder's

    def on_blocks(self, blocks: Sequence[tuple[Request, tuple[int, ...]]]) -> None:
        """The whole blocks the drafter ran this step, after the step committed (so each request's last
        `accept_lengths` entry is this pass's)."""
        for request, block in blocks:
            head = request.policy_state.pop(HEAD_SURVIVAL, ())
            steps = self._open.setdefault(id(request), (request, {}))[1]
            steps[len(request.accept_lengths) - 1] = (tuple(block), tuple(float(x) for x in head))

    def on_finish(self, request: Request) -> None:
        _, blocks = self._open.pop(id(request), (request, {}))
        for key in [k for k, (r, _) in self._open.items() if r.finish_reason == "abort"]:  # aborted: never finish
            del self._open[key]
        if request.finish_reason == "abort" or not request.output_ids:
            return
        steps, anchor = [], 0  # a pass anchors at the output index its request had reached
        for j, (verified, accepted) in enumerate(zip(request.draft_lengths, request.accept_lengths)):
            block, head = blocks.get(j, ((), ()))
            steps.append(TraceStep(anchor, verified, accepted, block, head))
            anchor += accepted
        append_traces(self.path, [TraceRecord(
            tuple(request.prompt_ids), tuple(request.output_ids), request.max_new_tokens, self.block_size,
            tuple(steps), tuple(request.stop_token_ids), request.finish_reason, request.sampling.greedy,
            self.drafter_version, self.source)])
        self.num_records += 1

    def flush(self) -> None:
        pass  # every record is on disk when its request finishes
