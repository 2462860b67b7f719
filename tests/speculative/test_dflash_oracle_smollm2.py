"""The shipped SmolLM2 drafter against z-lab's reference code on the real target: `adaflash export vllm --full-vocab`
writes the drafter and the target as transformers checkpoints; the reference's dflash_generate with them makes the same
target passes (anchor + drafts) and tokens as our reference loop drafting over the full vocabulary, in fp32."""

from __future__ import annotations

import pytest
import torch

from adaflash.export.vllm import export_vllm
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.targets.registry import load_tokenizer
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from tests.dflash_oracle import hf_target, ours_generate, ref, reference_generate

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]
DRAFTER = "adaflash/assets/drafters/smollm2-135m"
# Held out of every training mix: math, where drafts are kept most. One prompt keeps the reference's transformers
# passes within the suite's time (the tiny-model oracle tests cover the code paths).
PROMPTS = ("A baker sells 23 loaves on Monday and twice as many on Tuesday. How many loaves did she sell in total?",)
NEW_TOKENS = 32  # a dozen passes a prompt, several of them keeping drafts


def test_shipped_drafter_equals_the_reference_pass_for_pass(tmp_path):
    export = export_vllm(DRAFTER, tmp_path, full_vocab=True)
    model = ref.DFlashDraftModel.from_pretrained(export.drafter, dtype=torch.float32).eval()
    hf = hf_target(str(export.target))
    target = load_target(export.target, dtype=torch.float32)
    proposer = DFlashProposer(load_drafter(DRAFTER, dtype=torch.float32, draft_vocab="full"), target)
    tokenizer = load_tokenizer(export.target)
    stop = [tokenizer.eos_token_id]
    passes_total = tokens_total = 0
    for text in PROMPTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
        ref_tokens, ref_passes = reference_generate(model, hf, prompt, NEW_TOKENS, stop=stop)
        tokens, passes = ours_generate(target, proposer, prompt, NEW_TOKENS, stop=stop)
        assert passes == ref_passes, f"{text!r}: the target passes part"
        assert tokens == ref_tokens
        passes_total += len(passes)
        tokens_total += len(tokens) - 1
    assert tokens_total / passes_total > 1.1  # a real drafter: some passes keep drafts
