"""GSM-Symbolic: the restricted evaluator, the sampler, and the seeded stream."""

import re
from random import Random

import pytest

from adaflash.data import GSMSymbolicStream
from adaflash.data import gsm_symbolic as gs
from adaflash.data.gsm_expr import SafeExpr, TemplateError, _Combinations, format_numbers_eng
from adaflash.data.gsm_template import Template, compile_template

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def _question(prompt):
    return prompt.text.split("\n\n", 1)[1]  # drop the instruction (which contains "\boxed{}")


# ---- restricted evaluator ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "__import__('os')",
        "().__class__",
        "x.real",
        "names[0]",
        "[i for i in range(3)]",
        "lambda: 1",
        "_secret",
        "(lambda: 1)()",
        "f'{x}'",
    ],
)
def test_safe_expr_rejects_unsafe_constructs(source):
    with pytest.raises(TemplateError):
        SafeExpr(source)


def test_safe_expr_evaluates_template_arithmetic():
    env = {"divides": lambda a, b: a % b == 0, "k": 3, "y": 8}
    assert SafeExpr("k * y < 10 * 12 and divides(k*y, 12)")(env) is True
    assert SafeExpr("k if y > 5 else -k")(env) == 3
    with pytest.raises(TemplateError, match="not defined"):
        SafeExpr("open('f')")({})  # no builtins are reachable
    with pytest.raises(TemplateError, match="too large"):
        SafeExpr("2 ** 10 ** 10")({})


def test_lazy_combinations_match_itertools():
    import itertools

    c = _Combinations(list("abcdefg"), 3)
    assert [c[i] for i in range(len(c))] == list(itertools.combinations("abcdefg", 3))


def test_number_formatting_matches_package():
    assert format_numbers_eng("pay 12345 for 1234.5 kg") == "pay 12,345 for 1234.5 kg"
    assert format_numbers_eng("<<12345*2=24690>>\n#### 24690") == "<<12345*2=24690>>\n#### 24690"


# ---- sampler on a small synthetic template -----------------------------------------------------

_TOML = '''
question = "Benny saw a 10-foot shark with 2 6-inch remoras."
answer = "#### 10"
id_orig = 1
id_shuffled = 0
question_annotated = """
{n, Benny} saw a {x,10}-foot shark with {k,2} {y,6}-inch remoras. {m,Ann} counts {z,3}.

#init:
- n = sample(names)
- $x = range(10, 500, 10)
- $k = range(2, 10)
- $y = range(2, 100)
- m = sample(names)
- $z = range(1, 1000)

#conditions:
- k * y < x * 12
- divides(k*y,12)
- divides(x * 12, k*y)
- z == 537 or z == 538

#answer: int((k * y)/ (x * 12) * 100)
"""
answer_annotated = """
{k}*{y} = <<{k}*{y}={k*y}>>{k*y} inches and {z}.
#### {int(k*y/(12*x)*100)}
"""
'''


def test_sampler_respects_conditions_and_is_deterministic(tmp_path):
    path = tmp_path / "0000.toml"
    path.write_text(_TOML)
    compiled = compile_template(Template.from_toml(path), {"names": ["Ann", "Bob", "Cy"]})
    draws = [compiled.sample(Random(s)) for s in range(40)]
    assert draws == [compiled.sample(Random(s)) for s in range(40)]
    assert len(set(draws)) > 20
    for question, answer in draws:
        pattern = r"(\w+) saw a (\d+)-foot shark with (\d+) (\d+)-inch remoras\. (\w+) counts (\d+)\."
        n, x, k, y, m, z = re.fullmatch(pattern, question).groups()
        x, k, y, z = int(x), int(k), int(y), int(z)
        assert n in {"Ann", "Bob", "Cy"} and m in {"Ann", "Bob", "Cy"}
        assert k * y < x * 12 and k * y % 12 == 0 and x * 12 % (k * y) == 0 and z in (537, 538)
        assert answer.endswith(f"#### {int(k * y / (12 * x) * 100)}")
        assert f"<<{k}*{y}={k * y}>>" in answer


def test_unsupported_template_is_reported(tmp_path):
    path = tmp_path / "0001.toml"
    path.write_text(_TOML.replace("sample(names)", "names.pop()", 1))
    with pytest.raises(TemplateError):
        compile_template(Template.from_toml(path), {"names": ["Ann"]})


# ---- the packaged templates and the stream ------------------------------------------------------


def test_all_packaged_templates_compile():
    assert gs.skipped_templates() == ()
    assert len(gs.load_templates()) == 100


def test_stream_is_deterministic_per_seed():
    a = GSMSymbolicStream(seed=7).take(40)
    assert a == GSMSymbolicStream(seed=7).take(40)
    assert [p.text for p in a] != [p.text for p in GSMSymbolicStream(seed=8).take(40)]
    stream = GSMSymbolicStream(seed=7)
    assert stream.take(20) + stream.take(20) == a  # take() continues the same stream


def test_stream_yields_fresh_well_formed_problems():
    prompts = GSMSymbolicStream(seed=11).take(200)
    assert len({p.id for p in prompts}) == 200
    assert len({_question(p) for p in prompts}) >= 190
    checked = 0
    for p in prompts:
        assert p.domain == "math" and p.dataset == "gsm-symbolic"
        question = _question(p)
        assert "{" not in question and "}" not in question, question
        assert "{" not in p.reference and "}" not in p.reference
        assert re.fullmatch(_NUMBER, p.reference.splitlines()[-1].removeprefix("####").strip()), p.reference
        for lhs, rhs in re.findall(r"<<([^=<>]+)=([^<>]+)>>", p.reference):
            try:
                value = SafeExpr(lhs.replace(",", ""))({})
            except (TemplateError, ZeroDivisionError):
                continue  # a calculation written with units or symbols
            assert abs(float(value) - float(rhs.replace(",", ""))) < 1e-6 * max(1, abs(float(value))), (lhs, rhs)
            checked += 1
    assert checked > 200  # the worked answers' arithmetic is consistent with the substituted numbers
    # Numbers were substituted (a few templates write them as words: "nine people").
    assert sum(bool(re.search(r"\d", _question(p))) for p in prompts) > 0.8 * len(prompts)


def test_eval_stream_is_explicit_and_separate():
    eval_stream = GSMSymbolicStream(seed=0, split="eval")
    assert set(eval_stream.template_ids) == set(gs.template_ids("eval"))
    assert all(p.id.startswith("gsm-symbolic/eval/") for p in eval_stream.take(5))
