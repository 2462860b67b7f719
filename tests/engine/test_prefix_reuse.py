"""Prompt-prefix reuse: which slot a request lands in and how much of its prompt the slot already holds."""

from __future__ import annotations

from adaflash.engine.prefix_reuse import SlotPrefixes, common_prefix
from adaflash.engine.request import Request
from adaflash.engine.scheduler import Scheduler


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_the_last_prompt_token_is_always_computed():
    prefixes = SlotPrefixes(2)
    prefixes.remember(0, [5, 6, 7, 8, 9])
    assert prefixes.reusable(0, [5, 6, 7]) == 2  # all three held, but the last one's logits pick the first output
    assert prefixes.reusable(0, [5, 6, 1, 2]) == 2
    assert prefixes.reusable(1, [5, 6, 7]) == 0
    prefixes.forget(0)
    assert prefixes.reusable(0, [5, 6, 7]) == 0


def test_a_request_lands_in_the_free_slot_holding_most_of_its_prompt():
    prefixes = SlotPrefixes(3)
    prefixes.remember(0, [1, 2, 3, 4])
    prefixes.remember(2, [1, 2, 9])
    s = Scheduler(max_batch=3, max_queue=4)
    s.add(Request("a", [1, 2, 3, 4, 5], 4))
    s.add(Request("b", [7, 7], 4))  # no slot holds any of it: the scheduler's own choice among the rest
    admitted = s.admit(lambda r, free: prefixes.best_slot(r.prompt_ids, free))
    assert [(r.request_id, r.slot) for r in admitted] == [("a", 0), ("b", 1)]
    assert s.free_slots == [2]


def test_the_reuse_counter_follows_the_engines_running_total():
    from adaflash.engine.runner import StepStats
    from adaflash.server.metrics import ServerMetrics

    metrics = ServerMetrics("fixed:3", "ar", 2)
    for total in (0, 24, 24, 60):
        metrics.observe_step(StepStats(1, 0, 1, prompt_tokens_reused=total))
    assert "adaflash_prompt_tokens_reused_total 60.0" in metrics.render()[0].decode()
