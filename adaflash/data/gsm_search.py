"""Uniform sampling of the constrained variables of a GSM-Symbolic template.

Constrained variables must jointly satisfy the template's conditions, e.g. `divides(k*y, 12)`. They are
drawn uniformly among the valid combinations (as the package does) by one of two exact methods, chosen
once per template from a probe with a private fixed-seed RNG, so that the choice (and hence the output
for a given seed) never depends on what was drawn before:
- rejection sampling when at least `MIN_ACCEPTANCE` of random combinations are valid (large valid
  sets, where listing them all would be slow);
- otherwise a depth-first search that lists all valid combinations once, binding the lines in the
  order that minimises the expected search size and checking each condition as soon as its variables
  are bound; then a uniform pick from that list.
"""

from __future__ import annotations

import ast
import math
from random import Random
from typing import Any

from adaflash.data.gsm_expr import CHOICE_HELPERS, SafeExpr, TemplateError

PROBE_DRAWS = 1000  # random combinations tried once per template, to estimate pass rates
MIN_ACCEPTANCE = 0.005  # from this acceptance rate up, draw by rejection instead of enumerating
REJECTION_TRIES = 20_000  # per draw (expected tries <= 1 / MIN_ACCEPTANCE); then fall back to the list
MAX_VISITS = 3_000_000  # search bound per template; a template needing more is skipped

Domain = list[dict[str, Any]]  # the possible bindings of one init line, e.g. [{"x": 10}, {"x": 20}]


def conjuncts(condition: str) -> list[SafeExpr]:
    """Split `a and b` and `x < y < z` into separate checks, so each can prune as early as possible."""
    SafeExpr(condition)  # validate the whole condition before taking it apart
    node = ast.parse(condition.strip(), mode="eval").body
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [part for value in node.values for part in conjuncts(ast.unparse(value))]
    if isinstance(node, ast.Compare) and len(node.ops) > 1:
        operands = [node.left, *node.comparators]
        pairs = [ast.Compare(operands[i], [op], [operands[i + 1]]) for i, op in enumerate(node.ops)]
        return [SafeExpr(ast.unparse(pair)) for pair in pairs]
    return [SafeExpr(condition)]


def holds(check: SafeExpr, env: dict[str, Any]) -> bool:
    try:
        return bool(check(env))
    except (ZeroDivisionError, TypeError, ValueError, OverflowError):
        return False  # e.g. a division by a zero-valued candidate: that combination is invalid


class JointSampler:
    """Draws assignments of the constrained lines uniformly among those passing every condition."""

    def __init__(self, domains: list[Domain], conditions: list[str]):
        checks = [c for cond in conditions for c in conjuncts(cond)]
        pass_counts, accepted = _probe(domains, checks)
        order, per_depth = _plan(domains, checks, pass_counts)
        self._domains = [domains[i] for i in order]
        self._names = [k for domain in self._domains for k in domain[0]]
        # One compiled conjunction per depth: far cheaper than one call per check in the search loop.
        self._depth_checks = [SafeExpr(" and ".join(f"({c.source})" for c in cs)) if cs else None for cs in per_depth]
        self._all_checks = [c for c in self._depth_checks if c is not None]
        self._reject = bool(domains) and accepted >= MIN_ACCEPTANCE * PROBE_DRAWS
        self._valid: list[dict[str, Any]] | None = None

    def draw(self, rng: Random) -> dict[str, Any]:
        if not self._domains:
            return {}
        if self._reject:
            for _ in range(REJECTION_TRIES):
                env = {**CHOICE_HELPERS, **{k: v for d in self._domains for k, v in rng.choice(d).items()}}
                if all(holds(c, env) for c in self._all_checks):
                    return {k: env[k] for k in self._names}
            # A very unlikely unlucky streak: fall back to the exact list (still uniform).
        return dict(rng.choice(self.valid_combinations()))

    def valid_combinations(self) -> list[dict[str, Any]]:
        if self._valid is None:
            self._valid = self._search()
            if not self._valid:
                raise TemplateError("no combination satisfies the conditions")
        return self._valid

    def _search(self) -> list[dict[str, Any]]:
        valid: list[dict[str, Any]] = []
        env: dict[str, Any] = dict(CHOICE_HELPERS)
        last = len(self._domains) - 1
        visits = 0

        def descend(depth: int) -> None:
            nonlocal visits
            domain, check = self._domains[depth], self._depth_checks[depth]
            visits += len(domain)
            if visits > MAX_VISITS:
                raise TemplateError(f"more than {MAX_VISITS} partial combinations to search")
            for binding in domain:
                env.update(binding)
                if check is None or holds(check, env):
                    if depth == last:
                        valid.append({k: env[k] for k in self._names})
                    else:
                        descend(depth + 1)

        descend(0)
        return valid


def _probe(domains: list[Domain], checks: list[SafeExpr]) -> tuple[list[int], int]:
    """Pass count of each check, and of all checks together, over random combinations (fixed seed)."""
    rng = Random(0)
    pass_counts = [0] * len(checks)
    accepted = 0
    for _ in range(PROBE_DRAWS if domains else 0):
        env = {**CHOICE_HELPERS, **{k: v for d in domains for k, v in rng.choice(d).items()}}
        passed = [holds(c, env) for c in checks]
        pass_counts = [n + p for n, p in zip(pass_counts, passed, strict=True)]
        accepted += all(passed)
    return pass_counts, accepted


def _plan(
    domains: list[Domain], checks: list[SafeExpr], pass_counts: list[int]
) -> tuple[list[int], list[list[SafeExpr]]]:
    """Order the lines for the depth-first search, and the checks to run at each depth.

    Exact dynamic programme over subsets of lines (templates have at most a dozen): an order costs the
    expected number of partial combinations visited, taking each check to pass independently at its
    probed rate. A check runs where its last line is bound (one naming no line, at the first depth).
    """
    n = len(domains)
    if n == 0:
        return [], []
    masks = [sum(1 << i for i in range(n) if set(domains[i][0]) & c.names) for c in checks]
    rates = [max(k, 0.5) / PROBE_DRAWS for k in pass_counts]
    order = list(range(n))
    if n <= 14:

        def survivors(subset: int) -> float:  # expected partial combinations passing their checks
            size = math.prod(len(domains[i]) for i in range(n) if subset >> i & 1)
            return size * math.prod(r for m, r in zip(masks, rates, strict=True) if m & subset == m)

        # cost[subset] = (fewest expected visits to bind `subset`, the line bound last to get there)
        cost: dict[int, tuple[float, int]] = {0: (0.0, -1)}
        for subset in range(1, 1 << n):
            cost[subset] = min(
                (cost[subset & ~(1 << i)][0] + survivors(subset & ~(1 << i)) * len(domains[i]), i)
                for i in range(n)
                if subset >> i & 1
            )
        order, subset = [], (1 << n) - 1
        while subset:
            order.append(cost[subset][1])
            subset &= ~(1 << order[-1])
        order.reverse()
    per_depth: list[list[SafeExpr]] = []
    bound = 0
    for i in order:
        before, bound = bound, bound | 1 << i
        ready = [c for c, m in zip(checks, masks, strict=True) if m & bound == m and (m & before != m or not before)]
        per_depth.append(ready)
    return order, per_depth
