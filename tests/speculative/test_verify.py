"""The verifier as a pure function: table-driven greedy cases, exact sampling cases, a chi-square test, and the
sampling-law check shown to reject the product's verifier with one line faulted."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch
from scipy.stats import chisquare

from adaflash.engine import engine as engine_module
from adaflash.models.targets.model import load_target
from adaflash.speculative import reference, verify
from adaflash.speculative.sampling import SamplingParams, draw_exponentials, logits_to_probs
from adaflash.speculative.verify import verify_greedy, verify_sampling
from tests.helpers import TINY_VOCAB, ScriptedProposer, exact_joint, law_pvalue, sampled_counts

T = torch.tensor


@pytest.mark.parametrize(
    "drafts, target_argmax, num_draft, accepted, next_tokens",
    [
        ([5, 6, 7], [5, 6, 7, 8], [3], [3], [8]),  # all accepted: bonus token
        ([5, 6, 7], [5, 9, 7, 8], [3], [1], [9]),  # mismatch at 2: target's token replaces it
        ([5, 6, 7], [4, 6, 7, 8], [3], [0], [4]),  # first mismatch: nothing accepted
        ([5, 6, 7], [5, 1, 7, 8], [3], [1], [1]),  # later matches after a mismatch do not count
        ([], [3], [0], [0], [3]),  # no drafts: plain decoding step
        # ragged batch: [2 drafts, 0 drafts, 3 drafts]
        ([1, 2, 3, 4, 5], [1, 2, 9, 7, 3, 0, 5, 6], [2, 0, 3], [2, 0, 1], [9, 7, 0]),
    ],
)
def test_greedy_table(drafts, target_argmax, num_draft, accepted, next_tokens):
    result = verify_greedy(T(drafts, dtype=torch.long), T(target_argmax), num_draft)
    assert result.num_accepted.tolist() == accepted
    assert result.next_tokens.tolist() == next_tokens


def test_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError):
        verify_greedy(T([1, 2]), T([1, 2]), [2])
    with pytest.raises(ValueError):
        verify_greedy(T([1]), T([1, 2]), [-1])
    with pytest.raises(ValueError, match="draft_tokens has 3 tokens"):
        verify_greedy(T([1, 2, 3]), T([1, 2, 3]), [2])


def _onehot(i, v=4):
    x = torch.zeros(v)
    x[i] = 1.0
    return x


def test_sampling_exact_cases():
    v = 4
    noise = torch.ones(3, v)
    # 1. drafter == target: always accepted whatever the uniform.
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 2)
    r = verify_sampling(T([2]), p[:1], p, [1], T([0.999]), noise[:1])
    assert r.num_accepted.tolist() == [1]
    # 2. target gives the draft token zero mass: always rejected; residual excludes the drafted token.
    q = _onehot(1)[None]
    pt = torch.stack([torch.tensor([0.5, 0.0, 0.5, 0.0]), _onehot(3)])
    r = verify_sampling(T([1]), q, pt, [1], T([0.0]), torch.tensor([[1.0, 1.0, 0.5, 1.0]]))
    assert r.num_accepted.tolist() == [0] and r.next_tokens.tolist() == [2]
    # 3. acceptance threshold is p/q: p(x)=0.2, q(x)=0.8 -> accept iff u < 0.25.
    q = torch.tensor([[0.8, 0.2, 0.0, 0.0]])
    pt = torch.stack([torch.tensor([0.2, 0.8, 0.0, 0.0]), _onehot(3)])
    assert verify_sampling(T([0]), q, pt, [1], T([0.24]), noise[:1]).num_accepted.tolist() == [1]
    r = verify_sampling(T([0]), q, pt, [1], T([0.26]), noise[:1])
    # Residual max(0, p - q) = [0, 0.6, 0, 0]: only token 1 can follow a rejection.
    assert r.num_accepted.tolist() == [0] and r.next_tokens.tolist() == [1]


def test_sampling_ragged_batch_equals_per_request():
    torch.manual_seed(1)
    v, counts = 6, [2, 0, 3]
    q = torch.softmax(torch.randn(sum(counts), v), -1)
    p = torch.softmax(torch.randn(sum(counts) + len(counts), v), -1)
    drafts = torch.multinomial(q, 1)[:, 0]
    u, e = torch.rand(sum(counts)), draw_exponentials((len(counts), v), None)
    batched = verify_sampling(drafts, q, p, counts, u, e)
    d_off, t_off = 0, 0
    for r, k in enumerate(counts):
        single = verify_sampling(drafts[d_off : d_off + k], q[d_off : d_off + k], p[t_off : t_off + k + 1], [k], u[d_off : d_off + k], e[r : r + 1])
        assert single.num_accepted.item() == batched.num_accepted[r].item()
        assert single.next_tokens.item() == batched.next_tokens[r].item()
        d_off, t_off = d_off + k, t_off + k + 1


def test_sampling_preserves_target_distribution_chi_square():
    """Joint law of the first two emitted tokens must equal the target's, whatever the drafter proposes.

    Tiny vocabulary; the target's second-token distribution depends on the first token, as in a real model.
    An off-by-one in the residual (using q of the wrong position) or a missing normalisation fails this.
    """
    g = torch.Generator().manual_seed(0)
    v, n = 4, 200_000
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p1 = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)  # p1[x0] = target's law after x0
    p2 = torch.softmax(torch.randn(v, v, v, generator=g), -1)
    q0 = torch.tensor([0.4, 0.3, 0.2, 0.1])  # deliberately far from the target
    q1 = torch.tensor([0.25, 0.05, 0.35, 0.35])
    d0 = torch.multinomial(q0, n, replacement=True, generator=g)
    d1 = torch.multinomial(q1, n, replacement=True, generator=g)  # block drafts are independent (DFlash)
    drafts = torch.stack([d0, d1], 1).reshape(-1)
    draft_probs = torch.stack([q0.expand(n, v), q1.expand(n, v)], 1).reshape(-1, v)
    target_probs = torch.stack([p0.expand(n, v), p1[d0], p2[d0, d1]], 1).reshape(-1, v)
    result = verify_sampling(
        drafts, draft_probs, target_probs, [2] * n, torch.rand(2 * n, generator=g), draw_exponentials((n, v), g)
    )
    acc, nxt = result.num_accepted, result.next_tokens
    first = torch.where(acc >= 1, d0, nxt)
    # The second emitted token exists when at least one draft was accepted (else it comes from the next step).
    has_second = acc >= 1
    second = torch.where(acc >= 2, d1, nxt)
    observed = torch.bincount(first, minlength=v).float()
    assert chisquare(observed.numpy(), (p0 * n).numpy()).pvalue > 1e-3
    joint = torch.bincount(first[has_second] * v + second[has_second], minlength=v * v).float()
    # Conditional on accepting d0=x0, the second token must follow p1[x0].
    for x0 in range(v):
        row = joint[x0 * v : (x0 + 1) * v]
        assert chisquare(row.numpy(), (p1[x0] * row.sum()).numpy()).pvalue > 1e-3


PROMPT = [3, 14, 15, 92, 65, 35]
# One line of the product's verify_sampling, and the faults put there (each a classic bug of rejection sampling).
RESIDUAL = "residual = (p_next - q_next * rejected[:, None].to(p_next.dtype)).clamp_min(0.0)"
ACCEPT = "accept = uniforms * q_x < p_x"
FAULTS = {
    "residual ignores q": (RESIDUAL, "residual = p_next"),
    "acceptance ignores q": (ACCEPT, "accept = uniforms < p_x"),
}


def _faulted_verify_sampling(line: str, fault: str):
    """The product's verify_sampling with `line` of its source replaced by `fault`, compiled in its module's
    namespace: the code under test is the product's, one line apart (a test of its own buggy copy would not be)."""
    source = textwrap.dedent(inspect.getsource(verify.verify_sampling))
    assert source.count(line) == 1, f"verify_sampling no longer has {line!r}: fault the line that replaced it"
    namespace = dict(vars(verify))
    exec(compile(source.replace(line, fault), verify.__file__, "exec"), namespace)
    return namespace["verify_sampling"]


def _law_pvalue(tiny_checkpoints, n: int = 1500) -> float:
    """The suite's sampling-law check (tests/helpers.py): sequences of 3 tokens, half through the reference loop and
    half through the batched engine, against the target's exact law; a scripted drafter mostly right, so drafts are
    both accepted and rejected."""
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = exact_joint(target, PROMPT, params, 3)
    proposer = ScriptedProposer(PROMPT + list(max(exact, key=exact.get)), TINY_VOCAB, corrupt_prob=0.3, seed=1)
    counts, requests = sampled_counts(target, proposer, PROMPT, params, exact, n)
    assert sum(sum(r.draft_lengths) for r in requests) > 0 and any(a > 1 for r in requests for a in r.accept_lengths)
    return law_pvalue(counts, exact)


def test_the_product_verifier_keeps_the_target_law(tiny_checkpoints):
    assert _law_pvalue(tiny_checkpoints) > 1e-3


@pytest.mark.parametrize("fault", FAULTS)
def test_the_law_check_has_power_against_a_faulty_product_verifier(tiny_checkpoints, monkeypatch, fault):
    """The same check, the same draws, with one line of the product's verifier faulted where the engine and the
    reference loop call it: rejected (the real one passes above)."""
    faulty = _faulted_verify_sampling(*FAULTS[fault])
    monkeypatch.setattr(engine_module, "verify_sampling", faulty)
    monkeypatch.setattr(reference, "verify_sampling", faulty)
    assert _law_pvalue(tiny_checkpoints) < 1e-6


def test_logits_to_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0)), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p=0.8: 0.5 + 0.3 reaches 0.8, so the tail goes.
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, top_p=0.8)), top2)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, top_p=0.81))[0, 2], torch.tensor(0.15 / 0.95))
    sharp = logits_to_probs(logits, SamplingParams(0.5))
    assert sharp[0, 0] > 0.5
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
