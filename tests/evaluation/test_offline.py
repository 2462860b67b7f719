"""`run_offline_bench` and `adaflash bench offline`: exact metrics on a scripted fake, lossless on a tiny model."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from adaflash.data.prompt import Prompt, user_messages
from adaflash.evaluation.offline import per_position_acceptance, per_position_counts, register_cli, run_offline_bench
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.speculative.reference import GenerationResult, GenerationStats


def make_prompt(pid: str, dataset: str, domain: str) -> Prompt:
    return Prompt(id=pid, domain=domain, dataset=dataset, messages=user_messages(pid))


class FakePipeline:
    """Returns scripted results per (prompt text, method) and logs the calls; no model involved."""

    model_name = "fake"
    carry_policy_state = False
    target = SimpleNamespace(dtype="fp32")
    proposer = SimpleNamespace(block_size=4)

    def __init__(self, script: dict[tuple[str, str], tuple[list[int], float, list[int], list[int]]]):
        self.script, self.calls, self._texts = script, [], []

    def encode(self, messages):
        self._texts.append(messages[-1]["content"])
        return [len(self._texts) - 1]

    def generate_ids(self, prompt_ids, method, max_new_tokens, sampling, draft_length, seed=0):
        text = self._texts[prompt_ids[0]]
        self.calls.append((text, method))
        tokens, elapsed, accepts, drafts = self.script[(text, method)]
        return GenerationResult(list(tokens), GenerationStats(len(accepts), sum(drafts), list(accepts), list(drafts), elapsed))


PROMPTS = [make_prompt("p1", "gsm8k", "math"), make_prompt("p2", "gsm8k", "math"), make_prompt("p3", "humaneval", "code")]
TEN = list(range(10))


def fake_script(p2_dflash_tokens=TEN):
    ar = ([1] * 9, [0] * 9)
    return {
        ("p1", "ar"): (TEN, 1.0, *ar), ("p2", "ar"): (TEN, 2.0, *ar), ("p3", "ar"): (TEN, 1.0, *ar),
        ("p1", "dflash"): (TEN, 0.5, [3, 3, 3], [3, 3, 3]),
        ("p2", "dflash"): (p2_dflash_tokens, 1.0, [1, 2, 4, 2], [3, 3, 3, 3]),
        ("p3", "dflash"): (TEN, 2.0, [1] * 9, [3] * 9),
    }


@pytest.mark.parametrize(
    "pairs, rates",
    [
        ([], []),
        ([(0, 0), (0, 0)], []),  # AR passes draft nothing
        ([(2, 3), (0, 3), (3, 3)], [2 / 3, 1.0, 0.5]),
        ([(1, 1), (0, 3), (3, 3)], [2 / 3, 1.0, 1.0]),  # a budget-cut pass (1 drafted) is not eligible at k >= 2
        ([(0, 2), (0, 2)], [0.0, None]),  # nobody reached position 2
        ([(2, 3)] * 3 + [(0, 3), (1, 3), (3, 3), (1, 3)] + [(0, 3)] * 9, [6 / 16, 4 / 6, 1 / 4]),
    ],
)
def test_per_position_acceptance(pairs, rates):
    assert per_position_acceptance(pairs) == pytest.approx(rates)


def test_per_position_counts_and_bad_pairs():
    assert per_position_counts([(2, 3), (0, 3), (3, 3)]) == [(2, 3), (2, 2), (1, 2)]
    with pytest.raises(ValueError, match="bad"):
        per_position_counts([(3, 2)])


def test_metrics_are_exact_on_a_scripted_pipeline():
    fake = FakePipeline(fake_script())
    report = run_offline_bench(fake, PROMPTS, ["dflash"], max_new_tokens=10, progress=False, warmup=False)
    # AR always runs, first on every prompt, then the others: machine noise hits both alike.
    assert report["methods"] == ["ar", "dflash"]
    assert fake.calls == [(p, m) for p in ("p1", "p2", "p3") for m in ("ar", "dflash")]
    assert report["lossless"] is True and report["mismatches"] == []
    assert report["datasets"] == {"gsm8k": "math", "humaneval": "code"}

    d = report["results"]["dflash"]["overall"]
    assert d["num_tokens"] == 30 and d["target_passes"] == 16
    assert d["tokens_per_s_aggregate"] == pytest.approx(30 / 3.5)
    assert d["tokens_per_s_median"] == pytest.approx(10.0)  # per prompt: 20, 10, 5
    assert d["speedup_aggregate"] == pytest.approx((30 / 3.5) / (30 / 4.0))
    assert d["speedup_median"] == pytest.approx(2.0)  # per prompt: 2, 2, 0.5
    assert d["accept_len_mean"] == pytest.approx(27 / 16)
    assert d["accept_len_hist"] == {"1": 10, "2": 2, "3": 3, "4": 1}
    assert d["accept_len_dist"]["1"] == pytest.approx(10 / 16)
    assert d["per_position_acceptance"] == pytest.approx([6 / 16, 4 / 6, 1 / 4])

    gsm = report["results"]["dflash"]["by_dataset"]["gsm8k"]
    assert gsm["speedup_aggregate"] == pytest.approx(2.0) and gsm["num_prompts"] == 2
    assert report["results"]["dflash"]["by_domain"]["code"]["accept_len_std"] == 0.0
    ar = report["results"]["ar"]["overall"]
    assert ar["speedup_aggregate"] == 1.0 and ar["accept_len_hist"] == {"1": 27} and ar["per_position_acceptance"] == []


def test_a_method_with_different_tokens_is_not_lossless():
    changed = TEN[:6] + [99, 98, 97, 96]
    report = run_offline_bench(FakePipeline(fake_script(changed)), PROMPTS, ["ar", "dflash"], 10, progress=False)
    assert report["lossless"] is False
    assert report["mismatches"] == [
        {"id": "p2", "dataset": "gsm8k", "method": "dflash", "first_difference": 6, "num_tokens": 10, "ar_num_tokens": 10}
    ]
    res = report["results"]["dflash"]
    assert res["overall"]["lossless"] is False and res["overall"]["identical_prompts"] == 2
    assert res["by_dataset"]["humaneval"]["lossless"] is True
    assert [r["methods"]["dflash"]["identical"] for r in report["prompts"]] == [True, False, True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 4}, "serving engine"),
        ({"methods": ["ar", "medusa"]}, "unknown method"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"prompts": []}, "no prompts"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"prompts": PROMPTS, "methods": ["ar", "dflash"], "max_new_tokens": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        run_offline_bench(FakePipeline(fake_script()), progress=False, **args)


# ---- on a real (tiny) model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_drafter(tiny_chat_checkpoint, tmp_path_factory) -> str:
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    return str(save_drafter(init_drafter(cfg, seed=3), tmp_path_factory.mktemp("drafter")))


def test_tiny_model_dflash_is_lossless(tiny_chat_checkpoint, random_drafter):
    from adaflash.pipeline import Pipeline

    pipeline = Pipeline.load(tiny_chat_checkpoint, random_drafter, "fp32")
    prompts = [make_prompt("Tell me a joke", "chat-set", "chat"), make_prompt("What is 2+3?", "math-set", "math")]
    report = run_offline_bench(pipeline, prompts, ["ar", "dflash"], max_new_tokens=8, draft_length=3, progress=False)
    assert report["lossless"] is True and report["block_size"] == 8
    for record in report["prompts"]:
        assert record["methods"]["dflash"]["identical"] is True
        assert record["methods"]["dflash"]["num_tokens"] == record["methods"]["ar"]["num_tokens"] > 0
    counts = report["results"]["dflash"]["overall"]["per_position_counts"]
    assert len(counts) == 3 and counts[0][1] == report["results"]["dflash"]["overall"]["target_passes"]


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_writes_json_with_provenance(tiny_chat_checkpoint, random_drafter, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "domain": d}) + "\n" for t, d in
                               [("Hi there", "chat"), ("2+2?", "math"), ("unused", "chat")]))
    out = tmp_path / "res" / "bench.json"
    args = _cli(["bench", "offline", "--prompts-file", str(prompts), "--limit", "2", "--max-new-tokens", "6",
                 "--model", tiny_chat_checkpoint, "--drafter", random_drafter, "--draft-length", "3",
                 "--dtype", "fp32", "--json", str(out)])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "dflash" in table and "all methods reproduced AR exactly" in table
    report = json.loads(out.read_text())
    assert set(report) >= {"command", "argv", "machine", "timestamp", "lossless", "methods", "results", "prompts", "mismatches"}
    assert set(report["machine"]) >= {"processor", "threads", "torch"}
    assert report["command"].startswith("adaflash bench offline --prompts-file") and "--limit 2" in report["command"]
    assert report["lossless"] is True and report["num_prompts"] == 2
    assert set(report["results"]["dflash"]["by_dataset"]) == {"p"}


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--batch-size", "2"], "serving engine"),
        (["--methods", "ar,nope"], "unknown method"),
        (["--methods", "ar,dflash"], "needs --drafter"),  # no drafter given and none ships for this model
        (["--methods", "ar", "--limit", "0"], "--limit"),
    ],
)
def test_cli_rejects_bad_runs_before_loading(tmp_path, extra, match):
    args = _cli(["bench", "offline", "--dataset", "gsm8k", "--model", str(tmp_path / "no-model"), *extra])
    with pytest.raises(ValueError, match=match):
        args.func(args)
