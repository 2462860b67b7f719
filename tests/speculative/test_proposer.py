"""The proposer's one-call draft (drafter layers, final norm and draft head in one kernel call) against the two-call
path it replaces (draft_hidden, then draft_tokens): the same drafts, greedy and sampled, full or trimmed vocabulary."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.kernels import packed
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import SamplingParams

pytestmark = pytest.mark.skipif(packed.library() is None, reason="our CPU kernels cannot run here")


@pytest.mark.parametrize("trimmed", [False, True])
def test_the_one_call_draft_is_the_two_call_draft(tiny_checkpoints, monkeypatch, trimmed):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=2, block_size=8)
    drafter = init_drafter(cfg, seed=3).eval()
    if trimmed:
        drafter.set_draft_vocab(DraftVocab(torch.arange(6, 70), target.config.vocab_size))
    proposer = DFlashProposer(drafter, target)
    cache = proposer.new_cache(3, 64)
    features = torch.randn(30, len(cfg.target_layer_ids) * target.config.hidden_size,
                           generator=torch.Generator().manual_seed(4))
    proposer.add_context(cache, features, RaggedBatch.build([0, 2], [0, 0], [12, 18]))
    ran, draft_logits = [], DFlashDrafter.draft_logits
    monkeypatch.setattr(DFlashDrafter, "draft_logits",
                        lambda self, *a: ran.append(draft_logits(self, *a)) or ran[-1])
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)]

    def propose():
        generators = [None, torch.Generator().manual_seed(7)]
        return proposer.propose(cache, [0, 2], [11, 40], [3, 5], sampling, generators)

    one_call = propose()
    assert len(ran) == 1 and ran[0] is not None
    monkeypatch.setattr(DFlashDrafter, "draft_logits", lambda self, *a: None)  # the two-call path
    two_calls = propose()
    assert torch.equal(one_call.tokens, two_calls.tokens) and one_call.num_draft == two_calls.num_draft == (3, 5)
    assert one_call.probs[0] is None and torch.equal(one_call.probs[1], two_calls.probs[1])
    assert cache.lengths == [12, 0, 18]  # block K/V never commit
