"""Text in, text out: the codec the CLI and server share, which loop a method runs, and the flags it refuses."""

from __future__ import annotations

import pytest

from adaflash.cli import main
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.models.targets.text_codec import TextCodec
from adaflash.pipeline import Pipeline
from adaflash.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def pipeline(tiny_chat_checkpoint) -> Pipeline:
    return Pipeline.load(tiny_chat_checkpoint, None, "fp32").with_untrained_drafter(block_size=4)


def test_codec_raw_text_and_chat(pipeline):
    codec = TextCodec(pipeline.tokenizer, pipeline.target.config.eos_token_ids)
    assert codec.stop_token_ids == pipeline.stop_token_ids and set(pipeline.target.config.eos_token_ids) <= set(codec.stop_token_ids)
    raw = codec.encode(prompt="Hello there")
    chat = codec.encode(messages=[{"role": "user", "content": "Hello there"}])
    assert len(chat) > len(raw) and codec.decode(raw) == "Hello there"
    assert pipeline.encode(prompt="Hello there") == raw
    for kwargs, message in [({}, "exactly one"), ({"prompt": "a", "messages": []}, "exactly one"),
                            ({"messages": []}, "empty")]:
        with pytest.raises(ValueError, match=message):
            codec.encode(**kwargs)


def test_a_generation_runs_the_config_its_method_and_the_pipeline_make(pipeline):
    """The pipeline's length policy is the drafting methods': ar, the reference, runs plain under it."""
    engine = pipeline.with_length_policy("fixed:2")
    assert engine.speculative("ar") == SpeculativeConfig.of("ar")
    assert engine.speculative("dflash") == SpeculativeConfig.of("dflash", "fixed:2")
    assert pipeline.speculative("dflash", 3).draft_length == 3 and not pipeline.speculative("dflash").runs_on_engine
    assert pipeline.speculative("adaflash").runs_on_engine  # its policy: adaflash
    with pytest.raises(ValueError, match="carries its own draft_length"):
        pipeline.generate_ids([1, 2], SpeculativeConfig.of("dflash"), draft_length=2)


def test_every_path_reproduces_ar(pipeline):
    ids = pipeline.encode(messages=[{"role": "user", "content": "Count to five"}])
    ar = pipeline.generate_ids(ids, "ar", max_new_tokens=12)
    reference = pipeline.generate_ids(ids, "dflash", max_new_tokens=12, draft_length=2)
    assert reference.token_ids == ar.token_ids and max(reference.stats.draft_lengths) <= 2
    engine = pipeline.with_length_policy("fixed:1")
    on_engine = engine.generate_ids(ids, "dflash", max_new_tokens=12)
    assert on_engine.token_ids == ar.token_ids and set(on_engine.stats.draft_lengths) <= {0, 1}
    completion = engine.complete(ids, "dflash", max_new_tokens=12)
    assert completion.token_ids == ar.token_ids and completion.method == "dflash"
    assert completion.as_dict()["num_tokens"] == len(ar.token_ids) and completion.text == pipeline.decode(ar.token_ids)


def test_prompt_lookup_paths_reproduce_ar(pipeline):
    from adaflash.speculative.prompt_lookup import PromptLookup

    first = pipeline.encode(prompt="hi")
    ids = first + pipeline.generate_ids(first, "ar", max_new_tokens=12).token_ids + first  # lookups will match
    ar = pipeline.generate_ids(ids, "ar", max_new_tokens=24)
    lookup = pipeline.with_prompt_lookup(PromptLookup(4, min_ngram=1))
    assert lookup.speculative("ar").runs_on_engine
    for method, policy in [("ar", None), ("dflash", None), ("dflash", "fixed:2")]:
        out = lookup.with_length_policy(policy).generate_ids(ids, method, max_new_tokens=24)
        assert out.token_ids == ar.token_ids, (method, policy)
        # Adaptive lookups open with the drafting check's plain steps, past these matches (their drafts:
        # tests/engine/test_engine_prompt_lookup.py); fixed:2 runs no check and drafts from the first step.
        assert sum(out.stats.draft_lengths) > 0 or policy is None
    with pytest.raises(ValueError, match="with --prompt-lookup the serving engine runs"):
        lookup.generate_ids(ids, "dflash", max_new_tokens=4, draft_length=2)


def test_engine_paths_refuse_a_draft_length(pipeline):
    ids = pipeline.encode(prompt="hi")
    with pytest.raises(ValueError, match="--draft-length applies to the reference loop"):
        pipeline.with_length_policy("fixed:1").generate_ids(ids, "dflash", max_new_tokens=4, draft_length=2)


def test_refusals(pipeline, tiny_chat_checkpoint):
    ids = pipeline.encode(prompt="hi")
    with pytest.raises(ValueError, match="unknown method"):
        pipeline.generate_ids(ids, "beam")
    plain = Pipeline.load(tiny_chat_checkpoint, None, "fp32")
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.generate_ids(ids, "dflash")
    with pytest.raises(ValueError, match="length head"):
        pipeline.generate_ids(ids, "adaflash")  # an untrained drafter carries no head
    with pytest.raises(ValueError, match="unknown length policy"):  # before looking for the model at all
        Pipeline.load("/nonexistent/model", None, "fp32", length_policy="fastest")


def test_generate_cli_reports_an_ignored_draft_length(tiny_chat_checkpoint, tmp_path, capsys):
    from adaflash.models.targets.config import TransformerConfig
    from adaflash.models.drafters.config import DrafterConfig
    from adaflash.models.drafters.checkpoint import init_drafter, save_drafter

    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1,
                                   block_size=4)
    drafter = save_drafter(init_drafter(cfg, seed=3), tmp_path / "drafter")
    rc = main(["generate", "--prompt", "hi", "--model", tiny_chat_checkpoint, "--method", "dflash", "--drafter",
               str(drafter), "--length-policy", "fixed:2", "--draft-length", "3", "--max-new-tokens", "4"])
    assert rc == 2 and "--draft-length applies to the reference loop" in capsys.readouterr().err


def test_a_learning_policy_starts_fresh_per_generation_unless_told_to_carry(pipeline):
    """throughput's shared acceptance estimate adapts across requests; a benchmark's prompts must not see each
    other's (order-independent results) unless --carry-policy-state asks for the server's behaviour."""
    prompts = [pipeline.encode(prompt=p) for p in ("Count to five", "Name a colour", "Say hello")]

    def lengths(p, order):
        return {i: p.generate_ids(prompts[i], "dflash", max_new_tokens=10).stats.draft_lengths for i in order}

    # throughput-profiled: the same acceptance estimate on the profile alone. throughput's lengths also follow the
    # measured step times (its calibration), which no two runs share exactly.
    profiled = pipeline.with_length_policy("throughput-profiled", carry_policy_state=False)
    forward, backward = lengths(profiled, [0, 1, 2]), lengths(profiled, [2, 1, 0])
    assert forward == backward
    fresh = pipeline.with_length_policy("throughput", carry_policy_state=False)
    carried = pipeline.with_length_policy("throughput", carry_policy_state=True)
    carried.generate_ids(prompts[0], "dflash", max_new_tokens=10)
    learned = carried._policy
    learned.shared_successes, learned.shared_trials = 1.0, 20.0  # as if the first prompt had taught it that this drafter is poor...
    carried.generate_ids(prompts[1], "dflash", max_new_tokens=10)
    assert carried._policy is learned  # ...the next prompt starts from it
    fresh.generate_ids(prompts[0], "dflash", max_new_tokens=10)
    first = fresh._policy
    fresh.generate_ids(prompts[1], "dflash", max_new_tokens=10)
    assert fresh._policy is not first  # a fresh policy for every generation...
    assert fresh._policy.step_cost is first.step_cost  # ...that keeps what the step times taught of this machine


def test_with_drafter_puts_another_checkpoint_over_the_same_loaded_target(tiny_chat_checkpoint, tmp_path):
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1,
                                   block_size=4)
    path = save_drafter(init_drafter(cfg, seed=5), tmp_path / "drafter")
    plain = Pipeline.load(tiny_chat_checkpoint, None, "fp32", length_policy="fixed:2")
    other = plain.with_drafter(path)
    assert other.target is plain.target and other.proposer is not None and other.length_policy == plain.length_policy
    ids = plain.encode(prompt="hi")
    drafted = other.generate_ids(ids, "dflash", max_new_tokens=8)
    assert drafted.token_ids == plain.generate_ids(ids, "ar", max_new_tokens=8).token_ids
