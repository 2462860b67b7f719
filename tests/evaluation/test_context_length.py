"""`adaflash eval context-length`: long contexts built from earlier exchanges, and the report on a tiny model."""

from __future__ import annotations

import inspect
import json

import torch

from adaflash.cli import main
from adaflash.evaluation import context_length
from adaflash.evaluation.context_length import with_history
from tests.training.test_online import adaflash_drafter  # noqa: F401 (fixture)


def _encode(messages):
    """One token per word of every message (a stand-in tokenizer for the history builder)."""
    return [0 for m in messages for _ in m["content"].split()]


def _exchange(words: int):
    return [{"role": "user", "content": "q " * words}, {"role": "assistant", "content": "a " * words}]


def test_with_history_reaches_the_level_keeps_the_prompt_last_and_skips_oversized_turns():
    final = [{"role": "system", "content": "s"}, {"role": "user", "content": "the question"}]
    pool = [_exchange(10), _exchange(500), _exchange(10), _exchange(10)]
    assert with_history(_encode, final, pool, 0) == final  # level 0: the prompt alone
    got = with_history(_encode, final, pool, 50)
    assert got[0] == final[0] and got[-1] == final[-1]  # system first, the question being answered last
    assert 50 <= len(_encode(got)) <= 50 * 1.25 + 64
    assert all("q " * 500 != m["content"] for m in got)  # the 1000-word exchange would overshoot: skipped
    assert with_history(_encode, final, pool, 10_000) is None  # the pool cannot reach it


def device_spy(monkeypatch, module, name: str, devices: list) -> None:
    """Record the `device` each call of module.name names (None where it names none: the process's default)."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        device = inspect.signature(real).bind(*args, **kwargs).arguments.get("device")
        devices.append(None if device is None else torch.device(device))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_eval_context_length_report(tiny_chat_checkpoint, adaflash_drafter, tmp_path, monkeypatch):  # noqa: F811
    devices: list = []  # the drafter and its head load on the target's device, named (a CUDA target's features)
    for name in ("load_drafter", "load_length_head"):
        device_spy(monkeypatch, context_length, name, devices)
    out = tmp_path / "context"
    rc = main(["eval", "context-length", "--model", tiny_chat_checkpoint, "--drafter", f"a={adaflash_drafter}",
               "--benchmarks", "gsm8k", "--levels", "0,300", "--limit", "2", "--pool", "4", "--max-new-tokens", "8",
               "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["drafters"]["a"]["gsm8k"]
    assert [r["level"] for r in rows] == [0, 300] and all(r["prompts"] == 2 and r["anchors"] > 0 for r in rows)
    assert rows[0]["context_tokens_mean"] < 300 <= rows[1]["context_tokens_mean"]
    assert all(1.0 <= r["accept_len"] <= 8 and 1.0 <= r["head"]["accept_len"] <= r["head"]["verify_len"] for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0 and "level 300" in out.with_suffix(".md").read_text()
    assert devices == [torch.device("cpu")] * 2
