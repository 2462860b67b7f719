"""The single-request reference loops: speculative output equals autoregressive output (greedy) or its law (sampling)."""

from __future__ import annotations

import itertools

import pytest
import torch

from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate, speculative_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import TINY_VOCAB, ScriptedProposer, exact_joint, law_pvalue

PROMPT = [3, 14, 15, 92, 65, 35]


def _random_proposer(target, block=8, seed=0):
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=2, block_size=block)
    return DFlashProposer(init_drafter(cfg, seed=seed), target)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3-tied"])
@pytest.mark.parametrize("draft_length", [1, 3, 7])
def test_greedy_speculative_equals_autoregressive(tiny_checkpoints, name, draft_length):
    target = load_target(tiny_checkpoints[name], dtype=torch.float32)
    ar = autoregressive_generate(target, PROMPT, 40)
    script = PROMPT + ar.token_ids
    for proposer in (_random_proposer(target), ScriptedProposer(script, TINY_VOCAB, corrupt_prob=0.25)):
        spec = speculative_generate(target, proposer, PROMPT, 40, draft_length=draft_length)
        assert spec.token_ids == ar.token_ids
        assert sum(spec.stats.accept_lengths) + 1 >= len(spec.token_ids)
    # The scripted proposer is mostly right, so steps commit several tokens: the accept path was exercised.
    assert spec.stats.accept_len_mean > 1.0 or draft_length == 1
    assert spec.stats.draft_tokens <= draft_length * spec.stats.target_passes


def test_perfect_drafts_commit_whole_blocks(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    ar = autoregressive_generate(target, PROMPT, 30)
    spec = speculative_generate(target, ScriptedProposer(PROMPT + ar.token_ids, TINY_VOCAB, 0.0), PROMPT, 30, draft_length=4)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accept_lengths[0] == 5  # 4 drafts + bonus


def test_stop_tokens_and_budget(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    ar = autoregressive_generate(target, PROMPT, 30)
    stop = ar.token_ids[9]
    ar_stop = autoregressive_generate(target, PROMPT, 30, stop_token_ids=[stop])
    assert ar_stop.token_ids == ar.token_ids[: ar.token_ids.index(stop) + 1]
    spec = speculative_generate(target, ScriptedProposer(PROMPT + ar.token_ids, TINY_VOCAB, 0.0), PROMPT, 30, stop_token_ids=[stop])
    assert spec.token_ids == ar_stop.token_ids
    for budget in (1, 2, 5):
        spec = speculative_generate(target, _random_proposer(target), PROMPT, budget, draft_length=7)
        assert spec.token_ids == ar.token_ids[:budget]


def test_propose_runs_a_block_only_as_wide_as_its_longest_draft(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    proposer = _random_proposer(target)
    cache = proposer.new_cache(2, 32)
    features = torch.randn(9, len(proposer.capture_layers) * target.config.hidden_size)
    proposer.add_context(cache, features, RaggedBatch.build([0, 1], [0, 0], [5, 4]))
    greedy = [SamplingParams()] * 2
    drafts = proposer.propose(cache, [0, 1], [7, 9], [1, 3], greedy, [None] * 2)
    narrow = proposer.draft_hidden(cache, [0, 1], [7, 9], width=4)
    assert narrow.shape[1] == 4
    assert torch.equal(drafts.tokens, proposer.draft_tokens(narrow, [1, 3], greedy, [None] * 2).tokens)
    assert proposer.draft_hidden(cache, [0], [7]).shape[1] == proposer.block_size  # the length head's whole block
    with pytest.raises(ValueError, match="wide"):
        proposer.draft_hidden(cache, [0], [7], width=proposer.block_size + 1)


def test_bad_arguments(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    proposer = _random_proposer(target)
    with pytest.raises(ValueError, match="draft_length"):
        speculative_generate(target, proposer, PROMPT, 5, draft_length=8)
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(target, [], 5)


def test_sampling_is_seeded(tiny_checkpoints):
    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    params = SamplingParams(temperature=1.0)
    proposer = _random_proposer(target)
    a = speculative_generate(target, proposer, PROMPT, 20, params, seed=7)
    b = speculative_generate(target, proposer, PROMPT, 20, params, seed=7)
    c = speculative_generate(target, proposer, PROMPT, 20, params, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_sampling_speculative_preserves_the_target_law(tiny_checkpoints):
    """Chi-square of 3-token sequences (prefill sample + one verified block of 2) against the exact law."""
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = exact_joint(target, PROMPT, params, 3)
    likely = max(exact, key=exact.get)
    proposer = ScriptedProposer(PROMPT + list(likely), TINY_VOCAB, corrupt_prob=0.3, seed=1)
    n = 1500
    counts = dict.fromkeys(exact, 0)
    for seed in range(n):
        out = speculative_generate(target, proposer, PROMPT, 3, params, draft_length=2, seed=seed)
        counts[tuple(out.token_ids)] += 1
    assert law_pvalue(counts, exact) > 1e-3
