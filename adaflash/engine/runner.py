"""Run the Engine on one background thread and hand its outputs to asyncio tasks.

The engine is not thread-safe, so only the engine thread touches it: `submit` and `abort` post commands
to an inbox that the thread drains between steps. Each request's outputs flow back to the event loop that
submitted it through an asyncio.Queue fed with `call_soon_threadsafe`. When there is no work the thread
sleeps on a condition (no polling). Other threads (the server, the version watcher) read `runner.snapshot`, a frozen
description of the engine that the engine thread republishes after every command (a hot swap changes its policy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request, StepOutput
from adaflash.models.targets.model import TargetModel

log = logging.getLogger(__name__)
T = TypeVar("T")


class RunnerStoppedError(RuntimeError):
    """The engine thread is not running (not started yet, or shut down)."""


@dataclass(frozen=True)
class StepStats:
    """What the engine looks like after one loop iteration (for metrics)."""

    running: int
    waiting: int
    free_slots: int
    accept_lengths: tuple[int, ...] = ()  # tokens committed per target pass, one per request that decoded
    draft_lengths: tuple[int, ...] = ()  # drafted tokens verified per target pass, likewise
    prompt_tokens_reused: int = 0  # prompt tokens admitted requests found in the KV cache (engine total)
    kv: dict[str, int] | None = None  # the KV pool's blocks (Engine.kv_stats)


@dataclass(frozen=True)
class EngineSnapshot:
    """What threads other than the engine's may read of it. The target is never swapped (only its config is read);
    the drafter and its policy are, between two steps, so they appear here only as names."""

    target: TargetModel
    capture_layers: tuple[int, ...]
    max_draft: int  # the drafter's drafts per step at most (block size - 1; 0 without a drafter)
    max_verified: int  # drafts one step may verify, the drafter's or prompt lookup's
    max_len: int  # KV cache positions per slot
    max_batch: int
    speculative: bool  # a drafter is loaded
    policy_name: str

    @classmethod
    def of(cls, engine: Engine) -> "EngineSnapshot":
        return cls(engine.target, tuple(engine.capture), engine.max_draft, engine.max_verified, engine.max_len,
                   engine.scheduler.max_batch, engine.proposer is not None, engine.policy.name)


class RequestStream:
    """The outputs of one submitted request, as an async iterator; `close()` aborts it if still running."""

    def __init__(self, runner: "EngineRunner", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._runner, self._loop = runner, loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()

    def push(self, item: StepOutput | BaseException) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone: nobody is listening
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item

    def close(self) -> bool:
        """Abort the request unless it already finished; True if it was still running."""
        if self.finished:
            return False
        self.finished = True
        self._runner.abort(self.request_id)
        return True


@dataclass
class _Entry:
    request: Request
    stream: RequestStream
    seen_passes: int = 0  # accept_lengths already reported to the observer


class EngineRunner:
    def __init__(self, engine: Engine, observer: Callable[[StepStats], None] | None = None) -> None:
        self.engine = engine  # the engine thread's own; other threads read `snapshot`
        self.observer = observer
        self.snapshot = EngineSnapshot.of(engine)
        self._cond = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._entries: dict[str, _Entry] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def context_tokens(self) -> int:
        """Prompt + generated tokens one request may hold (mirrors the bound Engine.add_request enforces)."""
        return self.snapshot.max_len - self.snapshot.max_verified - 1

    # ---- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    def launch(cls, build: Callable[[], tuple[Engine, T]],
               observer: Callable[[StepStats], None] | None = None) -> tuple["EngineRunner", T]:
        """Build the engine on the thread that then runs it (started): (runner, what `build` returned beside it).

        Why a server should: OpenMP (torch's and our kernels') keeps one worker pool per thread that opens parallel
        regions, and once two threads have pools libgomp counts more threads than cores and stops its workers
        spinning, so every region pays a futex wake-up (~40 us). Loading on the main thread and stepping on this one
        made served decoding ~1.6x slower than the same engine on one thread (2-core EPYC); loading, packing and
        stepping on one thread keep one pool. `build`'s exception is raised here."""
        booted: concurrent.futures.Future = concurrent.futures.Future()

        def boot() -> None:
            try:
                engine, extra = build()
                runner = cls(engine, observer)
                runner._thread = threading.current_thread()
            except BaseException as exc:  # the caller sees it; nothing is left running
                booted.set_exception(exc)
                return
            booted.set_result((runner, extra))
            runner._loop()

        threading.Thread(target=boot, name="adaflash-engine", daemon=True).start()
        return booted.result()

    def start(self) -> "EngineRunner":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="adaflash-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "EngineRunner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- any thread / the event loop ---------------------------------------------------------------

    async def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises QueueFullError (at capacity) or ValueError (too long) before returning."""
        stream = RequestStream(self, request.request_id, asyncio.get_running_loop())
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not self._post(lambda: self._add(request, stream, added)):
            raise RunnerStoppedError("the engine is not running")
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # the client left while we waited for the engine thread
            self.abort(request.request_id)
            raise
        return stream

    def call(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps (a hot swap, a new recorder): its result's future."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                result, error = fn(self.engine), None
            except Exception as exc:
                result, error = None, exc
            # Published before the caller wakes, so what it reads next describes the changed engine.
            self.snapshot = EngineSnapshot.of(self.engine)
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

        if not self._post(command):
            raise RunnerStoppedError("the engine is not running")
        return done

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))  # a stopped runner has nothing left to abort

    def _post(self, command: Callable[[], None]) -> bool:
        with self._cond:
            if self._stopping or self._thread is None:
                return False
            self._inbox.append(command)
            self._cond.notify()
            return True

    # ---- the engine thread -------------------------------------------------------------------------

    def _add(self, request: Request, stream: RequestStream, added: concurrent.futures.Future) -> None:
        if not added.set_running_or_notify_cancel():
            return
        try:
            if request.request_id in self._entries:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self.engine.add_request(request)
        except Exception as exc:  # QueueFullError, ValueError: the submitter sees it
            added.set_exception(exc)
            return
        self._entries[request.request_id] = _Entry(request, stream)
        added.set_result(None)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            entry.stream.push(StepOutput(request_id, [], "abort"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._inbox or self._stopping or self.engine.has_work())
                commands, self._inbox, stopping = self._inbox, [], self._stopping
            for command in commands:  # even when stopping: no submitter is left waiting on its future
                try:
                    command()
                except Exception:  # a failed abort must not take the engine thread down
                    log.exception("engine command failed")
            if stopping:
                break
            accepts, drafts = [], []
            if self.engine.has_work():
                try:
                    accepts, drafts = self._deliver(self.engine.step())
                except Exception as exc:  # a bug, not bad input: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(exc)
            self._observe(accepts, drafts)
        self._fail_all(RunnerStoppedError("the engine stopped"))

    def _deliver(self, outputs: list[StepOutput]) -> tuple[list[int], list[int]]:
        accepts: list[int] = []
        drafts: list[int] = []
        for out in outputs:
            entry = self._entries.get(out.request_id)
            if entry is None:
                continue
            r = entry.request
            accepts += r.accept_lengths[entry.seen_passes:]
            drafts += r.draft_lengths[entry.seen_passes:]
            entry.seen_passes = len(r.accept_lengths)
            entry.stream.push(out)
            if out.finish_reason is not None:
                del self._entries[out.request_id]
        return accepts, drafts

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, entry in list(self._entries.items()):
            self.engine.abort(request_id)
            entry.stream.push(exc)
        self._entries.clear()

    def _observe(self, accepts: list[int], drafts: list[int]) -> None:
        if self.observer is None:
            return
        s = self.engine.scheduler
        try:
            self.observer(StepStats(len(s.running), len(s.waiting), len(s.free_slots), tuple(accepts), tuple(drafts),
                                    self.engine.prompt_tokens_reused, self.engine.kv_stats()))
        except Exception:  # metrics must never stop the engine
            log.exception("step observer failed")
