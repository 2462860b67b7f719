"""`SpeculativeConfig` and `LengthPolicySpec`: every valid form, every refusal with its message, the `adaflash`
expansion, and the commands refusing a bad combination before any model loads."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from adaflash.speculative.config import (
    ADAPTIVE_POLICIES,
    METHODS,
    LengthPolicySpec,
    SpeculativeConfig,
    length_policy_of,
    shared_drafter,
)
from adaflash.speculative.prompt_lookup import PromptLookup

# ---- length policies -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, spec", [
    ("fixed:0", LengthPolicySpec("fixed", 0)),
    ("fixed:15", LengthPolicySpec("fixed", 15)),
    *[(name, LengthPolicySpec(name)) for name in ADAPTIVE_POLICIES],
])
def test_length_policy_specs_parse_and_print_back(text, spec):
    assert LengthPolicySpec.parse(text) == spec and str(spec) == text
    assert length_policy_of(text) == spec and length_policy_of(spec) is spec and length_policy_of(None) is None


def test_what_each_length_policy_needs():
    needs = {name: (LengthPolicySpec(name).needs_cost_model, LengthPolicySpec(name).needs_length_head)
             for name in ADAPTIVE_POLICIES}
    assert needs == {"heuristic": (False, False), "throughput": (True, False), "throughput-profiled": (True, False),
                     "adaflash": (True, True), "block-head": (False, True), "ema-budget": (False, False),
                     "adaflash-gated": (True, True)}
    assert not LengthPolicySpec("fixed", 3).needs_cost_model and not LengthPolicySpec("fixed", 3).needs_length_head


@pytest.mark.parametrize("text, message", [
    ("fastest", "unknown length policy 'fastest'; expected fixed:K, heuristic, throughput"),
    ("", "unknown length policy ''"),
    ("heuristic:3", "unknown length policy 'heuristic:3'"),
    ("fixed", "fixed:K needs a whole number K, got 'fixed'"),
    ("fixed:two", "fixed:K needs a whole number K, got 'fixed:two'"),
    ("fixed:2.5", "fixed:K needs a whole number K"),
    ("fixed:-1", "fixed length must be >= 0, got -1"),
])
def test_bad_length_policy_texts_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        LengthPolicySpec.parse(text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="fastest"), "unknown length policy 'fastest'"),
    (dict(name="fixed"), "fixed:K needs a whole number K, got None"),
    (dict(name="fixed", length=True), "fixed:K needs a whole number K"),
    (dict(name="heuristic", length=3), "heuristic takes no length, got heuristic:3"),
])
def test_bad_length_policy_specs_are_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LengthPolicySpec(**kwargs)


# ---- methods ---------------------------------------------------------------------------------------


def test_each_method_in_canonical_form():
    ar, dflash, adaflash = (SpeculativeConfig.of(m) for m in ("ar", "dflash", "adaflash"))
    assert ar == SpeculativeConfig() and (ar.method, ar.drafter, ar.name) == ("ar", None, "ar")
    assert not ar.uses_drafter and not ar.runs_on_engine and ar.engine_policy is None
    assert (dflash.method, dflash.drafter, dflash.length_policy, dflash.name) == ("dflash", "dflash", None, "dflash")
    assert dflash.uses_drafter and not dflash.runs_on_engine  # the reference loop...
    assert dflash.engine_policy == LengthPolicySpec("throughput")  # ...or, on an engine (serve), throughput
    assert set(METHODS) == {"ar", "dflash", "adaflash"}


def test_adaflash_is_dflash_with_the_adaflash_drafter_and_policy():
    adaflash = SpeculativeConfig.of("adaflash")
    assert adaflash == SpeculativeConfig("dflash", "adaflash", LengthPolicySpec("adaflash"), name="adaflash")
    assert adaflash.method == "dflash" and adaflash.runs_on_engine
    assert adaflash.engine_policy == LengthPolicySpec("adaflash")
    overridden = SpeculativeConfig.of("adaflash", "fixed:3")  # --length-policy wins; the drafter stays
    assert (overridden.drafter, str(overridden.length_policy), overridden.name) == ("adaflash", "fixed:3", "adaflash")
    # the policy alone, on the DFlash method: the same policy, not the shorthand
    policy_only = SpeculativeConfig.of("dflash", "adaflash")
    assert policy_only.length_policy == adaflash.length_policy and policy_only.drafter == "dflash"


def test_valid_combinations():
    lookup = PromptLookup(4)
    assert SpeculativeConfig.of("dflash", draft_length=3).draft_length == 3  # the reference loop honours it
    on_engine = SpeculativeConfig.of("dflash", LengthPolicySpec("fixed", 2))
    assert on_engine.runs_on_engine and on_engine.engine_policy == LengthPolicySpec("fixed", 2)
    ar_lookup = SpeculativeConfig.of("ar", prompt_lookup=lookup)
    assert ar_lookup.runs_on_engine and not ar_lookup.uses_drafter and ar_lookup.engine_policy is None
    dflash_lookup = SpeculativeConfig.of("dflash", prompt_lookup=lookup)
    assert dflash_lookup.runs_on_engine and dflash_lookup.engine_policy == LengthPolicySpec("throughput")


@pytest.mark.parametrize("args, message", [
    (("beam",), "unknown method 'beam'; expected one of ar, dflash, adaflash"),
    (("ar", "heuristic"), "--length-policy applies to --method dflash or adaflash only"),
    (("ar", "fastest"), "unknown length policy 'fastest'"),
    (("ar", None, 3), "--draft-length applies to the reference loop .*; --method ar drafts nothing"),
    (("dflash", None, 0), "--draft-length must be >= 1, got 0"),
    (("dflash", "fixed:2", 3), "--method dflash runs the fixed:2 length policy on the serving engine"),
    (("adaflash", None, 3), "--method adaflash runs the adaflash length policy on the serving engine"),
    (("dflash", None, 3, PromptLookup(4)), "with --prompt-lookup the serving engine runs"),
])
def test_refused_combinations_name_the_flag(args, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of(*args)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(method="adaflash"), ValueError, "'adaflash' is shorthand, use SpeculativeConfig.of"),
    (dict(method="beam"), ValueError, "unknown method 'beam'"),
    (dict(method="dflash"), ValueError, "needs a drafter kind, one of dflash, adaflash; got None"),
    (dict(method="dflash", drafter="medusa"), ValueError, "needs a drafter kind"),
    (dict(method="ar", drafter="dflash"), ValueError, "--method ar decodes without a drafter"),
    (dict(method="dflash", drafter="dflash", length_policy="fixed:2"), TypeError, "must be a LengthPolicySpec"),
])
def test_a_non_canonical_config_is_refused_when_made(kwargs, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig(**kwargs)


def test_configs_are_frozen_and_comparable():
    config = SpeculativeConfig.of("dflash", "fixed:2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "ar"
    assert config == SpeculativeConfig.of("dflash", LengthPolicySpec("fixed", 2)) and hash(config) == hash(
        SpeculativeConfig.of("dflash", "fixed:2"))


def test_among_other_methods_ar_runs_plain():
    """bench offline / eval tau / a pipeline: one --length-policy and --draft-length for every method; ar, the
    reference, runs without them instead of refusing them."""
    assert SpeculativeConfig.among("ar", "fixed:2", 3) == SpeculativeConfig.of("ar")
    lookup = PromptLookup(4)
    with_lookup = SpeculativeConfig.among("ar", "fixed:2", prompt_lookup=lookup)
    assert with_lookup == SpeculativeConfig.of("ar", prompt_lookup=lookup)
    assert SpeculativeConfig.among("dflash", None, 3).draft_length == 3
    with pytest.raises(ValueError, match="--method adaflash runs the adaflash length policy"):
        SpeculativeConfig.among("adaflash", None, 3)


def test_shared_drafter_prefers_the_one_with_the_head():
    configs = [SpeculativeConfig.of(m) for m in ("ar", "dflash", "adaflash")]
    assert shared_drafter(configs) == "adaflash" and shared_drafter(configs[:2]) == "dflash"
    assert shared_drafter(configs[:1]) is None


# ---- from the command line -------------------------------------------------------------------------


def _namespace(**flags) -> argparse.Namespace:
    return argparse.Namespace(**flags)


def test_parse_reads_a_commands_flags_and_skips_those_it_lacks():
    generate = _namespace(method="dflash", length_policy=None, draft_length=4, prompt_lookup=None,
                          prompt_lookup_length=None)
    assert SpeculativeConfig.parse(generate) == SpeculativeConfig.of("dflash", draft_length=4)
    serve = _namespace(method="adaflash", length_policy="heuristic", prompt_lookup=5, prompt_lookup_length="all")
    assert SpeculativeConfig.parse(serve) == SpeculativeConfig.of("adaflash", "heuristic",
                                                                  prompt_lookup=PromptLookup(5, length="all"))
    assert SpeculativeConfig.parse(_namespace(method="ar", prompt_lookup=3)).prompt_lookup == PromptLookup(3)


@pytest.mark.parametrize("flags, message", [
    (dict(prompt_lookup=0), "--prompt-lookup: prompt lookup needs 1 <= num_tokens <= 15, got 0"),
    (dict(prompt_lookup=16), "--prompt-lookup: .*got 16"),
    (dict(prompt_lookup_length="all"), "--prompt-lookup-length applies with --prompt-lookup K only"),
])
def test_parse_refuses_bad_prompt_lookup_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(_namespace(method="ar", **flags))


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--method", "ar", "--length-policy", "heuristic"],
     "--length-policy applies to --method dflash or adaflash only"),
    (["generate", "--prompt", "x", "--method", "ar", "--draft-length", "3"], "--method ar drafts nothing"),
    (["generate", "--prompt", "x", "--method", "adaflash", "--draft-length", "3"],
     "--method adaflash runs the adaflash length policy"),
    (["generate", "--prompt", "x", "--prompt-lookup-length", "all"], "--prompt-lookup-length applies"),
    (["serve", "--method", "ar", "--length-policy", "heuristic"], "--length-policy applies to --method dflash"),
    (["serve", "--length-policy", "fixed:x"], "fixed:K needs a whole number K, got 'fixed:x'"),
    (["serve", "--prompt-lookup", "0"], "--prompt-lookup: prompt lookup needs 1 <= num_tokens"),
    (["bench", "offline", "--dataset", "gsm8k", "--methods", "ar,dflash", "--length-policy", "fixed:2",
      "--draft-length", "3"], "--method dflash runs the fixed:2 length policy"),
    (["bench", "offline", "--dataset", "gsm8k", "--methods", "ar,adaflash", "--draft-length", "3"],
     "--method adaflash runs the adaflash length policy"),
    (["eval", "tau", "--length-policy", "heuristic", "--draft-length", "3"], "runs the heuristic length policy"),
])
def test_commands_refuse_before_any_model_loads(argv, message, tmp_path, capsys):
    from adaflash.cli import main

    missing = str(tmp_path / "no-model")  # loading it would fail with "unknown model", not this message
    assert main([*argv, "--model", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.split(".*")[0] in err and "unknown model" not in err
