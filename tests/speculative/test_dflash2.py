"""DFlash 2 drafters (grouped dynamic causal convolutions, candidate selector) made by z-lab's reference classes: greedy
drafts identical to the reference's, lossless in our reference loop, the batched engine under every length policy,
with a trimmed draft vocabulary, and sampling through the selector's law."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.checkpoint import load_drafter, save_drafter
from adaflash.models.drafters.length_head import LengthHeadConfig, PositionAcceptanceHead
from adaflash.models.targets.model import load_target
from adaflash.speculative.length_policy import BlockHeadLength, LearnedThroughputLength
from adaflash.speculative.policies import build_length_policy
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from adaflash.speculative.sampling import SamplingParams
from tests.dflash_oracle import path  # noqa: F401 (the fixture: our kernels, the torch path, CUDA)
from tests.dflash_oracle import (PROMPTS, assert_same_acceptance_law, hf_target, in_the_run, ours_generate,
                                 reference_drafter, reference_generate, repeating_mask_token)
from tests.engine.test_engine import FLAT_COST
from tests.helpers import drafting_happened, exact_joint, law_pvalue, sampled_counts

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    hf = hf_target(tiny_checkpoints["qwen3"])
    mask, root = repeating_mask_token(hf), tmp_path_factory.mktemp("dflash2")
    models = {block: reference_drafter(hf, root / f"b{block}", mask, block=block, dflash2=True) for block in (8, 16)}
    return tiny_checkpoints["qwen3"], hf, root, models


def _proposer(tiny, block=8, vocab=None):
    target = load_target(tiny[0], dtype=torch.float32)
    drafter = load_drafter(tiny[2] / f"b{block}", dtype=torch.float32)
    if vocab is not None:
        drafter.set_draft_vocab(DraftVocab(torch.tensor(vocab, dtype=torch.long), target.config.vocab_size))
    return target, DFlashProposer(drafter, target)


@pytest.mark.parametrize("block", [8, 16])
def test_dflash2_drafts_as_the_reference(tiny, path, block):
    target, proposer = _proposer(tiny, block)
    assert proposer.drafter.candidate_selector is not None and proposer.drafter.layers[0].mlp_conv is not None
    kept = []
    for prompt in PROMPTS:
        ref_tokens, ref_passes = reference_generate(tiny[3][block], tiny[1], prompt, NEW_TOKENS)
        tokens, passes = ours_generate(target, proposer, prompt, NEW_TOKENS)
        assert passes == ref_passes and tokens == ref_tokens
        kept.append(sum(len(p) for p in passes))
    # The selector is what drafted: the same drafter without it (top-1 of each position) drafts otherwise.
    proposer.drafter.candidate_selector = None
    assert any(ours_generate(target, proposer, p, NEW_TOKENS)[1] != reference_generate(tiny[3][block], tiny[1], p,
                                                                                        NEW_TOKENS)[1]
               for p in PROMPTS)


def test_saved_here_loads_in_the_reference(tiny, tmp_path):
    """Our save of a DFlash 2 drafter is a checkpoint the reference's from_pretrained loads (bare codebook names
    included) and drafts with as before."""
    from dflash.model import DFlash2DraftModel

    save_drafter(load_drafter(tiny[2] / "b8", dtype=torch.float32), tmp_path, dtype=torch.float32)
    again = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt in PROMPTS[:2]:
        assert reference_generate(again, tiny[1], prompt, 24) == reference_generate(tiny[3][8], tiny[1], prompt, 24)


def _head(target, block):
    torch.manual_seed(0)
    head = PositionAcceptanceHead(LengthHeadConfig(kind="position", hidden_size=target.config.hidden_size,
                                                   block_size=block, head_dim=16)).eval()
    with torch.no_grad():
        head.fc2.bias.add_(4.0)  # lean toward drafting; its input still moves it
    return head


POLICIES = {
    "fixed:7": lambda target: build_length_policy("fixed:7"),
    "fixed:3": lambda target: build_length_policy("fixed:3"),
    "heuristic": lambda target: build_length_policy("heuristic"),
    "throughput": lambda target: build_length_policy("throughput", FLAT_COST),
    "adaflash": lambda target: LearnedThroughputLength(FLAT_COST, _head(target, 8).to(target.device)),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("vocab", [None, "trimmed"])
def test_engine_is_lossless_with_dflash2(tiny, path, policy, vocab):
    target, proposer = _proposer(tiny, 8, vocab=list(range(0, 96, 2)) + [81, 1] if vocab else None)
    engine = Engine(target, proposer, POLICIES[policy](target), max_batch=4, max_len=128)
    requests = [Request(f"r{i}", p, 40, stop_token_ids=[1]) for i, p in enumerate(PROMPTS * 2)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    for r, prompt in zip(requests, PROMPTS * 2):
        assert r.output_ids == autoregressive_generate(target, prompt, 40, stop_token_ids=[1]).token_ids
    if policy.startswith("fixed"):
        drafting_happened(requests)


def test_sampling_keeps_the_target_law(tiny):
    """Drafts drawn through the selector's law over its candidates: the target's own law, reference loop and engine."""
    target, proposer = _proposer(tiny, 8)
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = in_the_run(target)
    exact = exact_joint(target, prompt, params, 3)
    counts, requests = sampled_counts(target, proposer, prompt, params, exact, 600, draft_length=3)
    assert law_pvalue(counts, exact) > 1e-3
    drafting_happened(requests)


def test_acceptance_law_matches_the_reference(tiny):
    target, proposer = _proposer(tiny, 8)
    assert_same_acceptance_law(target, proposer, tiny[3][8], tiny[1])
