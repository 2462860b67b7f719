"""Per-token divergence over one response ("before vs after" distillation) as a PNG or a standalone HTML page.

Each token gets a background coloured by its value (e.g. reverse KL in nats) on ONE colour scale shared by all rows,
so rows can be compared by eye. Needs matplotlib (`pip install adaflash[plots]`).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

CMAP = "Reds"
NEWLINE_GLYPH = "⏎"
FONT_SIZE = 9.0  # points
CHAR_W = 0.602 * FONT_SIZE / 72  # inches per character of DejaVu Sans Mono
LINE_H = 1.55 * FONT_SIZE / 72  # inches per text line


@dataclass(frozen=True)
class TokenScores:
    """One response: decoded tokens, one non-negative divergence per token, and a label (e.g. "before")."""

    tokens: tuple[str, ...]
    values: tuple[float, ...]
    label: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(str(t) for t in self.tokens))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if len(self.tokens) != len(self.values):
            raise ValueError(f"{self.label!r}: {len(self.tokens)} tokens but {len(self.values)} values")

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0


def display_text(token: str) -> str:
    """What a token shows as: newlines become a visible glyph, tabs an arrow, carriage returns vanish."""
    return token.replace("\r", "").replace("\n", NEWLINE_GLYPH).replace("\t", "⇥")


def pieces(token: str) -> list[str]:
    """A token's displayed text split at its newlines, one piece per line; each piece but the last ends in ⏎."""
    parts = token.split("\n")
    return [display_text(p) + NEWLINE_GLYPH for p in parts[:-1]] + [display_text(parts[-1])]


def layout(tokens: Sequence[str], max_chars: int) -> list[tuple[int, int]]:
    """(line, column) where each token starts: wrap before one that would pass max_chars; a "\n" starts a new line.

    Text after a newline inside a token continues at column 0 of the following line.
    """
    out: list[tuple[int, int]] = []
    line = col = 0
    for tok in tokens:
        parts = pieces(tok)
        if col > 0 and col + len(parts[0]) > max_chars:
            line, col = line + 1, 0
        out.append((line, col))
        line, col = line + len(parts) - 1, (col if len(parts) == 1 else 0) + len(parts[-1])
    return out


def _extra_lines(token: str) -> int:
    """How many lines below its start a token draws on (a trailing newline draws nothing on the next line)."""
    parts = pieces(token)
    return max(len(parts) - 1 - (parts[-1] == ""), 0)


def shared_vmax(rows: Sequence[TokenScores], vmax: float | None = None) -> float:
    """The top of the shared colour scale: vmax if given, else the 99th percentile of all values (1.0 if none > 0)."""
    if vmax is not None:
        return float(vmax) if vmax > 0 else 1.0
    import numpy as np

    values = [v for r in rows for v in r.values if math.isfinite(v)]
    top = float(np.percentile(values, 99)) if values else 0.0
    return top if top > 0 else 1.0


def value_color(value: float, vmax: float, cmap: str = CMAP) -> str:
    """Background colour "#rrggbb" of a value on the 0..vmax scale (clipped; higher = darker)."""
    import matplotlib
    from matplotlib.colors import Normalize, to_hex

    value = value if math.isfinite(value) else vmax
    return to_hex(matplotlib.colormaps[cmap](Normalize(0.0, vmax, clip=True)(value)), keep_alpha=False)


def _luminance(hex_color: str) -> float:
    r, g, b = (int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_color(background: str) -> str:
    """Black text on light backgrounds, white on dark ones."""
    return "#000000" if _luminance(background) > 0.5 else "#ffffff"


def render_png(
    rows: list[TokenScores],
    path: str | Path,
    title: str,
    vmax: float | None = None,
    max_chars_per_line: int = 90,
) -> Path:
    """One panel per row (label + mean as its title), tokens as wrapped monospace text on coloured boxes."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in tests
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.patches import Rectangle

    top = shared_vmax(rows, vmax)
    layouts = [layout(r.tokens, max_chars_per_line) for r in rows]
    n_lines = [max((ln + _extra_lines(t) for t, (ln, _) in zip(r.tokens, lay)), default=0) + 1
               for r, lay in zip(rows, layouts)]
    left, right, fig_title, panel_title, gap = 0.25, 1.1, 0.45, 0.45, 0.15  # inches
    text_w = max_chars_per_line * CHAR_W
    heights = [n * LINE_H + 0.1 for n in n_lines]
    fig_w = left + text_w + right
    fig_h = fig_title + sum(panel_title + h + gap for h in heights) + 0.1
    fig = plt.figure(figsize=(fig_w, fig_h))
    fig.suptitle(title, x=left / fig_w, y=1 - 0.12 / fig_h, ha="left", va="top", fontsize=11, fontweight="bold")

    y_top = fig_h - fig_title  # inches from the bottom, moving down panel by panel
    for row, lay, n, h in zip(rows, layouts, n_lines, heights):
        y_top -= panel_title
        ax = fig.add_axes((left / fig_w, (y_top - h) / fig_h, text_w / fig_w, h / fig_h))
        ax.set_xlim(0, max_chars_per_line)
        ax.set_ylim(n + 0.1 / LINE_H, 0)  # y in lines, top line first
        ax.set_axis_off()
        ax.set_title(f"{row.label}\nmean {row.mean:.3f}", loc="left", fontsize=9.5, pad=4)
        for tok, val, (ln, col) in zip(row.tokens, row.values, lay):
            bg = value_color(val, top)
            fg = text_color(bg)
            for i, shown in enumerate(pieces(tok)):
                x = col if i == 0 else 0
                if shown:
                    ax.add_patch(Rectangle((x, ln + i + 0.04), len(shown), 0.92, facecolor=bg, edgecolor="white",
                                           linewidth=0.6))
                    ax.text(x, ln + i + 0.5, shown, family="monospace", fontsize=FONT_SIZE, va="center",
                            ha="left", color=fg, clip_on=False)
        y_top -= h + gap

    bar_bottom = 0.1 + gap  # inches: from the last panel's bottom to the first panel's title
    cax = fig.add_axes(((left + text_w + 0.35) / fig_w, bar_bottom / fig_h, 0.15 / fig_w,
                        (fig_h - fig_title - bar_bottom) / fig_h))
    bar = fig.colorbar(ScalarMappable(Normalize(0.0, top), CMAP), cax=cax)
    bar.set_label("reverse KL (nats)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def render_html(rows: list[TokenScores], path: str | Path, title: str, vmax: float | None = None) -> Path:
    """Standalone HTML page: one block per row, a span per token (background = value, hover title = value)."""
    top = shared_vmax(rows, vmax)
    stops = ", ".join(value_color(top * i / 10, top) for i in range(11))
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:60em}"
        ".tokens{font-family:monospace;white-space:pre-wrap;line-height:1.7;word-break:break-all}"
        ".scale{display:flex;align-items:center;gap:.5em;font-size:.9em}"
        f".bar{{width:15em;height:1em;background:linear-gradient(to right, {stops})}}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        f'<div class="scale">0<div class="bar"></div>{top:.3f} reverse KL (nats)</div>',
    ]
    for row in rows:
        parts.append(f"<h2>{html.escape(row.label)}</h2><p>mean {row.mean:.3f}</p><div class=\"tokens\">")
        for tok, val in zip(row.tokens, row.values):
            bg = value_color(val, top)
            shown = "<br>".join(html.escape(p) for p in pieces(tok))
            parts.append(f'<span title="{val:.3f}" style="background:{bg};color:{text_color(bg)}">{shown}</span>')
        parts.append("</div>")
    parts.append("</body></html>\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts), encoding="utf-8")
    return path
