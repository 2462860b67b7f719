"""A drafter with a trimmed draft vocabulary stays lossless: greedy tokens and the sampling law are the target's,
in the reference loop and in the batched engine."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.length_policy import FixedLength
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate, speculative_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import exact_joint, law_pvalue, sampled_counts
from tests.speculative.test_reference import PROMPT

VOCAB = 96


def _trimmed_proposer(target, ids, block=8, seed=0):
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=block)
    drafter = init_drafter(cfg, seed=seed)
    drafter.set_draft_vocab(DraftVocab(torch.tensor(ids, dtype=torch.long), VOCAB))
    return DFlashProposer(drafter, target)


def _vocab_around(tokens, extra=8):
    """The given tokens' ids (some drafts can be right) plus a few others (some drafts are surely wrong)."""
    kept = list(dict.fromkeys(tokens))
    return kept + [t for t in range(6, VOCAB) if t not in kept][:extra]


@pytest.mark.parametrize("name", ["llama", "qwen3-tied"])
def test_greedy_trimmed_drafts_equal_autoregressive(tiny_checkpoints, name):
    target = load_target(tiny_checkpoints[name], dtype=torch.float32)
    ar = autoregressive_generate(target, PROMPT, 40).token_ids
    # Tokens the target emits outside the draft vocabulary (where its output varies) are certain rejections; one
    # other id, so that drafts are often right.
    proposer = _trimmed_proposer(target, _vocab_around(ar[::2], extra=1))
    drafts = proposer.propose(proposer.new_cache(1, 64), [0], [PROMPT[-1]], [7], [SamplingParams()], [None])
    assert set(drafts.tokens.tolist()) <= set(proposer.drafter.draft_vocab.token_ids.tolist())
    for k in (1, 3, 7):
        result = speculative_generate(target, proposer, PROMPT, 40, draft_length=k)
        assert result.token_ids == ar and max(result.stats.accept_lengths) > 1  # some drafts accepted, not only corrected
    engine = Engine(target, proposer, FixedLength(7), max_batch=2, max_len=128)
    requests = [Request("a", PROMPT, 40), Request("b", PROMPT[:3], 25)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert requests[0].output_ids == ar
    assert requests[1].output_ids == autoregressive_generate(target, PROMPT[:3], 25).token_ids
    assert max(a for r in requests for a in r.accept_lengths) > 1


def test_trimmed_sampling_preserves_the_target_law(tiny_checkpoints):
    """Chi-square of 3-token sequences against the exact law, the drafter proposing only from its vocabulary."""
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = exact_joint(target, PROMPT, params, 3)
    support = sorted({t for seq in exact for t in seq})
    # Keep only part of the target's support: its other tokens can come only from the target's residual.
    proposer = _trimmed_proposer(target, _vocab_around(support[: max(1, len(support) // 2)], extra=2), seed=3)
    counts, reqs = sampled_counts(target, proposer, PROMPT, params, exact, 1200)
    assert sum(sum(r.draft_lengths) for r in reqs) > 0 and any(a > 1 for r in reqs for a in r.accept_lengths)
    assert law_pvalue(counts, exact) > 1e-3
