"""The engine on its own thread: streams back to asyncio, commands between steps, refusals, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.engine.runner import EngineRunner, RunnerStoppedError, StepStats
from adaflash.engine.scheduler import QueueFullError
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.length_policy import FixedLength
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate

PROMPTS = [[3, 14, 15, 92], [65, 35], [89, 79, 32]]


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


@pytest.fixture(scope="module")
def proposer(target):
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=4)
    return DFlashProposer(init_drafter(cfg, seed=2), target)


async def _collect(runner: EngineRunner, request: Request) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for out in await runner.submit(request):
        tokens += out.new_token_ids
        reason = out.finish_reason
    return tokens, reason


def test_concurrent_streams_equal_the_reference(target, proposer):
    steps: list[StepStats] = []
    with EngineRunner(Engine(target, proposer, max_batch=2, max_len=64), observer=steps.append) as runner:
        async def main():
            return await asyncio.gather(*(_collect(runner, Request(f"r{i}", p, 9)) for i, p in enumerate(PROMPTS)))

        results = asyncio.run(main())
    for prompt, (tokens, reason) in zip(PROMPTS, results):
        assert tokens == autoregressive_generate(target, prompt, 9).token_ids and reason == "length"
    assert steps and all(s.running + s.free_slots == 2 for s in steps)
    assert sum(len(s.accept_lengths) for s in steps) > 0 and all(a >= 1 for s in steps for a in s.accept_lengths)


def test_call_runs_on_the_engine_thread_between_steps(target):
    with EngineRunner(Engine(target, None, max_batch=1, max_len=32)) as runner:
        assert runner.alive and runner.context_tokens == 31
        name = runner.call(lambda engine: (threading.current_thread().name, engine.max_len)).result(timeout=10)
        assert name == ("adaflash-engine", 32)
        with pytest.raises(ZeroDivisionError):
            runner.call(lambda engine: 1 / 0).result(timeout=10)
        assert runner.alive  # a failing command does not take the thread down


def test_the_snapshot_is_republished_before_a_command_returns(target, proposer):
    with EngineRunner(Engine(target, proposer, max_batch=2, max_len=64)) as runner:
        before = runner.snapshot
        assert (before.policy_name, before.max_draft, before.max_batch, before.speculative) == ("fixed:3", 3, 2, True)
        assert before.capture_layers == tuple(proposer.capture_layers) and runner.context_tokens == 64 - 3 - 1
        runner.call(lambda engine: setattr(engine, "policy", FixedLength(1))).result(timeout=10)
        assert runner.snapshot.policy_name == "fixed:1" and runner.snapshot.target is before.target
    assert not runner.alive


def test_refusals_reach_the_submitter(target):
    with EngineRunner(Engine(target, None, max_batch=1, max_queue=0, max_len=256)) as runner:
        async def main():
            with pytest.raises(ValueError, match="exceeds the context"):
                await runner.submit(Request("long", [1] * 200, 100))
            first = await runner.submit(Request("a", [5, 6], 250))  # holds the only slot
            with pytest.raises(QueueFullError):
                await runner.submit(Request("b", [5, 6], 2))
            with pytest.raises(ValueError, match="duplicate request id"):
                await runner.submit(Request("a", [5, 6], 2))
            first.close()  # aborts "a": its stream ends
            return first.finished

        assert asyncio.run(main())


def test_a_stopped_runner_refuses_work(target):
    runner = EngineRunner(Engine(target, None, max_batch=1, max_len=16))

    async def submit():
        await runner.submit(Request("x", [1, 2], 2))

    with pytest.raises(RunnerStoppedError):  # not started
        asyncio.run(submit())
    runner.start()
    runner.stop()
    with pytest.raises(RunnerStoppedError):
        asyncio.run(submit())
    with pytest.raises(RunnerStoppedError):
        runner.call(lambda engine: None)


def test_abort_ends_a_running_stream(target):
    with EngineRunner(Engine(target, None, max_batch=1, max_len=300)) as runner:
        async def main():
            stream = await runner.submit(Request("a", [5, 6, 7], 250))
            first = await stream.__anext__()
            runner.abort("a")
            reasons = [first.finish_reason]
            async for out in stream:
                reasons.append(out.finish_reason)
            return reasons

        reasons = asyncio.run(main())
    assert reasons[-1] in ("abort", "length")  # aborted unless it had already finished its 250 tokens
    assert reasons[-1] == "abort" or len(reasons) > 1


def test_launch_builds_and_steps_on_one_thread(tiny_checkpoints):
    """`launch` loads on the engine thread (one OpenMP pool for all the compute), starts it, returns build's extra."""
    threads: dict[str, int] = {}

    def build():
        threads["build"] = threading.get_ident()
        return Engine(load_target(tiny_checkpoints["qwen2"], dtype=torch.float32), None, max_batch=1, max_len=32), "x"

    runner, extra = EngineRunner.launch(build, observer=lambda stats: threads.setdefault("step", threading.get_ident()))
    with runner:
        assert extra == "x" and runner.alive
        got = asyncio.run(_collect(runner, Request("a", PROMPTS[0], 5)))
        assert got == (autoregressive_generate(runner.engine.target, PROMPTS[0], 5).token_ids, "length")
    assert threads["build"] == threads["step"] != threading.get_ident()
    assert not runner.alive


def test_launch_raises_what_build_raised():
    def build():
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        EngineRunner.launch(build)
