"""DFlash 2 in the one training loop: the selector's K-way loss (gold injected, stop-gradient), a new DFlash 2 drafter
that learns and ships a checkpoint z-lab's reference drafts with as we do, and a DFlash 1 drafter upgraded in place."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import as_dflash2, init_drafter, load_drafter
from adaflash.models.drafters.dflash2 import CandidateSelector
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.training.losses import IGNORE, MISS
from adaflash.training.selector_loss import selector_loss, teacher_forced_predecessors
from adaflash.training.trainer import train
from tests.training.test_trainer import _config

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def test_selector_loss_injects_the_gold_row_and_trains_only_the_selector():
    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=8, vocab_size=20, rank=4, top_k=3)
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    logits = torch.randn(2, 3, 20, requires_grad=True)
    top = logits.detach().topk(3, dim=-1).indices
    outside = [i for i in range(20) if i not in top[0, 1].tolist()][0]
    labels = torch.tensor([[top[0, 0, 1], outside, top[0, 2, 0]], [top[1, 0, 0], MISS, IGNORE]])
    block = torch.tensor([[7, 5, 5, 5], [9, 5, 5, 5]])
    loss, stats = selector_loss(selector, hidden, logits, labels, teacher_forced_predecessors(block, labels), None)
    loss.backward()
    assert torch.isfinite(loss) and hidden.grad is None and logits.grad is None  # stop-gradient into the backbone
    assert selector.successor_codebook.weight.grad is not None
    # The injected gold (row 0, position 1) is a training aid, never a right pick; MISS and IGNORE are never right.
    assert stats["correct"][1] == 0 and stats["valid"] == [2, 2, 1]
    assert stats["selector_recall"] == pytest.approx(3 / 4)
    assert teacher_forced_predecessors(block, labels)[0].tolist() == [7, int(top[0, 0, 1]), outside]


def test_a_new_dflash2_drafter_learns_and_the_reference_drafts_with_it(tiny_checkpoints, tiny_data, tmp_path):
    from tests.dflash_oracle import hf_target, ours_generate, ref, reference_generate

    cfg = _config(tiny_checkpoints, tiny_data, tmp_path, max_steps=30, lr=5e-3, save_every=30, block_size=6,
                  selector_rank=8, selector_top_k=4)
    final = train(cfg, progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    assert json.loads((final / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    drafter = load_drafter(final, dtype=torch.float32)
    assert drafter.config.selector_rank == 8 and drafter.layers[0].attention_conv is not None
    # z-lab's reference loads the checkpoint and drafts with it as we do (a tiny Llama target: the drafter is
    # target-agnostic there too).
    from adaflash.speculative.proposer import DFlashProposer

    model = ref.DFlash2DraftModel.from_pretrained(final, dtype=torch.float32).eval()
    hf = hf_target(tiny_checkpoints["llama"])
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    proposer = DFlashProposer(drafter, target)
    for prompt in ([3, 14, 15, 92], [7, 7, 41, 8, 19]):
        assert ours_generate(target, proposer, prompt, 24) == reference_generate(model, hf, prompt, 24)


def test_a_dflash1_drafter_upgraded_drafts_as_before(tiny_checkpoints):
    """Identity convolutions and a fresh selector: the backbone's hidden states are unchanged."""
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=2, block_size=6)
    plain = init_drafter(cfg, seed=1)
    upgraded = as_dflash2(plain, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert upgraded.config.dflash2 and upgraded.candidate_selector is not None
    hidden = []
    for drafter in (plain, upgraded):
        cache = drafter.new_cache(1, 32)
        features = torch.randn(5, len(cfg.target_layer_ids) * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        drafter.extend_context(cache, features, RaggedBatch.build([0], [0], [5]))
        hidden.append(drafter.draft_hidden(cache, torch.randn(1, 6, cfg.hidden_size,
                                                              generator=torch.Generator().manual_seed(1)), [0]))
    torch.testing.assert_close(hidden[0], hidden[1])
    with pytest.raises(ValueError, match="already"):
        as_dflash2(upgraded, 2, 16, 8, 4)
