"""Prompt-lookup drafts: which earlier n-gram wins, and what it proposes."""

from __future__ import annotations

import pytest
import torch

from adaflash.speculative.prompt_lookup import PromptLookup, point_mass


def test_the_longest_suffix_ngram_wins():
    # [1, 2] occurs at 0 (then 3), [9, 1, 2] at 4 (then 7): the trigram's continuation is proposed.
    tokens = [1, 2, 3, 3, 9, 1, 2, 7, 7, 9, 1, 2]
    assert PromptLookup(2, max_ngram=3).propose(tokens) == [7, 7]
    assert PromptLookup(2, max_ngram=2).propose(tokens) == [7, 7]  # the most recent bigram with a full run


def test_the_most_recent_full_run_else_the_earliest():
    tokens = [5, 6, 1, 2, 3, 5, 6, 4, 5, 6]
    assert PromptLookup(2).propose(tokens) == [4, 5]  # [5, 6] at 5 is followed by 2+ tokens
    assert PromptLookup(5).propose(tokens) == [1, 2, 3, 5, 6]  # only the earliest has 5 after it
    assert PromptLookup(9).propose(tokens) == [1, 2, 3, 5, 6, 4, 5, 6]  # a run cut by the sequence end


def test_a_loop_is_continued():
    loop = [10, 11, 12] * 4
    assert PromptLookup(6).propose(loop) == [10, 11, 12, 10, 11, 12]


def test_limits_and_misses():
    tokens = [1, 2, 3, 1, 2]
    assert PromptLookup(4).propose(tokens) == [3, 1, 2]
    assert PromptLookup(4).propose(tokens, limit=1) == [3]
    assert PromptLookup(4).propose(tokens, limit=0) == []
    assert PromptLookup(4).propose([1, 2, 3, 4, 5]) == []  # no earlier bigram
    assert PromptLookup(4).propose([4, 1, 2, 3, 1]) == []  # a unigram match is below min_ngram
    assert PromptLookup(4, min_ngram=1).propose([4, 1, 2, 3, 1]) == [2, 3, 1]
    assert PromptLookup(4).propose([7]) == []


def _searched_with_tensors(lookup: PromptLookup, tokens: list[int], want: int) -> list[int]:
    """The same choice written with tensor ops over every window (the first way it was written)."""
    if len(tokens) < lookup.min_ngram + 1:
        return []
    seq = torch.tensor(tokens)
    for n in range(min(lookup.max_ngram, len(tokens) - 1), lookup.min_ngram - 1, -1):
        starts = (seq[:-1].unfold(0, n, 1) == seq[-n:]).all(1).nonzero().flatten()
        if len(starts):
            full = starts[starts + n + want <= len(tokens)]
            start = int(full[-1] if len(full) else starts[0]) + n
            return tokens[start : start + want]
    return []


@pytest.mark.parametrize("alphabet", [(0, 1, 2), (0, 1, 256, 65536, 1 << 24, (1 << 24) + 1), tuple(range(40000, 40006))])
def test_the_byte_search_proposes_what_a_search_over_every_window_does(alphabet):
    """Random sequences over small alphabets (many matches); ids whose bytes also match across token boundaries (1,
    256, 65536, 2^24: a byte search must skip those)."""
    gen = torch.Generator().manual_seed(len(alphabet))
    for _ in range(400):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        tokens = [alphabet[int(i)] for i in torch.randint(0, len(alphabet), (length,), generator=gen)]
        lookup = PromptLookup(int(torch.randint(1, 9, (1,), generator=gen)), max_ngram=3, min_ngram=1 + length % 2)
        limit = int(torch.randint(1, 10, (1,), generator=gen))
        assert lookup.propose(tokens, limit) == _searched_with_tensors(lookup, tokens, min(lookup.num_tokens, limit))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookup(0)
    with pytest.raises(ValueError, match="num_tokens <= 15"):  # past the short-step attention kernel
        PromptLookup(16)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(3, max_ngram=1, min_ngram=2)


def test_point_mass_rows():
    q = point_mass([3, 0, 3], 5)
    assert q.shape == (3, 5) and torch.equal(q.argmax(1), torch.tensor([3, 0, 3])) and torch.equal(q.sum(1), torch.ones(3))
