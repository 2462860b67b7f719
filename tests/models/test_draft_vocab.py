"""The trimmed draft vocabulary: choice by frequency, the on-disk format, and full-vocabulary loaders."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from adaflash.models.drafters.draft_vocab import VOCAB_FILE, DraftHead, DraftVocab, count_tokens
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, load_drafter, load_drafter_config, save_drafter

VOCAB = 96


def _config():
    return DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         vocab_size=VOCAB, block_size=8, mask_token_id=5, target_layer_ids=(1,), num_target_layers=4)


def test_most_frequent_ranks_by_count_then_id_and_forces_stop_tokens():
    counts = count_tokens([[7, 7, 7, 3, 3, 9], torch.tensor([9, 9, 9, 9, 4])])
    assert counts == Counter({9: 5, 7: 3, 3: 2, 4: 1})
    assert DraftVocab.most_frequent(counts, 3, VOCAB).token_ids.tolist() == [9, 7, 3]
    assert DraftVocab.most_frequent(counts, 3, VOCAB, always=[1]).token_ids.tolist() == [9, 7, 1]
    # A kept id that also ranks inside the cut is not lost when the forced ones make room.
    assert sorted(DraftVocab.most_frequent(counts, 3, VOCAB, always=[3, 1]).token_ids.tolist()) == [1, 3, 9]
    # Fewer distinct ids seen than asked: the rest are filled with unused ids, never duplicates.
    filled = DraftVocab.most_frequent(counts, 6, VOCAB).token_ids.tolist()
    assert filled[:4] == [9, 7, 3, 4] and len(set(filled)) == 6


def test_lookup_coverage_truncation_and_bad_vocabularies():
    vocab = DraftVocab(torch.tensor([9, 7, 3]), VOCAB)
    table = vocab.to_draft()
    assert table[9] == 0 and table[3] == 2 and table[4] == -1
    assert vocab.coverage(torch.tensor([9, 9, 4, 3])) == 0.75
    assert vocab.truncated(2).token_ids.tolist() == [9, 7]
    for bad in ([], [1, 1], [VOCAB]):
        with pytest.raises(ValueError):
            DraftVocab(torch.tensor(bad, dtype=torch.long), VOCAB)
    with pytest.raises(ValueError, match="cut"):
        vocab.truncated(4)


def test_draft_head_maps_rows_and_restricts_logits():
    lm_head = torch.randn(VOCAB, 8)
    head = DraftHead(lm_head, DraftVocab(torch.tensor([9, 7, 3]), VOCAB))
    torch.testing.assert_close(head.weight, lm_head[[9, 7, 3]])
    assert head.rows_of(torch.tensor([7, 4, -100]), ignore=-100).tolist() == [1, -1, -100]
    assert head.ids_of(torch.tensor([2, 0])).tolist() == [3, 9]
    logits = torch.randn(2, VOCAB)
    torch.testing.assert_close(head.restrict(logits), logits[:, [9, 7, 3]])
    full = DraftHead(lm_head, None)
    assert full.weight is lm_head and full.rows_of(torch.tensor([4])).tolist() == [4]
    # An int8 target's untied head is only blocks (a meta weight): the maps still run on the host's logits.
    blocks_only = DraftHead(torch.empty(VOCAB, 8, device="meta"), DraftVocab(torch.tensor([9, 7, 3]), VOCAB))
    assert blocks_only.weight.is_meta and blocks_only.weight.shape == (3, 8)
    assert blocks_only.ids_of(torch.tensor([2, 0])).tolist() == [3, 9]
    assert blocks_only.rows_of(torch.tensor([7, 4])).tolist() == [1, -1]


def test_checkpoint_keeps_the_vocabulary_beside_dflash_config(tmp_path):
    drafter = init_drafter(_config(), seed=0)
    drafter.set_draft_vocab(DraftVocab(torch.tensor([9, 7, 3, 1]), VOCAB))
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["draft_vocab"] == {"file": VOCAB_FILE, "size": 4}
    assert "draft_vocab" not in raw["dflash_config"]  # what vLLM / SGLang / llama.cpp read is untouched
    loaded = load_drafter(tmp_path, dtype=torch.float32)
    assert loaded.draft_vocab.token_ids.tolist() == [9, 7, 3, 1] and loaded.config.draft_vocab_size == 4
    # A full-vocabulary loader: the same weights, no vocabulary file needed.
    plain = {k: v for k, v in raw.items() if k != "draft_vocab"}
    assert DrafterConfig.from_hf_dict(plain).draft_vocab_size is None
    assert load_drafter(tmp_path, dtype=torch.float32, draft_vocab="full").draft_vocab is None
    assert load_drafter(tmp_path, dtype=torch.float32, draft_vocab="2").draft_vocab.token_ids.tolist() == [9, 7]
    # Saving without a vocabulary removes a stale file.
    save_drafter(init_drafter(_config(), seed=0), tmp_path)
    assert not (tmp_path / VOCAB_FILE).exists() and load_drafter_config(tmp_path).draft_vocab_size is None


def test_bad_vocabulary_files_are_named(tmp_path):
    drafter = init_drafter(_config(), seed=0)
    drafter.set_draft_vocab(DraftVocab(torch.tensor([9, 7, 3]), VOCAB))
    save_drafter(drafter, tmp_path)
    (tmp_path / VOCAB_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match=VOCAB_FILE):
        load_drafter(tmp_path)
    (tmp_path / VOCAB_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=VOCAB_FILE):
        load_drafter(tmp_path)
    save_drafter(init_drafter(_config(), seed=0), tmp_path)
    with pytest.raises(ValueError, match="no trimmed vocabulary"):
        load_drafter(tmp_path, draft_vocab="2")
    with pytest.raises(ValueError, match="full"):
        load_drafter(tmp_path, draft_vocab="some")
