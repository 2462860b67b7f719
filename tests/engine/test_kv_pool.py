"""The engine on a paged KV pool: admission by what requests may write, prefixes shared between requests."""

from __future__ import annotations


def test_the_reuse_counter_follows_the_engines_running_total():
    from adaflash.engine.runner import StepStats
    from adaflash.server.metrics import ServerMetrics

    metrics = ServerMetrics("fixed:3", "ar", 2)
    for total in (0, 24, 24, 60):
        metrics.observe_step(StepStats(1, 0, 1, prompt_tokens_reused=total))
    assert "adaflash_prompt_tokens_reused_total 60.0" in metrics.render()[0].decode()
