"""Admission and slots: which requests run this step. Knows nothing about how tokens are drafted."""

from __future__ import annotations

from collections import deque
from typing import Callable

from adaflash.engine.request import Request


class QueueFullError(RuntimeError):
    """All slots are busy and the waiting queue is at its bound (the server answers 503)."""


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch, self.max_queue = max_batch, max_queue
        self.free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out low slots first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        # Waiting requests first fill the free slots at the next step; beyond those, max_queue may wait.
        if len(self.waiting) >= self.max_queue + len(self.free_slots):
            raise QueueFullError(f"{len(self.running)} running and {len(self.waiting)} waiting: at capacity")
        self.waiting.append(request)

    def admit(self, fits: Callable[[Request], bool] | None = None) -> list[Request]:
        """Move waiting requests, oldest first, into free slots (low slots first, then the most recently freed);
        returns the newly admitted (they need a prefill). `fits`: whether the next one's memory is there now; the first
        that does not fit waits, and so do those behind it (no request overtakes a longer one for ever)."""
        admitted = []
        while self.waiting and self.free_slots and (fits is None or fits(self.waiting[0])):
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self.free_slots.append(request.slot)
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in [*self.running, *self.waiting] if r.request_id == request_id), None)
