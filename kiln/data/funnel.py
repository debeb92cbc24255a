"""The data funnel: documents and bytes kept after each curation step, as text and as an HTML chart.

Both read only a stage's stats.json, so a funnel can be redrawn for any finished run.
"""

from __future__ import annotations

import html

from kiln.data.steps.bias import bias_rates_text


def funnel_rows(stats: dict) -> list[dict]:
    """Per step: documents and bytes kept, as counts and as shares of what was read, and top reasons."""
    rows, docs0, bytes0 = [], None, None
    for step in stats["steps"]:
        if docs0 is None:  # the first row ("read") defines 100%
            docs0 = max(step["docs_in"], step["docs_out"] + sum(step["reasons"].values()), 1)
            bytes0 = max(step["bytes_in"], step["bytes_out"], 1)
        top = sorted(step["reasons"].items(), key=lambda kv: -kv[1])[:3]
        rows.append(
            {
                "name": step["name"],
                "docs": step["docs_out"],
                "bytes": step["bytes_out"],
                "docs_share": step["docs_out"] / docs0,
                "bytes_share": step["bytes_out"] / bytes0,
                "reasons": top,
            }
        )
    return rows


def funnel_text(stats: dict) -> str:
    lines = [f"{'step':<20} {'docs':>10} {'kept %':>7} {'MB':>9}  top reasons"]
    for r in funnel_rows(stats):
        reasons = ", ".join(f"{k} {v}" for k, v in r["reasons"])
        lines.append(
            f"{r['name']:<20} {r['docs']:>10} {100 * r['docs_share']:>6.1f}% {r['bytes'] / 1e6:>9.2f}  {reasons}"
        )
    rates = bias_rates_text(stats)
    return "\n".join(lines + ([rates] if rates else []))


def funnel_html(stats: dict, title: str = "Data funnel") -> str:
    """A self-contained page (inline SVG, no scripts, no network) with two bars per step."""
    rows = funnel_rows(stats)
    width, bar_h, gap, label_w = 560, 14, 10, 170
    height = len(rows) * (2 * bar_h + gap) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + width + 200}" height="{height}" '
        f'font-family="sans-serif" font-size="12">'
    ]
    for i, r in enumerate(rows):
        y = 20 + i * (2 * bar_h + gap)
        parts.append(f'<text x="0" y="{y + bar_h + 4}">{html.escape(r["name"])}</text>')
        for j, (share, color, what) in enumerate(
            (
                (r["docs_share"], "#4c78a8", f"{r['docs']:,} docs"),
                (r["bytes_share"], "#f58518", f"{r['bytes'] / 1e6:.2f} MB"),
            )
        ):
            w = max(1.0, width * share)
            yy = y + j * bar_h
            parts.append(f'<rect x="{label_w}" y="{yy}" width="{w:.1f}" height="{bar_h - 2}" fill="{color}"/>')
            parts.append(f'<text x="{label_w + w + 6:.1f}" y="{yy + bar_h - 4}">{what} ({100 * share:.1f}%)</text>')
    parts.append("</svg>")
    reasons = "".join(
        f"<tr><td>{html.escape(r['name'])}</td><td>{r['docs']:,}</td><td>{r['bytes']:,}</td>"
        f"<td>{html.escape(', '.join(f'{k}: {v:,}' for k, v in r['reasons']))}</td></tr>"
        for r in rows
    )
    return (
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<h1>{html.escape(title)}</h1><p>Documents (blue) and bytes (orange) kept after each step, "
        f"as a share of what was read.</p>{''.join(parts)}"
        f"<table border='1' cellpadding='4'><tr><th>step</th><th>docs kept</th><th>bytes kept</th>"
        f"<th>top drop reasons</th></tr>{reasons}</table>"
        + (f"<pre>{html.escape(rates)}</pre>" if (rates := bias_rates_text(stats)) else "")
    )
