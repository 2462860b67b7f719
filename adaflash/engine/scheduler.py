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

    def admit(self, choose_slot: Callable[[Request, list[int]], int] | None = None) -> list[Request]:
        """Move waiting requests into free slots; returns the newly admitted (they need a prefill). `choose_slot`
        picks one of the free slots for a request (default: the last in `free_slots`: low slots first, then the most
        recently freed)."""
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            if choose_slot is None:
                request.slot = self.free_slots.pop()
            else:
                request.slot = choose_slot(request, self.free_slots)
                self.free_slots.remove(request.slot)
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
