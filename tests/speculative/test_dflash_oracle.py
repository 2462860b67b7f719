"""Our runtime against z-lab's reference DFlash code, pass for pass: drafters its classes create and save load here and
give the same target passes (anchor + drafts) and tokens, greedy, at blocks 8 and 16, on our CPU kernels and on the
torch code path CUDA runs; every field public drafters carry is honoured; sampling keeps the reference's acceptance
law. (The shipped SmolLM2 drafter against the reference: tests/speculative/test_dflash_oracle_smollm2.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from tests.dflash_oracle import path  # noqa: F401 (the fixture: our kernels, the torch path, CUDA)
from tests.dflash_oracle import (PROMPTS, assert_same_acceptance_law, hf_target, ours_generate, reference_drafter,
                                 reference_generate, repeating_mask_token)

NEW_TOKENS = 48
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    hf = hf_target(tiny_checkpoints["qwen3"])
    return tiny_checkpoints["qwen3"], hf, repeating_mask_token(hf)


def _agree(tiny, drafter_dir, model, prompts=PROMPTS) -> list[int]:
    """Ours = the reference on every prompt; returns how many drafts each pass kept (for coverage checks)."""
    checkpoint, hf, _ = tiny
    target = load_target(checkpoint, dtype=torch.float32)
    proposer = DFlashProposer(load_drafter(drafter_dir, dtype=torch.float32), target)
    kept = []
    for prompt in prompts:
        ref_tokens, ref_passes = reference_generate(model, hf, prompt, NEW_TOKENS)
        tokens, passes = ours_generate(target, proposer, prompt, NEW_TOKENS)
        assert passes == ref_passes, f"prompt {prompt}: the target passes (anchor + drafts) part"
        assert tokens == ref_tokens
        anchor = 0  # each pass's anchor is the last committed token; what follows it shows the drafts kept
        for block in passes:
            n = 0
            while n < len(block) - 1 and anchor + 1 + n < len(tokens) and tokens[anchor + 1 + n] == block[1 + n]:
                n += 1
            kept.append(n)
            anchor += n + 1
    return kept


@pytest.mark.parametrize("block", [8, 16])
def test_reference_drafters_draft_and_accept_as_the_reference(tiny, path, tmp_path, block):
    model = reference_drafter(tiny[1], tmp_path / "drafter", tiny[2], block=block)
    kept = _agree(tiny, tmp_path / "drafter", model)
    assert max(kept) >= 3 and min(kept) == 0, kept  # short and long accepts both compared


# field -> (top-level fields, dflash_config fields, DFlash 2): logit scales leave a plain drafter's greedy drafts as
# they are (monotone), so they are checked where they move the selector's scores.
FIELDS = {
    "embedding scale": ({}, {"input_embedding_scale": 1.7}, False),
    "output multiplier and soft cap": ({}, {"output_multiplier": 0.6, "final_logit_softcapping": 4.0}, True),
    "causal layers": ({"is_causal": True}, {}, False),
    "sliding layers": ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                        "sliding_window": 6}, {}, False),
    "yarn rope": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64}}, {}, False),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_public_checkpoint_fields_are_honoured(tiny, path, tmp_path, field):
    top, dflash, dflash2 = FIELDS[field]
    model = reference_drafter(tiny[1], tmp_path / "drafter", tiny[2], block=8, top=top, dflash=dflash, dflash2=dflash2)
    _agree(tiny, tmp_path / "drafter", model)
    # The field changed the drafts: without it, the same weights draft otherwise somewhere.
    plain = reference_drafter(tiny[1], tmp_path / "plain", tiny[2], block=8, dflash2=dflash2)
    differs = [reference_generate(model, tiny[1], p, NEW_TOKENS)[1] != reference_generate(plain, tiny[1], p,
                                                                                           NEW_TOKENS)[1]
               for p in PROMPTS]
    assert any(differs), f"{field} changed nothing: the test cannot tell whether it is honoured"


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["EagleDraftModel"]}, "not a DFlash drafter"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2], "tree_width": 4}}, "tree_width"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types names 1 layers"),
])
def test_fields_this_runtime_does_not_implement_fail_at_load(tiny, tmp_path, change, message):
    reference_drafter(tiny[1], tmp_path / "drafter", tiny[2])
    config = tmp_path / "drafter" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(ValueError, match=message) as error:
        load_drafter(tmp_path / "drafter", dtype=torch.float32)
    assert "config.json" in str(error.value)


def test_fields_survive_our_save(tiny, tmp_path):
    """A public drafter loaded and saved here keeps every field (what vLLM / SGLang then read)."""
    from adaflash.models.drafters.checkpoint import save_drafter

    top, dflash = FIELDS["sliding layers"][0] | FIELDS["yarn rope"][0], FIELDS["embedding scale"][1]
    model = reference_drafter(tiny[1], tmp_path / "drafter", tiny[2], top=top, dflash=dflash)
    save_drafter(load_drafter(tmp_path / "drafter", dtype=torch.float32), tmp_path / "again", dtype=torch.float32)
    assert load_drafter(tmp_path / "again").config == load_drafter(tmp_path / "drafter").config
    _agree(tiny, tmp_path / "again", model, prompts=PROMPTS[:1])


def test_sampling_acceptance_law_matches_the_reference(tiny, tmp_path):
    model = reference_drafter(tiny[1], tmp_path / "drafter", tiny[2], block=8)
    target = load_target(tiny[0], dtype=torch.float32)
    assert_same_acceptance_law(target, DFlashProposer(load_drafter(tmp_path / "drafter", dtype=torch.float32), target),
                               model, tiny[1])
