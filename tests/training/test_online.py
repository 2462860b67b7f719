"""`--method adaflash` and `adaflash online` end to end on a tiny model with SmolLM2's real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.cli import main
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, latest_version, save_drafter
from adaflash.models.drafters.length_head import (LengthHeadConfig, PositionAcceptanceHead, load_length_head,
    save_length_head)
from adaflash.plots import plot_online
from adaflash.training.online import OnlineAdaptation, OnlineConfig
from tests.helpers import private_cache


@pytest.fixture(scope="module")
def adaflash_drafter(tiny_chat_checkpoint, tmp_path_factory) -> str:
    """A random drafter carrying a random per-position length head (an adaflash checkpoint's layout)."""
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    path = save_drafter(init_drafter(cfg, seed=3), tmp_path_factory.mktemp("adaflash"))
    torch.manual_seed(0)
    save_length_head(PositionAcceptanceHead(LengthHeadConfig("position", cfg.hidden_size, 8, head_dim=16)), path)
    return str(path)


def test_generate_method_adaflash_equals_ar(tiny_chat_checkpoint, adaflash_drafter, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path)))  # the cost model is profiled into a throwaway cache
    base = ["generate", "--prompt", "Tell me a joke", "--model", tiny_chat_checkpoint, "--max-new-tokens", "16", "--json"]
    assert main(base) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(base + ["--method", "adaflash", "--drafter", adaflash_drafter]) == 0
    ada = json.loads(capsys.readouterr().out)
    assert ada["method"] == "adaflash" and ada["token_ids"] == ar["token_ids"]


def test_method_adaflash_needs_a_head(tiny_chat_checkpoint, tmp_path, capsys):
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    plain = save_drafter(init_drafter(cfg, seed=3), tmp_path / "plain")
    rc = main(["generate", "--prompt", "hi", "--model", tiny_chat_checkpoint, "--method", "adaflash", "--drafter", str(plain)])
    assert rc == 2 and "length head" in capsys.readouterr().err


def test_online_rounds_publish_swap_and_resume(tiny_chat_checkpoint, adaflash_drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path / "cache")))
    cfg = OnlineConfig(out_dir=str(tmp_path / "online"), drafter=adaflash_drafter, model=tiny_chat_checkpoint,
                       dtype="fp32", rounds=2, prompts_per_round=3, held_out_prompts=2, max_new_tokens=12, max_batch=2,
                       distill_steps=3, sequences_per_step=1, anchors_per_sequence=4, head_epochs=2, lr=3e-3)
    rounds = OnlineAdaptation(cfg).run()
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        assert r["trajectories"] == 3 and r["served_tokens_per_s"] > 0 and "candidate_held_out_accept_len" in r
        # Promotion is decided on the held-out slice alone, and the published score never goes down.
        assert r["promoted"] == (r["candidate_held_out_accept_len"] > rounds[r["round"] - 1]["held_out_accept_len"])
    held = [r["held_out_accept_len"] for r in rounds]
    assert held == sorted(held)
    latest = latest_version(tmp_path / "online" / "versions")
    assert latest.name == rounds[-1]["version"] and load_length_head(latest) is not None
    assert (tmp_path / "online" / "buffer" / "round-001" / "trajectories.jsonl").is_file()
    # A rerun after the last round resumes and has nothing left to do.
    assert OnlineAdaptation(cfg).run() == rounds
    assert plot_online(rounds, tmp_path / "online.png").is_file()
