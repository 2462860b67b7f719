"""`bench sweep`'s cell measurement: the baseline brackets the other servers."""

from __future__ import annotations

import pytest

from adaflash.evaluation.serve_sweep import measure_cell


def test_the_baseline_runs_first_and_last_and_its_throughput_is_the_mean():
    order, speeds = [], iter([40.0, 90.0, 70.0, 60.0])

    def run(name):
        order.append(name)
        return {"output_tokens_per_s": next(speeds), "failed": 1 if len(order) == 4 else 0}

    results = measure_cell(["ar", "a", "b"], run)
    assert order == ["ar", "a", "b", "ar"]
    assert list(results) == ["ar", "a", "b"]
    assert results["ar"]["output_tokens_per_s"] == 50.0 and results["ar"]["runs_tok_s"] == [40.0, 60.0]
    assert results["ar"]["failed"] == 1  # a failure in either baseline run counts
    assert results["a"]["output_tokens_per_s"] == 90.0 and results["a"]["ratio"] == 90.0 / 50.0


def test_a_lone_server_runs_once():
    calls = []
    results = measure_cell(["ar"], lambda n: calls.append(n) or {"output_tokens_per_s": 1.0, "failed": 0})
    assert calls == ["ar"] and "runs_tok_s" not in results["ar"]


def test_rounds_rotate_the_order_and_each_ratio_uses_the_baseline_runs_around_it():
    order = []
    # The machine slows down over the cell: the baseline 100 -> 50; "a" is always 1.2x the baseline around it.
    speeds = iter([100.0, 108.0, 90.0, 80.0, 85.0, 84.0, 60.0, 66.0, 66.0, 50.0])

    def run(name):
        order.append(name)
        return {"output_tokens_per_s": next(speeds), "failed": 0, "accept_len_mean": 1.0}

    results = measure_cell(["ar", "a", "b"], run, rounds=3)
    assert order == ["ar", "a", "b", "ar", "b", "a", "ar", "a", "b", "ar"]
    assert results["ar"]["runs_tok_s"] == [100.0, 80.0, 60.0, 50.0] and results["ar"]["output_tokens_per_s"] == 70.0
    assert results["a"]["ratios"] == pytest.approx([1.2, 1.2, 1.2])  # its own throughput fell 108 -> 66
    assert results["a"]["ratio"] == pytest.approx(1.2) and results["a"]["output_tokens_per_s"] == 84.0
    assert results["b"]["runs_tok_s"] == [90.0, 85.0, 66.0]


def test_warmup_runs_every_server_untimed_first():
    order, speeds = [], iter([10.0, 20.0, 30.0, 100.0, 110.0, 90.0, 100.0])

    def run(name):
        order.append(name)
        return {"output_tokens_per_s": next(speeds), "failed": 0, "accept_len_mean": 1.0}

    results = measure_cell(["ar", "a", "b"], run, rounds=1, warmup=1)
    assert order == ["ar", "a", "b", "ar", "a", "b", "ar"]
    assert results["ar"]["runs_tok_s"] == [100.0, 100.0] and results["a"]["ratio"] == pytest.approx(1.1)


def test_the_compute_table_counts_each_cells_prompts_against_the_higher_peak():
    from adaflash.evaluation.flops import linear_flops_per_token
    from adaflash.evaluation.serve_sweep import compute_table
    from tests.evaluation.test_flops import _config

    cfg = _config()
    cells = [{"dataset": "d", "concurrency": 8, "num_prompts": 4, "prompt_tokens": 400,
              "results": {"ar": {"output_tokens_per_s": 50.0, "duration_s": 4.0},  # 200 output tokens
                          "down": {"output_tokens_per_s": 0.0, "duration_s": 1.0}}}]  # nothing served: no row
    rows, text = compute_table(cells, ["ar", "down"], cfg, peaks=[0.5, 1.0])
    assert [r["server"] for r in rows] == ["ar"]
    out = 50 * linear_flops_per_token(cfg) / 1e9
    prompts = 100 * linear_flops_per_token(cfg, with_head=False) / 1e9  # 2 prompt tokens per output token
    assert rows[0]["output_gflops"] == pytest.approx(out) and rows[0]["output_fraction_of_peak"] == pytest.approx(out)
    assert rows[0]["with_prompts_fraction_of_peak"] == pytest.approx(out + prompts)
    assert "| d | 8 | ar | 50.0 |" in text
