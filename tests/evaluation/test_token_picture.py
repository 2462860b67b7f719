from __future__ import annotations

import re

import pytest

pytest.importorskip("matplotlib")

from adaflash.evaluation.token_picture import (  # noqa: E402
    TokenScores,
    layout,
    render_html,
    render_png,
    shared_vmax,
    value_color,
)


def _luminance(hex_color: str) -> float:
    r, g, b = (int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _rows() -> list[TokenScores]:
    tokens = ("def", " f", "(x", "):\n    x", "    return", " <b>", " x", "\n\n", "done", "\t&")
    before = TokenScores(tokens, (0.1, 2.0, 0.5, 0.0, 1.2, 3.5, 0.3, 0.0, 0.8, 0.2), "before distillation")
    after = TokenScores(tokens, (0.05, 0.4, 0.1, 0.0, 0.2, 0.9, 0.1, 0.0, 0.1, 0.05), "after distillation")
    return [before, after]


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        TokenScores(("a", "b"), (0.1,), "bad")


def test_value_color_darker_for_higher_values() -> None:
    low, mid, high = (value_color(v, 2.0) for v in (0.0, 1.0, 2.0))
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in (low, mid, high))
    assert _luminance(high) < _luminance(mid) < _luminance(low)
    assert value_color(50.0, 2.0) == high  # clipped at vmax


def test_shared_vmax() -> None:
    assert shared_vmax(_rows(), vmax=2.5) == 2.5
    assert 0.9 < shared_vmax(_rows()) <= 3.5
    assert shared_vmax([TokenScores(("a",), (0.0,), "zero")]) == 1.0


def test_layout_newlines_and_wrapping() -> None:
    assert layout(["ab", "c\n", "d", "e"], max_chars=80) == [(0, 0), (0, 2), (1, 0), (1, 1)]
    assert layout(["x\n\n", "y"], max_chars=80) == [(0, 0), (2, 0)]
    # 4-char tokens in a 10-char line: two fit, the third wraps to column 0 of the next line
    assert layout(["aaaa"] * 5, max_chars=10) == [(0, 0), (0, 4), (1, 0), (1, 4), (2, 0)]
    assert layout(["z" * 15, "a"], max_chars=10) == [(0, 0), (1, 0)]  # an over-long token sits alone
    # text after a newline inside a token continues at column 0 of the next line; the next token follows it
    assert layout(["ab", ".\n\nThe", " end"], max_chars=80) == [(0, 0), (0, 2), (2, 3)]


def test_render_png(tmp_path) -> None:
    out = render_png(_rows(), tmp_path / "sub" / "tokens.png", "reverse KL per token", max_chars_per_line=20)
    assert out.exists() and out.stat().st_size > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_html(tmp_path) -> None:
    rows = _rows()
    out = render_html(rows, tmp_path / "nested" / "tokens.html", "before <vs> after")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "http" not in text  # standalone
    assert "&lt;b&gt;" in text and "<b>" not in text
    assert "before &lt;vs&gt; after" in text
    assert "<br>" in text and "&amp;" in text
    spans = re.findall(r'<span title="([0-9.]+)" style="background:(#[0-9a-f]{6})', text)
    assert len(spans) == sum(len(r.tokens) for r in rows) == text.count("<span")
    assert [s[0] for s in spans[:3]] == ["0.100", "2.000", "0.500"]
    top = shared_vmax(rows)
    assert spans[1][1] == value_color(2.0, top)  # same scale as the PNG
    assert "mean 0.860" in text and "mean 0.190" in text
