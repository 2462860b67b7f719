"""Slots and the waiting queue: who runs this step, and when a new request is refused."""

from __future__ import annotations

import pytest

from adaflash.engine.request import Request
from adaflash.engine.scheduler import QueueFullError, Scheduler


def _request(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], 4)


def test_admit_fills_low_slots_first_in_arrival_order():
    s = Scheduler(max_batch=2, max_queue=4)
    for i in range(3):
        s.add(_request(i))
    admitted = s.admit()
    assert [r.request_id for r in admitted] == ["r0", "r1"] and [r.slot for r in admitted] == [0, 1]
    assert [r.request_id for r in s.waiting] == ["r2"] and s.free_slots == []
    assert s.admit() == []  # no free slot: nothing moves


def test_release_frees_the_slot_for_the_next_waiting_request():
    s = Scheduler(max_batch=2, max_queue=4)
    for i in range(3):
        s.add(_request(i))
    first, _ = s.admit()
    s.release(first)
    (third,) = s.admit()
    assert third.request_id == "r2" and third.slot == first.slot == 0


def test_release_of_a_waiting_request_drops_it_from_the_queue():
    s = Scheduler(max_batch=1, max_queue=4)
    a, b = _request(0), _request(1)
    s.add(a)
    s.add(b)
    s.admit()
    s.release(b)
    assert list(s.waiting) == [] and s.running == [a]
    s.release(b)  # releasing twice is harmless


def test_the_queue_bound_counts_free_slots_too():
    s = Scheduler(max_batch=2, max_queue=1)
    for i in range(3):  # two fill the free slots at the next step, one may wait
        s.add(_request(i))
    with pytest.raises(QueueFullError, match="at capacity"):
        s.add(_request(3))
    first, _ = s.admit()  # two run, r2 waits: the queue is at its bound
    with pytest.raises(QueueFullError):
        s.add(_request(4))
    s.release(first)  # a free slot again: one more may wait for it
    s.add(_request(5))
    with pytest.raises(QueueFullError):
        s.add(_request(6))


def test_find_running_and_waiting():
    s = Scheduler(max_batch=1, max_queue=2)
    s.add(_request(0))
    s.add(_request(1))
    s.admit()
    assert s.find("r0").slot == 0 and s.find("r1").slot is None and s.find("nope") is None


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(max_batch=0, max_queue=1)
