"""`adaflash eval drafters` on a tiny model with SmolLM2's tokenizer: the report's shape and its invariants."""

from __future__ import annotations

import json

from adaflash.cli import main
from tests.training.test_online import adaflash_drafter  # noqa: F401 (fixture)


def test_eval_drafters_report(tiny_chat_checkpoint, adaflash_drafter, tmp_path):  # noqa: F811
    out = tmp_path / "variance"
    rc = main(["eval", "drafters", "--model", tiny_chat_checkpoint, "--drafter", f"a={adaflash_drafter}",
               "--drafter", f"b={adaflash_drafter}", "--benchmarks", "gsm8k,mt-bench", "--limit", "2",
               "--max-new-tokens", "10",
               "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    a, b = report["drafters"]["a"], report["drafters"]["b"]
    assert a["benchmarks"] == b["benchmarks"]  # same drafter, same trajectories: same numbers
    for row in a["benchmarks"].values():
        assert 1.0 <= row["accept_len"] <= 8 and row["anchors"] > 0 and len(row["per_position"]) == 7
        head = row["head"]
        assert 1.0 <= head["accept_len"] <= head["verify_len"] and 0 < head["tokens_per_verified_token"] <= 1
    assert a["accept_len_std_across_benchmarks"] >= 0 and "std across benchmarks" in out.with_suffix(".md").read_text()
    assert len(list((tmp_path / "cache").glob("*.jsonl"))) == 2  # target responses cached per benchmark


def test_rkl_picture(tiny_chat_checkpoint, adaflash_drafter, tmp_path):  # noqa: F811
    out = tmp_path / "rkl"
    rc = main(["eval", "rkl-picture", "--model", tiny_chat_checkpoint, "--before", adaflash_drafter, "--after",
               adaflash_drafter, "--max-new-tokens", "10", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert rc == 0 and out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".html").is_file()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows[0]["values"] == rows[1]["values"] and len(rows[0]["tokens"]) == len(rows[0]["values"]) > 0
    assert all(v >= -1e-6 for v in rows[0]["values"])
