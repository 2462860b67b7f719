"""The CLI end to end on a tiny model with SmolLM2's real tokenizer (and once as a real console script)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from adaflash.cli import _parse_mix, main
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from tests.helpers import private_cache


@pytest.fixture(scope="module")
def random_drafter(tiny_chat_checkpoint, tmp_path_factory) -> str:
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    return str(save_drafter(init_drafter(cfg, seed=3), tmp_path_factory.mktemp("drafter")))


def _trimmed_drafter(checkpoint: str, token_ids: list[int], out) -> str:
    """A random drafter whose draft vocabulary is the tokens of the output it will draft: so it is right often enough
    that a lossless check sees drafts accepted, not only rejected."""
    from adaflash.models.drafters.draft_vocab import DraftVocab

    config = TransformerConfig.from_dir(checkpoint)
    drafter = init_drafter(DrafterConfig.for_target(config, mask_token_id=16, num_layers=1, block_size=8), seed=3)
    drafter.set_draft_vocab(DraftVocab(torch.tensor(sorted(set(token_ids)), dtype=torch.long), config.vocab_size))
    return str(save_drafter(drafter, out))


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_generate_json_ar_and_dflash_agree(tiny_chat_checkpoint, tmp_path, capsys):
    base = ["generate", "--prompt", "Tell me a joke", "--model", tiny_chat_checkpoint, "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    ar = _json_lines(capsys.readouterr().out)[0]
    drafter = _trimmed_drafter(tiny_chat_checkpoint, ar["token_ids"], tmp_path / "drafter")
    assert main(base + ["--method", "dflash", "--drafter", drafter, "--draft-length", "5"]) == 0
    spec = _json_lines(capsys.readouterr().out)[0]
    assert set(ar) >= {"text", "token_ids", "num_tokens", "method", "stats"}
    assert set(ar["stats"]) >= {"accept_len_mean", "target_passes", "draft_tokens", "tokens_per_s"}
    assert ar["method"] == "ar" and spec["method"] == "dflash"
    assert spec["token_ids"] == ar["token_ids"] and spec["text"] == ar["text"]
    assert ar["num_tokens"] == len(ar["token_ids"]) <= 12
    assert spec["stats"]["draft_tokens"] > 0 and ar["stats"]["draft_tokens"] == 0
    assert spec["stats"]["accept_len_mean"] > 1 and spec["stats"]["target_passes"] < ar["stats"]["target_passes"]
    for sized in ("throughput", "all"):  # ar + n-gram drafts on the engine: the same tokens
        assert main(base + ["--prompt-lookup", "4", "--prompt-lookup-length", sized]) == 0
        assert _json_lines(capsys.readouterr().out)[0]["token_ids"] == ar["token_ids"]


def test_generate_with_a_draft_model_equals_ar(tiny_chat_checkpoint, capsys):
    """--draft-model: the target drafting for itself (every draft accepted), on the engine at batch 1, fixed or under
    the throughput policy: the same tokens as plain decoding."""
    base = ["generate", "--prompt", "Tell me a joke", "--model", tiny_chat_checkpoint, "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    ar = _json_lines(capsys.readouterr().out)[0]
    for extra in ([], ["--draft-length", "2"], ["--length-policy", "throughput"]):
        assert main(base + ["--method", "dflash", "--draft-model", tiny_chat_checkpoint, "--draft-max", "3", *extra]) == 0
        spec = _json_lines(capsys.readouterr().out)[0]
        assert spec["token_ids"] == ar["token_ids"]
        if not extra or extra[0] == "--draft-length":
            assert spec["stats"]["accept_len_mean"] > 1
    assert main(base + ["--method", "dflash", "--draft-model", tiny_chat_checkpoint, "--draft-max", "3",
                        "--draft-length", "5"]) == 2
    assert "exceeds the draft model's 3 drafts" in capsys.readouterr().err
    assert main(base + ["--draft-model", tiny_chat_checkpoint]) == 2  # --method ar: nothing would draft
    assert "--draft-model drafts for --method dflash" in capsys.readouterr().err


def test_generate_prompts_file_and_sampling(tiny_chat_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "What is 2+2?", "domain": "math"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Write a haiku"}], "id": "h1"}) + "\n"
    )
    args = ["generate", "--prompts-file", str(prompts), "--model", tiny_chat_checkpoint, "--max-new-tokens", "6", "--json",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    assert main(args) == 0
    first = _json_lines(capsys.readouterr().out)
    assert [r["domain"] for r in first] == ["math", "chat"] and first[1]["id"] == "h1"
    assert main(args) == 0
    assert [r["token_ids"] for r in _json_lines(capsys.readouterr().out)] == [r["token_ids"] for r in first]


def test_generate_errors_are_clear(tiny_chat_checkpoint, tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "nope")]) == 2
    assert "unknown model" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"oops": 1}\n')
    assert main(["generate", "--prompts-file", str(bad), "--model", tiny_chat_checkpoint]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--model", tiny_chat_checkpoint, "--method", "dflash"]) == 2
    assert "needs --drafter" in capsys.readouterr().err


def test_multilingual_domain_label_is_reported(tiny_chat_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Wie viel ist 2+2?", "domain": "multilingual"}) + "\n")
    assert main(["generate", "--prompts-file", str(prompts), "--model", tiny_chat_checkpoint, "--max-new-tokens", "4",
                 "--json"]) == 0
    assert _json_lines(capsys.readouterr().out)[0]["domain"] == "multilingual"


def test_threads_flag_and_environment(monkeypatch, capsys):
    from adaflash.cli_args import configure_process

    before = torch.get_num_threads()
    try:
        assert configure_process(1) == 1
        monkeypatch.setenv("ADAFLASH_THREADS", "2")
        assert configure_process(None) == 2
        monkeypatch.setenv("ADAFLASH_THREADS", "many")
        assert main(["data", "list"]) == 2
        assert "ADAFLASH_THREADS" in capsys.readouterr().err
        assert main(["--threads", "0", "data", "list"]) == 2
        assert "--threads" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "adaflash.cli", "generate", "--help"], capture_output=True, text=True, check=True)
    assert "--prompts-file" in out.stdout and "--method" in out.stdout


@pytest.mark.parametrize("policy", ["fixed:3", "heuristic", "throughput"])
def test_generate_with_engine_length_policies_equals_ar(tiny_chat_checkpoint, policy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path)))  # the throughput policy caches its cost model here
    base = ["generate", "--prompt", "Count to ten", "--model", tiny_chat_checkpoint, "--max-new-tokens", "10", "--json"]
    assert main(base) == 0
    ar = _json_lines(capsys.readouterr().out)[0]
    drafter = _trimmed_drafter(tiny_chat_checkpoint, ar["token_ids"], tmp_path / "drafter")
    assert main(base + ["--method", "dflash", "--drafter", drafter, "--length-policy", policy]) == 0
    spec = _json_lines(capsys.readouterr().out)[0]
    assert spec["token_ids"] == ar["token_ids"]
    if policy == "throughput":  # sized by this machine's measured costs: it may rightly draft nothing here
        assert list((tmp_path / "cost_models").glob("*.json"))
    else:
        assert spec["stats"]["draft_tokens"] > 0 and spec["stats"]["accept_len_mean"] > 1


def test_demo_runs_all_variants_losslessly(tiny_chat_checkpoint, random_drafter, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path / "cache")))
    demo = ["demo", "--model", tiny_chat_checkpoint, "--drafter", random_drafter, "--max-new-tokens", "6"]
    assert main([*demo, "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical to AR: yes" in out and "(medians of 2 round(s))" in out
    assert all(f"{v}: median speedup" in out for v in ("dflash-full", "dflash-2", "dflash-adaptive"))
    assert all(domain in out for domain in ("chat", "code", "math"))
    assert main([*demo, "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err

def test_counts_and_ranges():
    assert _parse_mix("gsm-symbolic:300,sharegpt-chat:2000-3500") == [("gsm-symbolic", 0, 300),
                                                                       ("sharegpt-chat", 2000, 3500)]


@pytest.mark.parametrize("bad", ["gsm-symbolic", "gsm-symbolic:", "champ:ten", "champ:5-", "champ:-5", "champ:9-3"])
def test_bad_items_name_themselves(bad):
    with pytest.raises(ValueError, match="--mix"):
        _parse_mix(bad)
