"""z-lab's reference DFlash code (the `dflash` wheel) as a test oracle: drafters built by its own classes, written by
its own `save_pretrained`, run by its own `dflash_generate` beside ours on the same tiny target.

The drafters are random but not hopeless: every layer's output projections are small, so a block drafts mostly the
constant guess of its mask token's embedding - chosen to be the token the target repeats - and the layers, visible
in every logit, flip some of them. Accept lengths then range over 1..B, which a drafter of plain random weights
never reaches.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ref = pytest.importorskip("dflash.model", reason="z-lab's reference code: `make install` adds dflash==0.1.0")
ref._cuda_time = time.perf_counter  # it times with torch.cuda.synchronize; a CPU has none

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PROMPTS = ([3, 14, 15, 92, 65, 35], [7, 7, 41], [11, 90, 23, 52, 8, 19, 33, 2])
STOP = [1]  # the tiny targets' eos


@pytest.fixture(params=["kernels", "torch", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
def path(request, monkeypatch) -> str:
    """Our CPU kernels, torch's ops on the CPU (the code CUDA runs), or the GPU."""
    from adaflash.models.device import placement as process_device

    if request.param != "kernels":
        monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
        monkeypatch.setenv("ADAFLASH_DEVICE", "cuda" if request.param == "cuda" else "cpu")
        monkeypatch.setattr(process_device, "_current", None)
    return request.param


def hf_target(path: str):
    from adaflash.models.targets.registry import transformers_model

    return transformers_model(path)


def repeating_mask_token(hf) -> int:
    """A mask token whose own embedding, through the target's LM head, drafts the token the target repeats most on
    the first prompt (what a drafter with quiet layers then guesses at every block position)."""
    out = hf.generate(torch.tensor([PROMPTS[0]]), attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long),
                      max_new_tokens=40, do_sample=False)
    repeated = Counter(out[0, len(PROMPTS[0]):].tolist()).most_common(1)[0][0]
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    guesses = (F.rms_norm(embed, (embed.shape[1],), eps=1e-5) @ head.T).argmax(-1)
    hits = (guesses == repeated).nonzero().flatten().tolist()
    assert hits, "no mask token guesses the repeated token: pick another tiny target"
    return hits[0]


def reference_drafter(hf, path: Path, mask: int, block: int = 8, dflash2: bool = False, seed: int = 0,
                      top: dict | None = None, dflash: dict | None = None):
    """A DFlash (or DFlash 2) drafter made by the reference's classes for the tiny target `hf`, saved to `path`.
    `top` / `dflash`: extra top-level / dflash_config fields (layer types, rope, logit scales, ...)."""
    from transformers import Qwen3Config

    t = hf.config
    cfg = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      rms_norm_eps=1e-5, **(top or {}))
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    cfg.num_target_layers = t.num_hidden_layers
    cfg.block_size = block
    cfg.dflash_config = {"mask_token_id": mask, "target_layer_ids": [1, 2], **(dflash or {})}
    if dflash2:
        cfg.dflash_config.update(selector_rank=16, selector_top_k=4, conv_kernel_size=2, conv_group_size=16)
    torch.manual_seed(seed)
    model = (ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel)(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            quiet = "o_proj" in name or "down_proj" in name
            param.normal_(0.0, 0.002 if quiet else 0.1)
            if "base_kernel" in name:  # the convolutions near the identity, as DFlash 2 starts them
                param[:, 0] += 1.0
            if "codebook" in name:  # the selector's pair term as loud as the unary one: it reorders candidates
                param.normal_(0.0, 0.7)
    model.save_pretrained(path)
    return model


def reference_generate(model, hf, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                       seed: int = 0, stop: list[int] = STOP) -> tuple[list[int], list[list[int]]]:
    """The reference's tokens and every target pass's input after the prefill (anchor + drafts)."""
    passes = _recording(hf)
    torch.manual_seed(seed)
    try:
        out = ref.dflash_generate(model, hf, torch.tensor([prompt]), max_new_tokens, stop, temperature=temperature)
    finally:
        del hf.forward
    return out[0, len(prompt):].tolist(), passes[1:]


def _recording(module) -> list[list[int]]:
    calls: list[list[int]] = []
    forward = module.forward

    def recorded(input_ids, *args, **kwargs):
        calls.append(input_ids.flatten().tolist())
        return forward(input_ids, *args, **kwargs)

    module.forward = recorded
    return calls


def ours_generate(target, proposer, prompt: list[int], max_new_tokens: int,
                  stop: list[int] = STOP) -> tuple[list[int], list[list[int]]]:
    """Our reference loop's tokens and target passes after the prefill, drafting whole blocks as the reference does
    (block - 1 drafts, fewer only where the budget ends)."""
    from adaflash.speculative.reference import speculative_generate

    passes = _recording(target)
    try:
        result = speculative_generate(target, proposer, prompt, max_new_tokens, draft_length=proposer.block_size - 1,
                                      stop_token_ids=stop)
    finally:
        del target.forward
    return result.token_ids, passes[1:]


def in_the_run(target) -> list[int]:
    """A prompt ending inside the run of the token the target repeats (what the oracle's drafters guess)."""
    from adaflash.speculative.reference import autoregressive_generate

    return PROMPTS[0] + autoregressive_generate(target, PROMPTS[0], 8).token_ids


def assert_same_acceptance_law(target, proposer, model, hf, runs: int = 300, temperature: float = 0.3) -> None:
    """Random streams differ, laws do not: the first verify pass's committed tokens over many seeds, ours against the
    reference's (two-sample chi-square), on a prompt where drafts are often kept."""
    from scipy.stats import chi2_contingency

    from adaflash.speculative.reference import speculative_generate
    from adaflash.speculative.sampling import SamplingParams

    prompt, bins = in_the_run(target), 5  # no pass (the first token stopped), then 1, 2, 3, 4+ tokens committed
    new_tokens = bins  # the prefill's token and the first pass's first four: all the bins can tell apart
    ours, theirs = [0] * bins, [0] * bins
    for seed in range(runs):
        stats = speculative_generate(target, proposer, prompt, new_tokens, SamplingParams(temperature=temperature),
                                     draft_length=proposer.block_size - 1, stop_token_ids=STOP, seed=seed).stats
        tokens, passes = reference_generate(model, hf, prompt, new_tokens, temperature=temperature, seed=seed)
        ours[min(stats.accept_lengths[0], bins - 1) if stats.accept_lengths else 0] += 1
        theirs[min(_first_accept(tokens, passes[0]), bins - 1) if passes else 0] += 1
    assert sum(ours[2:]) > runs // 10, ours  # drafts were kept often enough for the law to say something
    table = [[o, t] for o, t in zip(ours, theirs) if o + t]
    assert chi2_contingency(table).pvalue > 1e-3, (ours, theirs)


def _first_accept(tokens: list[int], block: list[int]) -> int:
    """Tokens the first verify pass (anchor + drafts `block`) committed: the drafts the output kept, and one more."""
    n = 0
    while n < len(block) - 1 and 1 + n < len(tokens) and tokens[1 + n] == block[1 + n]:
        n += 1
    return n + 1
