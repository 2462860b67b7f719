"""The held-out numbers: the decoded accept length walks a response as greedy decoding does, and equals it."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import speculative_generate
from adaflash.training.dataset import DraftDataset
from adaflash.training.trainer import TrainConfig, train
from adaflash.training.validation import DecodedRun, decoded_walk, split_holdout

LAYERS = (1, 2)


def test_the_walk_commits_each_anchors_accepted_drafts_plus_the_bonus_token():
    # Anchors 2..8 of a 10-token sequence whose prompt is 3 tokens: decoding's passes start at position 3 (the prefill's
    # token), accept 2 there (-> 6), 1 at 6 (-> 8), and end at 8 with the one token left.
    run = DecodedRun(run_lengths=[0, 2, 0, 0, 1, 0, 5], first=2, prompt_len=3, length=10)
    assert decoded_walk(run) == (6, 3)
    # Nothing accepted: one token a pass over every response token after the first.
    assert decoded_walk(DecodedRun([0] * 7, 2, 3, 10)) == (6, 6)


def test_decoded_accept_length_equals_live_greedy_decoding(tiny_checkpoints, tiny_data, tmp_path):
    """A continued run's step-0 record scores exactly the saved drafter; decoding the held-out prompts with it gives
    the same tokens per target pass."""
    common = dict(data_dir=tiny_data, model=tiny_checkpoints["llama"], mask_token_id=5, num_layers=2, block_size=4,
                  target_layer_ids=LAYERS, sequences_per_step=2, anchors_per_sequence=6, holdout_samples=3,
                  holdout_decoded=True, log_every=10, lr=5e-3, warmup_frac=0.1)
    trained = train(TrainConfig(out_dir=str(tmp_path / "a"), max_steps=30, save_every=30, **common), progress=False)
    train(TrainConfig(out_dir=str(tmp_path / "b"), max_steps=1, save_every=1, init_from=str(trained), **common),
          progress=False)
    start = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and set(start["holdout_decoded"]) == {"all", "chat"}

    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    proposer = DFlashProposer(load_drafter(trained, dtype=torch.float32), target)
    data = DraftDataset(tiny_data, LAYERS)
    tokens = passes = 0
    for i in split_holdout(data.keys, 3)[1]:
        sample = data.samples[i]
        prompt, response = sample.tokens[: sample.prompt_len].tolist(), sample.tokens[sample.prompt_len :].tolist()
        live = speculative_generate(target, proposer, prompt, len(response))
        assert live.token_ids == response  # the data is the target's own greedy output
        # Tokens committed after the prefill's one; the loop's last pass may count a bonus token past the budget.
        tokens, passes = tokens + len(response) - 1, passes + len(live.stats.accept_lengths)
    assert tokens / passes > 1.2  # the drafter drafts something, so the walk is not trivially one token a pass
    assert start["holdout_decoded"]["all"] == pytest.approx(tokens / passes, abs=1e-9)
