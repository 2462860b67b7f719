"""Greedy output does not depend on the run: each command in a fresh process (as a user runs it twice), with the cost
model and kernel choices present, absent and stale in the user cache, equals plain decoding; and a policy's server
equals the AR server. The 16-prompt, 20-run figures: benchmarks/runtime/determinism.py (docs/results/runtime/)."""

from __future__ import annotations

import json

import pytest

from adaflash.data import load_prompts
from adaflash.evaluation.determinism import VARIANTS, differences, drafting, fresh_process_runs, prepare_cache
from adaflash.models.kernels import packed

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(packed.library() is None, reason="int8 needs our CPU kernels (AVX2 and a compiler)")]

MAX_NEW = 40


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[dict]]:
    return [load_prompts(name, "eval", limit=1)[0].messages for name in ("gsm8k", "humaneval", "mt-bench")]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, prompts):
    path = tmp_path_factory.mktemp("determinism") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts))
    return path


def _assert_all_equal_and_drafted(report: dict, dtype: str, states) -> None:
    """Every run equals AR and the first run; and drafts were verified, so the equality proves something: the fixed
    policy accepts some in every run (the adaptive ones may rightly draft nothing where drafting does not pay)."""
    for variant, runs in report[dtype]["variants"].items():
        assert [r["cache"] for r in runs] == list(states)
        for r in runs:
            assert r["vs_ar"] == [] and r["vs_first_run"] == [], (dtype, variant, r)
            if variant.startswith("fixed:"):
                assert r["draft_tokens"] > 0 and r["tokens_per_pass"] > 1.1, (dtype, variant, r)


def test_int8_policies_in_fresh_processes_equal_ar(prompts_file, tmp_path):
    # The cache as the AR run left it (its kernel choices present, the cost model measured by the first run that
    # needs it), then scaled at random; the fp32 test measures everything afresh.
    states = ("present", "stale")
    report = fresh_process_runs(prompts_file, ["fixed:3", "throughput + lookup"], ["int8"], len(states),
                                MAX_NEW, tmp_path, threads=2, log=lambda _: None, states=states)
    _assert_all_equal_and_drafted(report, "int8", states)


def test_fp32_throughput_in_fresh_processes_equals_ar(prompts_file, tmp_path):
    # (the run-to-run checks and the present and stale caches are the int8 test's; here the policy that reads the
    # clock and the kernel cache, measuring both afresh in a process of its own)
    states = ("absent",)
    report = fresh_process_runs(prompts_file, ["throughput"], ["fp32"], len(states), MAX_NEW, tmp_path, threads=2,
                                log=lambda _: None, states=states)
    _assert_all_equal_and_drafted(report, "fp32", states)


def test_the_checks_can_say_no(tmp_path):
    """The comparisons this file relies on see a difference, and a stale cache really is another cache."""
    assert differences([[1, 2, 3], [4]], [[1, 2, 9], [4]]) == [{"prompt": 0, "first_token": 2}]
    assert differences([[1, 2]], [[1, 2, 3]]) == [{"prompt": 0, "first_token": 2}]
    with pytest.raises(ValueError):
        differences([[1]], [])
    record = {"num_tokens": 6, "stats": {"target_passes": 3, "draft_tokens": 5}}
    assert drafting([record]) == {"draft_tokens": 5, "tokens_per_pass": 2.0}
    source = tmp_path / "user"
    (source / "kernels").mkdir(parents=True)
    cache = tmp_path / "private"
    prepare_cache(cache, "present", 0, source)
    timings = {"shapes": {"8x8": {"1": {"stock": 0.5, "packed": 0.25}}}, "threads": 2}
    (cache / "kernels" / "choices-x.json").write_text(json.dumps(timings))
    prepare_cache(cache, "stale", 1, source)
    stale = json.loads((cache / "kernels" / "choices-x.json").read_text())
    assert stale["threads"] == 2 and stale["shapes"]["8x8"]["1"] != timings["shapes"]["8x8"]["1"]
    prepare_cache(cache, "absent", 2, source)
    assert not list((cache / "kernels").glob("choices-*.json"))
    assert set(VARIANTS) >= {"ar", "throughput", "adaflash"}
