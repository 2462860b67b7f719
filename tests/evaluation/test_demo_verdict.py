"""`adaflash demo`'s verdict "outputs identical to AR" against an oracle from outside the demo: the target's greedy
continuation of each demo prompt by the reference AR loop, run here on a target of its own. The demo says yes exactly
when every variant's output is the oracle's; an injected fault (a verifier that accepts every draft, or one token
changed in one variant's output) makes it say NO and exit 1.

The drafter is scripted (tests/helpers.py `scripted_dflash`): mostly the oracle's tokens, 30% corrupted, so the
variants really draft, accept several tokens a pass and reject some - a yes over drafts that never ran, or that were
never wrong, would prove nothing (the fixed-length ones draft every step; the adaptive ones as this machine's
step times decide).
"""

from __future__ import annotations

import pytest

from adaflash.engine import engine as engine_module
from adaflash.evaluation import demo
from adaflash.pipeline import Pipeline
from adaflash.speculative import reference
from adaflash.speculative.draft_model import DraftModelProposer
from adaflash.speculative.reference import GenerationResult, autoregressive_generate
from adaflash.speculative.verify import verify_greedy
from tests.helpers import private_cache, scripted_dflash

NEW_TOKENS = 10
VARIANTS = ("ar", "dflash-full", "dflash-2", "dflash-adaptive", "dflash-adaptive-lookup")


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """The user cache the demo runs see (the step costs the adaptive policy learns stay here), shared by this file."""
    return private_cache(tmp_path_factory.mktemp("demo-cache"))


@pytest.fixture(scope="module")
def oracle(tiny_chat_checkpoint) -> dict[tuple[int, ...], list[int]]:
    """Demo prompt ids -> the target's greedy continuation (stopping where the demo's pipeline stops)."""
    pipeline = Pipeline.load(tiny_chat_checkpoint, None, "fp32")
    out = {}
    for _, text in demo.DEMO_PROMPTS:
        ids = pipeline.encode(messages=[{"role": "user", "content": text}])
        out[tuple(ids)] = autoregressive_generate(pipeline.target, ids, NEW_TOKENS,
                                                  stop_token_ids=pipeline.stop_token_ids).token_ids
    assert len(out) == len(demo.DEMO_PROMPTS) and all(out.values())
    return out


def _variant(pipeline: Pipeline, method: str) -> str:
    """Which of the demo's variants a generation is, told by the pipeline it runs on (demo.run_demo's table)."""
    if method == "ar":
        return "ar"
    if isinstance(pipeline.proposer, DraftModelProposer):
        return "draft-model"
    if pipeline.length_policy is None:
        return "dflash-full"
    if str(pipeline.length_policy) == "fixed:2":
        return "dflash-2"
    return "dflash-adaptive" if pipeline.prompt_lookup is None else "dflash-adaptive-lookup"


def _run_demo(checkpoint: str, oracle: dict, monkeypatch, capsys, cache, change=None, draft_model=None):
    """The demo (one round) over the scripted drafter; returns (exit code, printed verdict, every generation as
    (variant, prompt ids, result)). `change(variant, ids, token_ids)`: what the demo is handed instead of a result."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(cache))
    load = Pipeline.load

    def scripted_load(model, drafter, dtype, **kwargs):
        real = load(model, None, dtype, **kwargs)
        scripts = [list(ids) + tokens for ids, tokens in oracle.items()]
        return Pipeline(real.target, real.tokenizer, scripted_dflash(real.target, scripts, corrupt_prob=0.3),
                        real.model_name, real.length_policy)

    runs, generate = [], Pipeline.generate_ids

    def recorded(self, prompt_ids, method="ar", *args, **kwargs):
        result = generate(self, prompt_ids, method, *args, **kwargs)
        name = _variant(self, method)
        runs.append((name, tuple(prompt_ids), result))
        if change is not None:
            result = GenerationResult(change(name, tuple(prompt_ids), list(result.token_ids)), result.stats)
        return result

    monkeypatch.setattr(demo.Pipeline, "load", scripted_load)
    monkeypatch.setattr(Pipeline, "generate_ids", recorded)
    code = demo.run_demo(checkpoint, None, "fp32", NEW_TOKENS, rounds=1, draft_model=draft_model, draft_max=3)
    verdict = [line for line in capsys.readouterr().out.splitlines() if line.startswith("outputs identical to AR:")]
    assert len(verdict) == 1
    variants = VARIANTS + (("draft-model",) if draft_model else ())
    assert sorted((name, ids) for name, ids, _ in runs) == sorted((v, ids) for v in variants for ids in oracle)
    return code, verdict[0].rsplit(" ", 1)[1], runs


def _drafting_happened(runs) -> None:
    """Each fixed-length variant verified drafts, and some pass committed more than one token (the adaptive ones
    draft where this machine's step times say it pays: not a property of the code)."""
    for name in ("dflash-full", "dflash-2"):
        results = [r for n, _, r in runs if n == name]
        assert sum(r.stats.draft_tokens for r in results) > 0, name
        assert max(a for r in results for a in r.stats.accept_lengths) > 1, name


def test_the_demo_says_yes_when_every_output_is_the_oracles(tiny_chat_checkpoint, oracle, monkeypatch, capsys,
                                                              demo_cache):
    code, verdict, runs = _run_demo(tiny_chat_checkpoint, oracle, monkeypatch, capsys, demo_cache)
    assert all(result.token_ids == oracle[ids] for _, ids, result in runs)  # the oracle: all identical
    assert (code, verdict) == (0, "yes")
    _drafting_happened(runs)


def test_the_demo_with_a_draft_model_says_yes_and_a_changed_token_there_says_no(tiny_chat_checkpoint, oracle,
                                                                                 monkeypatch, capsys, demo_cache):
    """The draft-model variant (the target drafting for itself here: every draft right) is one more column the
    verdict covers."""
    code, verdict, runs = _run_demo(tiny_chat_checkpoint, oracle, monkeypatch, capsys, demo_cache,
                                    draft_model=tiny_chat_checkpoint)
    assert (code, verdict) == (0, "yes")
    assert all(result.token_ids == oracle[ids] for _, ids, result in runs)

    def change(name, ids, tokens):
        if name == "draft-model":
            tokens[-1] ^= 1
        return tokens

    code, verdict, _ = _run_demo(tiny_chat_checkpoint, oracle, monkeypatch, capsys, demo_cache, change,
                                 draft_model=tiny_chat_checkpoint)
    assert (code, verdict) == (1, "NO")


def test_a_verifier_that_accepts_every_draft_makes_the_demo_say_no(tiny_chat_checkpoint, oracle, monkeypatch,
                                                                  capsys, demo_cache):
    """The product's greedy verifier, faulted in both places it runs (engine and reference loop): each draft is
    judged against itself, so the scripted drafter's corrupted tokens are committed."""

    def accepts_every_draft(draft_tokens, target_argmax, num_draft):
        judged, d, t = target_argmax.clone(), 0, 0
        for k in num_draft:
            judged[t:t + k] = draft_tokens[d:d + k]  # the row after the drafts (the bonus) stays the target's
            d, t = d + k, t + k + 1
        return verify_greedy(draft_tokens, judged, num_draft)

    monkeypatch.setattr(engine_module, "verify_greedy", accepts_every_draft)
    monkeypatch.setattr(reference, "verify_greedy", accepts_every_draft)
    code, verdict, runs = _run_demo(tiny_chat_checkpoint, oracle, monkeypatch, capsys, demo_cache)
    wrong = {name for name, ids, result in runs if result.token_ids != oracle[ids]}
    assert {"dflash-full", "dflash-2"} <= wrong and "ar" not in wrong  # the fault reached the drafting variants'
    assert (code, verdict) == (1, "NO")


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_changed_token_in_any_variant_makes_the_demo_say_no(tiny_chat_checkpoint, oracle, monkeypatch, capsys,
                                                                 demo_cache, variant):
    """The last token of one variant's output on the last demo prompt, changed: every variant and prompt is
    compared, to the end of the output (the AR run's too: the others then differ from it)."""
    last = list(oracle)[-1]

    def change(name, ids, tokens):
        if (name, ids) == (variant, last):
            tokens[-1] ^= 1  # another id of the vocabulary (its size is even)
        return tokens

    code, verdict, _ = _run_demo(tiny_chat_checkpoint, oracle, monkeypatch, capsys, demo_cache, change)
    assert (code, verdict) == (1, "NO")

