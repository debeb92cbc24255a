"""Drawing for `kiln report`: inline SVG line plots (axes, ticks, labels, legend, optional log
scale, event markers), the HTML tables around them, and `training_plots`, which turns a training
stage's metrics records into plots.

Plain strings of SVG, so a report is one HTML file that any browser draws offline without
scripts. Every series is one `<polyline>` per run of finite values (non-finite values and, on a
log axis, values <= 0 cannot be placed, so they break the line and are counted in the caption).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field

COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")
MAX_POINTS = 2000  # per series; longer series are thinned keeping each bucket's extremes
# Event markers: the guard's and the watchdog's in strong colours, schedule changes in grey.
EVENT_COLORS = {"nan": "#d62728", "spike": "#9467bd", "skip": "#8c564b", "rollback": "#e377c2", "watchdog": "#17becf"}
EVENT_DEFAULT_COLOR = "#7f7f7f"
TAG_CHAR_PX = 5.6  # width of one character of an event tag (10 px sans-serif), to keep tags apart


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    color: str = ""
    markers: bool = False  # a dot per point: for sparse series such as validation
    dashed: bool = False


@dataclass
class Plot:
    key: str  # stable id, e.g. "pretrain-loss"; the svg's data-plot attribute
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    log_y: bool = False
    # (x, label) or (x, label, tag): events. The label shows on hover; the tag (an event type) is
    # written at the top of the line, picks its colour (EVENT_COLORS) and gets a legend entry.
    vlines: list[tuple] = field(default_factory=list)
    hlines: list[tuple[float, str]] = field(default_factory=list)  # (y, label): limits such as grad_clip


def fmt_num(v: float) -> str:
    """Short tick/table label: 409600 -> 409.6k, 0.0003 -> 0.0003, 3.2e-05 -> 3.2e-05."""
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1e15 or a < 1e-4:
        return f"{v:.3g}"
    # Thousands only from 10k on, so step counts such as 2500 read as they are logged.
    for suffix, scale, start in (("T", 1e12, 1e12), ("G", 1e9, 1e9), ("M", 1e6, 1e6), ("k", 1e3, 1e4)):
        if a >= start:
            return f"{v / scale:.4g}{suffix}"
    return f"{v:.4g}"


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Ticks at 1, 2, 2.5 or 5 times a power of ten covering [lo, hi] (ends rounded outwards)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    # Multiplying an integer index avoids the drift of repeated addition (0.1 + 0.2 ...).
    return [round(i * step, 12) for i in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks for a log axis over [lo, hi] (both > 0): decades, then 1-2-5, then every digit,
    whichever first gives at least three; a range narrower than that gets linear ticks."""
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mults in ((1,), (1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0**e for e in range(e0, e1 + 1) for m in mults]
        ticks = [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
        if len(ticks) >= 3:
            return ticks
    return [t for t in nice_ticks(lo, hi) if lo <= t <= hi and t > 0] or [lo, hi]


def thin(xs: list[float], ys: list[float], max_points: int) -> tuple[list[float], list[float]]:
    """At most ~max_points points: per bucket of consecutive points, the lowest and highest
    finite value (in order) and every non-finite one, so spikes and gaps survive thinning."""
    n = len(xs)
    if n <= max_points:
        return list(xs), list(ys)
    buckets = max(1, max_points // 2)
    keep: list[int] = []
    for b in range(buckets):
        idx = range(b * n // buckets, (b + 1) * n // buckets)
        finite = [i for i in idx if math.isfinite(ys[i])]
        chosen = {i for i in idx if not math.isfinite(ys[i])}
        if finite:
            chosen.add(min(finite, key=lambda i: ys[i]))
            chosen.add(max(finite, key=lambda i: ys[i]))
        keep.extend(sorted(chosen))
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _placeable(x: float, y: float, log_y: bool) -> bool:
    return math.isfinite(x) and math.isfinite(y) and (y > 0 or not log_y)


def _domain(values: list[float], log: bool) -> tuple[float, float, list[float]]:
    lo, hi = min(values), max(values)
    if log:
        if hi <= lo:
            lo, hi = lo / 1.5, hi * 1.5
        pad = (math.log10(hi) - math.log10(lo)) * 0.04
        lo, hi = lo / 10**pad, hi * 10**pad
        return lo, hi, log_ticks(lo, hi)
    if hi <= lo:
        spread = abs(lo) * 0.1 or 1.0
        lo, hi = lo - spread, hi + spread
    ticks = nice_ticks(lo, hi)
    return min(lo, ticks[0]), max(hi, ticks[-1]), ticks


def _legend_rows(entries: list[tuple], left: int, width: int) -> list[list[tuple[float, tuple]]]:
    """Legend entries placed left to right, wrapping to a new row when one would overflow."""
    rows, x = [[]], left
    for entry in entries:
        need = 34 + 6.2 * len(entry[0])
        if rows[-1] and x + need > width:
            rows.append([])
            x = left
        rows[-1].append((x, entry))
        x += need
    return rows


def event_color(tag: str) -> str:
    return EVENT_COLORS.get(tag, EVENT_DEFAULT_COLOR)


def line_plot(plot: Plot, width: int = 560, height: int = 300, max_points: int = MAX_POINTS) -> str:
    """The plot as an `<svg>` element (a string)."""
    drawn = []
    for i, s in enumerate(plot.series):
        xs, ys = thin(s.xs, s.ys, max_points)
        drawn.append((s, s.color or COLORS[i % len(COLORS)], xs, ys))
    vlines = [(float(v[0]), str(v[1]), str(v[2]) if len(v) > 2 else "") for v in plot.vlines]
    legend = _legend_entries(plot, drawn, vlines)
    left, right, bottom = 64, 14, 44
    rows = _legend_rows(legend, left, width)
    top = 46 + 16 * (len(rows) - 1)
    height += 16 * (len(rows) - 1)  # the plot area keeps its size
    pw, ph = width - left - right, height - top - bottom
    xs_all = [x for _, _, xs, ys in drawn for x, y in zip(xs, ys) if _placeable(x, y, plot.log_y)]
    ys_all = [y for _, _, xs, ys in drawn for x, y in zip(xs, ys) if _placeable(x, y, plot.log_y)]
    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-plot="{esc(plot.key)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{esc(plot.title)}" font-family="sans-serif" font-size="11">',
        f"<title>{esc(plot.title)}</title>",
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{esc(plot.title)}</text>',
    ]
    if not xs_all:
        out.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#888">'
            f"no finite values to draw</text></svg>"
        )
        return "".join(out)
    ys_all += [y for y, _ in plot.hlines if _placeable(0.0, y, plot.log_y)]
    x0, x1, xticks = _domain(xs_all, False)
    y0, y1, yticks = _domain(ys_all, plot.log_y)
    f = math.log10 if plot.log_y else (lambda v: v)
    fy0, fy1 = f(y0), f(y1)

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + ph - (f(y) - fy0) / (fy1 - fy0) * ph

    # Grid and ticks.
    for t in xticks:
        if x0 <= t <= x1:
            out.append(
                f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" y2="{top + ph}" stroke="#eee"/>'
                f'<text x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle">{fmt_num(t)}</text>'
            )
    for t in yticks:
        if y0 <= t <= y1:
            out.append(
                f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + pw}" y2="{py(t):.1f}" stroke="#eee"/>'
                f'<text x="{left - 5}" y="{py(t) + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>'
            )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    scale = " (log scale)" if plot.log_y else ""
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">{esc(plot.xlabel)}</text>'
        f'<text transform="translate(13 {top + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{esc(plot.ylabel + scale)}</text>"
    )
    for y, label in plot.hlines:
        if _placeable(0.0, y, plot.log_y):
            out.append(
                f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + pw}" y2="{py(y):.1f}" stroke="#888" '
                f'stroke-dasharray="6 3"><title>{esc(label)}</title></line>'
                f'<text x="{left + pw - 4}" y="{py(y) - 4:.1f}" text-anchor="end" fill="#666">'
                f"{esc(label)}</text>"
            )
    out += _event_lines(vlines, px, (x0, x1), (left, top, pw, ph))
    # Series: the domain covers every drawable point, so nothing needs clipping.
    for s, color, xs, ys in drawn:
        out += _series_svg(s, color, xs, ys, px, py, plot.log_y)
    out += _legend_svg(rows)
    out.append("</svg>")
    return "".join(out)


def _legend_entries(plot: Plot, drawn: list, vlines: list) -> list[tuple[str, str, bool, bool]]:
    """(label, colour, dashed, is an event type) of every legend entry: the series, then one per
    event tag with its count."""
    legend = []
    for s, color, xs, ys in drawn:
        skipped = sum(not _placeable(x, y, plot.log_y) for x, y in zip(xs, ys))
        note = [f"{len(xs)} of {len(s.xs)} points drawn"] if len(xs) < len(s.xs) else []
        note += [f"{skipped} not drawable"] if skipped else []
        legend.append((s.name + (f" ({'; '.join(note)})" if note else ""), color, s.dashed, False))
    tags: dict[str, int] = {}
    for _, _, tag in vlines:
        if tag:
            tags[tag] = tags.get(tag, 0) + 1
    legend += [(f"{tag} ×{n}", event_color(tag), True, True) for tag, n in tags.items()]
    return legend


def _event_lines(vlines: list, px, x_range: tuple[float, float], area: tuple) -> list[str]:
    """The event lines with their tags, inside the plot area (left, top, width, height)."""
    x0, x1 = x_range
    left, top, pw, ph = area
    esc = html.escape
    out = []
    # Tags go on two rows at the top, the guard's and the watchdog's first; one that would overprint
    # another in both rows keeps only its line and hover text.
    placed: list[list[tuple[float, float]]] = [[], []]
    tag_at: dict[int, str] = {}
    for i in sorted(range(len(vlines)), key=lambda i: (vlines[i][2] not in EVENT_COLORS, vlines[i][0])):
        x, _, tag = vlines[i]
        if not (tag and math.isfinite(x) and x0 <= x <= x1):
            continue
        w = TAG_CHAR_PX * len(tag)
        a = px(x) + 3 if px(x) + 3 + w <= left + pw else px(x) - 3 - w
        for row, spans in enumerate(placed):
            if all(a + w + 3 <= b0 or a >= b1 + 3 for b0, b1 in spans):
                spans.append((a, a + w))
                tag_at[i] = (
                    f'<text class="event-tag" x="{a:.1f}" y="{top + 11 + 11 * row}" '
                    f'fill="{event_color(tag)}" font-size="10">{esc(tag)}</text>'
                )
                break
    for i in sorted(range(len(vlines)), key=lambda i: vlines[i][0]):
        x, label, tag = vlines[i]
        if math.isfinite(x) and x0 <= x <= x1:
            color = event_color(tag) if tag else EVENT_COLORS["nan"]
            out.append(
                f'<line class="event" data-event="{esc(tag)}" x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" '
                f'y2="{top + ph}" stroke="{color}" stroke-width="1.3" stroke-dasharray="3 3">'
                f"<title>{esc(label)}</title></line>" + tag_at.get(i, "")
            )
    return out


def _series_svg(s: Series, color: str, xs: list, ys: list, px, py, log_y: bool) -> list[str]:
    """One series as polylines broken where a point cannot be drawn, with markers where asked."""
    esc = html.escape
    out = []
    segments, current = [], []
    for x, y in zip(xs, ys):
        if _placeable(x, y, log_y):
            current.append((px(x), py(y)))
        else:
            if current:
                segments.append(current)
            current = []
    if current:
        segments.append(current)
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    for seg in segments:
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in seg)
        out.append(
            f'<polyline data-series="{esc(s.name)}" points="{points}" fill="none" '
            f'stroke="{color}" stroke-width="1.6"{dash}/>'
        )
        # Few points (a short run, a sparse log_every): a marker on each, so every logged point shows.
        if s.markers or len(xs) <= MARK_EVERY_POINT_UP_TO:
            out.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{color}"/>' for a, b in seg)
    return out


def _legend_svg(rows: list) -> list[str]:
    """Legend rows between the title and the plot area: series as lines, event types as ticks."""
    esc = html.escape
    out = []
    for r, row in enumerate(rows):
        y = 32 + 16 * r
        for x, (name, color, dashed, event) in row:
            dash = ' stroke-dasharray="3 2"' if event else (' stroke-dasharray="5 3"' if dashed else "")
            glyph = (
                f'<line x1="{x + 9}" y1="{y - 6}" x2="{x + 9}" y2="{y + 6}" stroke="{color}" stroke-width="2"{dash}/>'
                if event
                else f'<line x1="{x}" y1="{y}" x2="{x + 18}" y2="{y}" stroke="{color}" stroke-width="2.5"{dash}/>'
            )
            out.append(f'{glyph}<text x="{x + 22}" y="{y + 4}">{esc(name)}</text>')
    return out


# ---------------------------------------------------------------- a training stage's plots

GROUP_ORDER = ("embed", "attn", "mlp", "norm", "head", "other")  # of grad_norm/<group>, as the trainer groups


# train.replay's earlier pack, evaluated beside the run's own split: its rise is the forgetting.
REPLAY_VAL = "val loss, replay pack"


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(records: list[dict], x: str, y: str, name: str, scale: float = 1.0, **style) -> Series | None:
    points = sorted(((r[x], r[y] * scale) for r in records if _num(r.get(x)) and _num(r.get(y))), key=lambda p: p[0])
    return Series(name, [p[0] for p in points], [p[1] for p in points], **style) if points else None


def event_label(event: dict) -> tuple[str, str]:
    """(type, details) of an event record."""
    kind = str(event.get("type") or event.get("event") or event.get("name") or "event")
    details = ", ".join(
        f"{k}={fmt_value(v, k)}" for k, v in event.items() if k not in ("kind", "step", "type", "event", "name")
    )
    return kind, details


def _family(records: list[dict], prefix: str) -> list[str]:
    """Keys of `records` starting with prefix ("grad_norm/"), each with at least one number."""
    found: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if isinstance(k, str) and k.startswith(prefix) and _num(v):
                found[k] = None
    return list(found)


def _group_rank(key: str) -> tuple[int, str]:
    group = key.split("/", 1)[1]
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)


def _system_plots(stage: str, t: list[dict]) -> list[Plot]:
    """sys/* keys by unit: percentages, megabytes, and one plot for whatever else is logged."""
    keys = _family(t, "sys/")
    util = [k for k in keys if k.endswith(("_percent", "_util"))]
    mem = [k for k in keys if k.endswith("_mb")]
    io = [k for k in keys if k.endswith("_bytes_per_s")]
    rest = [k for k in keys if k not in util and k not in mem and k not in io]

    def name(k: str) -> str:
        return k[len("sys/") :]

    return [
        Plot(f"{stage}-sys-util", "System utilisation", "step", "%", [_series(t, "step", k, name(k)) for k in util]),
        Plot(f"{stage}-sys-memory", "System memory", "step", "MB", [_series(t, "step", k, name(k)) for k in mem]),
        Plot(
            f"{stage}-sys-io",
            "Network and disk I/O",
            "step",
            "bytes/s",
            [_series(t, "step", k, name(k)) for k in io],
        ),
        Plot(
            f"{stage}-sys-other",
            "Other system metrics",
            "step",
            "value",
            [_series(t, "step", k, name(k)) for k in rest],
        ),
    ]


def training_plots(
    stage: str, t: list[dict], v: list[dict], events: list[dict], log: bool = False, grad_clip=None
) -> list[Plot]:
    """The plots of one training stage's records (train, val, event; see docs/report.md); plots
    without data are left out, so a run that logs fewer keys simply gets fewer plots."""
    marks = []
    for e in events:
        kind, details = event_label(e)
        marks.append((e["step"], f"step {e['step']}: {kind} {details}".rstrip(), kind))
    clip = [(float(grad_clip), "grad_clip")] if _num(grad_clip) and grad_clip > 0 else []
    groups = sorted(_family(t, "grad_norm/"), key=_group_rank)
    batch = {r["batch_tokens"] for r in t if _num(r.get("batch_tokens"))}
    ramp = [mark for mark in marks if mark[2] == "batch_ramp"]
    plots = [
        Plot(
            f"{stage}-loss",
            "Loss",
            "step",
            "loss (nats/token)",
            [
                _series(t, "step", "loss", "train loss"),
                _series(v, "step", "val_loss", "val loss", markers=True),
                _series(v, "step", "val_loss/replay", REPLAY_VAL, markers=True, dashed=True),
            ],
            log_y=log,
            vlines=marks,
        ),
        Plot(
            f"{stage}-loss-tokens",
            "Loss vs tokens",
            "tokens seen",
            "loss (nats/token)",
            [
                _series(t, "tokens_seen", "loss", "train loss"),
                _series(v, "tokens_seen", "val_loss", "val loss", markers=True),
                _series(v, "tokens_seen", "val_loss/replay", REPLAY_VAL, markers=True, dashed=True),
            ],
            log_y=log,
        ),
        Plot(
            f"{stage}-val-bpb",
            "Validation bits per byte",
            "step",
            "bits/byte",
            [
                _series(v, "step", "val_bpb", "val bpb", markers=True),
                _series(v, "step", "val_bpb/replay", "val bpb, replay pack", markers=True, dashed=True),
            ],
        ),
        Plot(
            f"{stage}-lr",
            "Learning rate",
            "step",
            "lr",
            [_series(t, "step", "lr", "lr")],
            vlines=[mark for mark in marks if mark[2] in ("lr_lowered", "rollback")],
        ),
        Plot(
            f"{stage}-grad-norm",
            "Gradient norm (before clipping)",
            "step",
            "global L2 norm",
            [_series(t, "step", "grad_norm", "grad norm")],
            hlines=clip,
            vlines=marks,
        ),
        Plot(
            f"{stage}-grad-norm-groups",
            "Gradient norm by parameter group",
            "step",
            "L2 norm",
            [_series(t, "step", k, k.split("/", 1)[1]) for k in groups],
            log_y=True,
            vlines=marks,
        ),
        Plot(f"{stage}-throughput", "Throughput", "step", "tokens/s", [_series(t, "step", "tokens_per_s", "tokens/s")]),
        Plot(
            f"{stage}-mfu",
            "Model and hardware FLOPs utilization",
            "step",
            "% of peak",
            [_series(t, "step", "mfu", "MFU", 100.0), _series(t, "step", "hfu", "HFU", 100.0, dashed=True)],
        ),
        # A constant batch says nothing a recipe does not; a ramp (or its events) is worth a plot.
        Plot(
            f"{stage}-batch",
            "Batch size",
            "step",
            "tokens per step",
            [_series(t, "step", "batch_tokens", "batch tokens") if len(batch) > 1 or ramp else None],
            vlines=ramp,
        ),
        Plot(f"{stage}-memory", "Peak memory", "step", "MB", [_series(t, "step", "peak_mem_mb", "peak memory")]),
        *_system_plots(stage, t),
    ]
    for plot in plots:
        plot.series = [s for s in plot.series if s is not None]
    return [p for p in plots if p.series]


PERCENT_KEYS = ("mfu", "hfu")  # fractions of 1 shown as percentages
PERCENT_SUFFIXES = ("_percent", "_util")  # already 0-100
LOSS_WORDS = ("loss", "bpb", "ppl", "perplexity", "accuracy", "reward", "kl")
MARK_EVERY_POINT_UP_TO = 60  # points in a series; more than that read as a line


def fmt_value(value, key: str = "") -> str:
    """A JSON value as a table cell's or summary tile's text (not yet escaped), one format per kind
    of number: a fraction key (mfu) as a percentage, a percentage key (cpu_percent) with a % sign,
    a loss-like value to 4 significant digits, a whole count with thousands separators, any other
    float to 4 significant digits with an SI suffix from 10k on (fmt_num)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    name = key.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if name in PERCENT_KEYS:
            return f"{100 * value:.2f}%"
        if name.endswith(PERCENT_SUFFIXES):
            return f"{value:.1f}%"
        if any(word in name for word in LOSS_WORDS):
            return f"{value:.4g}"
        if value.is_integer() and abs(value) < 1e6:
            return f"{int(value):,}"
        return fmt_num(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _cell(value, key: str) -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"<td{' class=n' if numeric else ''}>{html.escape(fmt_value(value, key))}</td>"


def table(headers: list[str], rows: list[list], keys: list[str] | None = None) -> str:
    """An HTML table of JSON values, each formatted by `fmt_value` with its column's key and
    escaped; numbers right-aligned."""
    keys = keys or headers
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(f"<tr>{''.join(_cell(v, k) for k, v in zip(keys, row))}</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def kv_table(mapping: dict) -> str:
    """Two columns, key and value, for a flat dict (each value formatted with its own key)."""
    body = "".join(f"<tr><td>{html.escape(str(k))}</td>{_cell(v, str(k))}</tr>" for k, v in mapping.items())
    return f"<table><tr><th>key</th><th>value</th></tr>{body}</table>"


def cards(mapping: dict) -> str:
    """A flat dict as a wrapped row of small labelled values: compact for a run's headline numbers."""
    items = "".join(
        f'<div><span class="k">{html.escape(str(k))}</span>{html.escape(fmt_value(v, str(k)))}</div>'
        for k, v in mapping.items()
    )
    return f'<div class="cards">{items}</div>'


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1240px;
padding:0 16px;color:#222}
h1{margin-bottom:4px}h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
.meta{color:#666;margin-top:0}nav{margin:8px 0 16px}nav a{color:#4c78a8}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots svg{max-width:100%;height:auto;border:1px solid #eee}
table{border-collapse:collapse;margin:8px 0;font-size:14px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4}
pre{background:#f7f7f7;padding:10px;overflow-x:auto;white-space:pre-wrap;word-break:break-word}
.warnings{background:#fff4e5;border:1px solid #f0b35a;padding:8px 14px;margin:12px 0}
.note{color:#666;font-size:13px}.wide{overflow-x:auto}
.cards{display:flex;flex-wrap:wrap;gap:6px;margin:8px 0}.cards div{border:1px solid #ddd;padding:4px 10px;
min-width:110px;font-variant-numeric:tabular-nums}.cards .k{display:block;color:#666;font-size:12px}
"""


def page(title: str, subtitle: str, warnings: list[str], sections: list[tuple[str, str, str]]) -> str:
    """The whole document: styles inline, a table of contents, warnings first, then each
    (id, title, html) section. Anchors and CSS only: nothing to fetch, nothing to run."""
    esc = html.escape
    nav = " · ".join(f'<a href="#{esc(key)}">{esc(name)}</a>' for key, name, _ in sections)
    warn = ""
    if warnings:
        items = "".join(f"<li>{esc(w)}</li>" for w in warnings)
        warn = f'<div class="warnings"><strong>Warnings</strong><ul>{items}</ul></div>'
    body = "".join(
        f'<section id="{esc(key)}"><h2>{esc(name)}</h2>{content}</section>' for key, name, content in sections
    )
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f'<h1>{esc(title)}</h1><p class="meta">{esc(subtitle)}</p><nav>{nav}</nav>{warn}{body}'
        f"</body></html>\n"
    )
