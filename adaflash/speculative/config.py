"""What a run speculates with, parsed and checked in one place: `SpeculativeConfig` (the method, its length policy, the
reference loop's draft length and prompt lookup) and `LengthPolicySpec` (a typed `--length-policy`).

Every command and the server build one from their flags (`SpeculativeConfig.parse`) before any model loads; the
pipeline, the engine factory and the evaluations read its fields and never re-check a flag.

`--method adaflash` is shorthand, expanded by `SpeculativeConfig.of` and nowhere else: DFlash decoding (`dflash`) with
the AdaFlash drafter (the distilled one that carries the length head) under the `adaflash` length policy, unless
--length-policy names another. Downstream, a config's `method` is `ar` or `dflash`; `name` keeps the user's spelling
for labels and reports only. `adaflash` as a length policy is the policy itself, on any drafter that carries a head.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NamedTuple

from adaflash.speculative.prompt_lookup import PromptLookup

# ---- length policies -------------------------------------------------------------------------------

FIXED = "fixed"  # fixed:K, the one policy with a parameter
# ema-budget: SGLang's batch-level EMA length; adaflash-gated: adaflash behind the release's >48-requests gate
# (speculative/batch_length.py).
ADAPTIVE_POLICIES = ("heuristic", "throughput", "throughput-profiled", "adaflash", "block-head", "ema-budget",
                     "adaflash-gated")
COST_MODEL_POLICIES = ("throughput", "throughput-profiled", "adaflash", "adaflash-gated")  # read the profiled cost model
LENGTH_HEAD_POLICIES = ("adaflash", "block-head", "adaflash-gated")  # read the drafter checkpoint's learned length head
POLICY_FORMS = "fixed:K, heuristic, throughput, throughput-profiled, adaflash, block-head, ema-budget or adaflash-gated"


@dataclass(frozen=True)
class LengthPolicySpec:
    """A `--length-policy` value: `fixed:K` (name `fixed`, `length` K) or one of `ADAPTIVE_POLICIES` (no length).
    `str()` gives the spelling back, which is also the built policy's name in logs and metrics."""

    name: str
    length: int | None = None

    def __post_init__(self) -> None:
        if self.name == FIXED:
            if not isinstance(self.length, int) or isinstance(self.length, bool):
                raise ValueError(f"length policy fixed:K needs a whole number K, got {self.length!r}")
            if self.length < 0:
                raise ValueError(f"fixed length must be >= 0, got {self.length}")
        elif self.name not in ADAPTIVE_POLICIES:
            raise ValueError(f"unknown length policy {self.name!r}; expected {POLICY_FORMS}")
        elif self.length is not None:
            raise ValueError(f"length policy {self.name} takes no length, got {self.name}:{self.length}")

    @classmethod
    def parse(cls, text: str) -> LengthPolicySpec:
        name, colon, k = text.strip().partition(":")
        if name == FIXED:
            try:
                length = int(k)
            except ValueError:
                raise ValueError(f"length policy fixed:K needs a whole number K, got {text!r}") from None
            return cls(FIXED, length)
        if colon or name not in ADAPTIVE_POLICIES:
            raise ValueError(f"unknown length policy {text!r}; expected {POLICY_FORMS}")
        return cls(name)

    def __str__(self) -> str:
        return f"{FIXED}:{self.length}" if self.name == FIXED else self.name

    @property
    def needs_cost_model(self) -> bool:
        return self.name in COST_MODEL_POLICIES

    @property
    def needs_length_head(self) -> bool:
        return self.name in LENGTH_HEAD_POLICIES


def length_policy_of(value: str | LengthPolicySpec | None) -> LengthPolicySpec | None:
    """A spec from its spelling (a library caller's "fixed:3"); a spec or None as is."""
    return LengthPolicySpec.parse(value) if isinstance(value, str) else value


# What a DFlash engine runs when no --length-policy is given (`serve`'s default; a pipeline runs the reference loop).
ENGINE_DEFAULT_POLICY = LengthPolicySpec("throughput")

# ---- methods ---------------------------------------------------------------------------------------

AR, DFLASH = "ar", "dflash"  # the canonical methods: plain decoding, or a block drafter proposes


class _Expansion(NamedTuple):
    method: str  # canonical
    drafter: str | None  # the shipped drafter --drafter defaults to (models/targets/registry.py keys), None: no drafter
    length_policy: LengthPolicySpec | None  # the default when --length-policy is not given


# The methods as users name them (--method), each with what it means. The only place `adaflash` is a method.
METHOD_EXPANSIONS: dict[str, _Expansion] = {
    "ar": _Expansion(AR, None, None),
    "dflash": _Expansion(DFLASH, "dflash", None),
    "adaflash": _Expansion(DFLASH, "adaflash", LengthPolicySpec("adaflash")),
}
METHODS = tuple(METHOD_EXPANSIONS)
DRAFTER_KINDS = ("dflash", "adaflash")  # the shipped drafters, by what trained them
ADAFLASH_DRAFTER = "adaflash"  # the one carrying the length head (distilled from the DFlash one)

_FIXED_HINT = "(for a fixed draft length on the engine use --length-policy fixed:K)"


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one run decodes, in canonical form (see the module docstring). Made with `of` or `parse`; checked here.

    - method: `ar` (plain decoding) or `dflash` (a block drafter proposes).
    - drafter: which shipped drafter `--drafter` defaults to (`dflash`, `adaflash`); None with `ar`.
    - length_policy: None runs the single-request reference loop (`dflash`; `serve` has no such loop and runs
      `engine_policy`); a spec runs the serving engine under that policy.
    - draft_length: the reference loop's drafts per step (None: the whole block); nowhere else.
    - prompt_lookup: n-gram drafts first, on the engine (with `ar` the only drafts); None: off.
    - name: the method as the user named it (`adaflash` stays `adaflash`): labels, reports and messages only.
    """

    method: str = AR
    drafter: str | None = None
    length_policy: LengthPolicySpec | None = None
    draft_length: int | None = None
    prompt_lookup: PromptLookup | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.method not in (AR, DFLASH):
            hint = f"; {self.method!r} is shorthand, use SpeculativeConfig.of" if self.method in METHODS else ""
            raise ValueError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}{hint}")
        if not self.name:
            object.__setattr__(self, "name", self.method)  # frozen: the one default derived from another field
        if self.method == AR:
            if self.drafter is not None:
                raise ValueError(f"--method ar decodes without a drafter, got drafter {self.drafter!r}")
            if self.length_policy is not None:
                raise ValueError("--length-policy applies to --method dflash or adaflash only (--method ar has no "
                                 "drafter; prompt-lookup drafts are sized by --prompt-lookup-length)")
        elif self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"--method {self.name} needs a drafter kind, one of {', '.join(DRAFTER_KINDS)}; "
                             f"got {self.drafter!r}")
        if self.length_policy is not None and not isinstance(self.length_policy, LengthPolicySpec):
            raise TypeError(f"length_policy must be a LengthPolicySpec (length_policy_of parses a string), "
                            f"got {self.length_policy!r}")
        if self.draft_length is not None:
            self._check_draft_length()

    def _check_draft_length(self) -> None:
        """--draft-length is honoured by the reference loop only; on the engine it would be silently ignored."""
        where = ("--draft-length applies to the reference loop (--method dflash without --length-policy or "
                 "--prompt-lookup)")
        if self.draft_length < 1:
            raise ValueError(f"--draft-length must be >= 1, got {self.draft_length}")
        if self.method == AR:
            raise ValueError(f"{where}; --method ar drafts nothing with a drafter")
        if self.prompt_lookup is not None:
            raise ValueError(f"{where}; with --prompt-lookup the serving engine runs {_FIXED_HINT}")
        if self.length_policy is not None:
            raise ValueError(f"{where}; --method {self.name} runs the {self.length_policy} length policy on the "
                             f"serving engine, which picks the draft lengths {_FIXED_HINT}")

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def of(cls, method: str, length_policy: str | LengthPolicySpec | None = None, draft_length: int | None = None,
           prompt_lookup: PromptLookup | None = None) -> SpeculativeConfig:
        """`method` as users name it (METHODS), expanded; `length_policy` overrides the method's default."""
        if method not in METHOD_EXPANSIONS:
            raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
        canonical, drafter, default_policy = METHOD_EXPANSIONS[method]
        policy = length_policy_of(length_policy)
        return cls(canonical, drafter, default_policy if policy is None else policy, draft_length, prompt_lookup,
                   name=method)

    @classmethod
    def among(cls, method: str, length_policy: str | LengthPolicySpec | None = None, draft_length: int | None = None,
              prompt_lookup: PromptLookup | None = None) -> SpeculativeConfig:
        """`method` as one of several run under the same flags (bench offline's --methods, eval tau, a pipeline's
        generations): the length policy and draft length are the drafter's, so `ar`, the reference every comparison
        runs, runs without them instead of refusing them."""
        if cls.of(method).method == AR:
            length_policy, draft_length = None, None
        return cls.of(method, length_policy, draft_length, prompt_lookup)

    @classmethod
    def parse(cls, args: argparse.Namespace) -> SpeculativeConfig:
        """From the parsed flags of a command that runs one --method (a flag it lacks counts as not given; commands
        that compare several methods make each with `among`)."""
        return cls.of(args.method, getattr(args, "length_policy", None), getattr(args, "draft_length", None),
                      prompt_lookup_of(args))

    # ---- what it runs ------------------------------------------------------------------------------

    @property
    def uses_drafter(self) -> bool:
        return self.method == DFLASH

    @property
    def runs_on_engine(self) -> bool:
        """A length policy decides the drafts, or prompt lookup drafts: the serving engine (at batch 1 in a
        pipeline); else a single-request reference loop."""
        return self.length_policy is not None or self.prompt_lookup is not None

    @property
    def adaptive(self) -> bool:
        """Drafts are sized to what pays (an adaptive length policy, or prompt lookups sized by throughput): the
        engine runs its draft sources behind the drafting check (speculative/drafting_check.py). `fixed:K` stays
        fixed, lookups included."""
        policy = self.engine_policy
        if policy is not None:
            return policy.name != FIXED
        return self.prompt_lookup is not None and self.prompt_lookup.length == "throughput"

    @property
    def engine_policy(self) -> LengthPolicySpec | None:
        """The length policy an engine runs for this config (None: nothing drafts with a drafter)."""
        if not self.uses_drafter:
            return None
        return self.length_policy or ENGINE_DEFAULT_POLICY


def draft_model_of(args: argparse.Namespace, config: SpeculativeConfig) -> str | None:
    """--draft-model, where the config drafts (a draft model with --method ar would be loaded for nothing: refused)."""
    model = getattr(args, "draft_model", None)
    if model is not None and not config.uses_drafter:
        raise ValueError(f"--draft-model drafts for --method dflash; --method {config.name} drafts with no model")
    return model


def prompt_lookup_of(args: argparse.Namespace) -> PromptLookup | None:
    """The `PromptLookup` that --prompt-lookup (and --prompt-lookup-length) ask for; None: off."""
    tokens, length = getattr(args, "prompt_lookup", None), getattr(args, "prompt_lookup_length", None)
    if tokens is None:
        if length is not None:
            raise ValueError("--prompt-lookup-length applies with --prompt-lookup K only")
        return None
    try:
        return PromptLookup(tokens) if length is None else PromptLookup(tokens, length=length)
    except ValueError as exc:  # name the flag: the dataclass speaks of its fields
        raise ValueError(f"--prompt-lookup: {exc}") from None


def shared_drafter(configs: list[SpeculativeConfig] | tuple[SpeculativeConfig, ...]) -> str | None:
    """The shipped drafter one loaded model serves several configs with: the AdaFlash one where any wants it (it
    carries the length head; DFlash rows then measure it too, DFlash + RKL), else the one they want; None: none."""
    kinds = [c.drafter for c in configs if c.drafter is not None]
    return ADAFLASH_DRAFTER if ADAFLASH_DRAFTER in kinds else (kinds[-1] if kinds else None)
