"""The report's charts: Vega-Lite specs built with Altair, drawn in the page by Vega.

Why Vega-Lite and not static SVG from matplotlib (bench/report/bench_report.py measured both on the same
lake): a spec holds only the data (about 50 bytes a point against matplotlib's 175), Python builds
it in milliseconds instead of 100+ ms a chart, and the reader gets tooltips with the exact numbers;
the price is the Vega bundle, about 0.9 MB inlined once per page.

Model text stays data: a spec carries model names only as data values (never as field names,
sort arrays or expressions: orders are numeric fields), the spec travels in an HTML attribute as
autoescaped JSON, Vega draws it as SVG text and its tooltips escape HTML. The page's one script is
the bundle (vl-convert's: Vega, Vega-Lite and vega-embed, built offline once per process) followed
by static/report.js, which embeds every chart with `ast: true` (Vega's CSP-safe expression
interpreter), so the Content-Security-Policy allows that script by hash and no 'unsafe-eval'.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

import altair as alt

MAX_SERIES = 15  # lines per chart; the rest are left out (counted in the spec's usermeta)
DATA = "rows"  # the one named dataset of every spec
FMT = ".6~g"  # tooltip numbers: 6 significant digits, as the rows are rounded


def _clean(v: Any) -> Any:
    """Numbers to 6 significant digits (smaller pages), non-finite to null (JSON has no NaN)."""
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    return v


def spec(chart: alt.TopLevelMixin, rows: list[dict], **usermeta: Any) -> dict:
    """The chart as a Vega-Lite dict with `rows` inlined as its dataset (validated by Altair)."""
    out = chart.to_dict()
    out.pop("$schema", None)  # a URL; the bundle knows its version
    out["datasets"] = {DATA: [{k: _clean(v) for k, v in r.items()} for r in rows]}
    if usermeta:
        out["usermeta"] = usermeta
    return out


def _base() -> alt.Chart:
    return alt.Chart(alt.NamedData(DATA))


def _colors(names: list[str]) -> alt.Scale:
    return alt.Scale(domain=names, scheme="tableau10" if len(names) <= 10 else "tableau20")


def line(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
         bands: Optional[dict[str, list[tuple[float, float, float]]]] = None, band: str = "95% CI",
         y_range: Optional[tuple[float, float]] = None, width: int = 420, height: int = 200) -> Optional[dict]:
    """Lines with points, one per series (None without data); the tooltip of a point gives its
    series, x and y, and its band's low and high.

    bands: a shaded (x, low, high) interval per series, named `band` in the tooltip; y_range:
    fixed y limits (rates use 0..1, so a flat curve looks flat).
    """
    names = [k for k, pts in series.items() if pts]
    shown = names[:MAX_SERIES]
    if not shown:
        return None
    rows: list[dict[str, Any]] = []
    for name in shown:
        iv = {at: (lo, hi) for at, lo, hi in (bands or {}).get(name, [])}
        for at, value in sorted(series[name]):
            lo, hi = iv.get(at, (None, None))
            rows.append({"series": name, "x": at, "y": value, "lo": lo, "hi": hi})
    integer = all(float(at).is_integer() for name in shown for at, _ in series[name])
    x = alt.X("x:Q", title=xlabel, axis=alt.Axis(format="d", tickMinStep=1) if integer else alt.Axis())
    scale = alt.Scale(domain=list(y_range)) if y_range else alt.Scale(zero=False)
    color = alt.Color("series:N", title=None, scale=_colors(shown), legend=alt.Legend(labelLimit=160))
    base = _base().encode(x=x, color=color)
    tip = [alt.Tooltip("series:N"), alt.Tooltip("x:Q", title=xlabel), alt.Tooltip("y:Q", title=ylabel, format=FMT)]
    layers = []
    if any(r["lo"] is not None for r in rows):
        layers.append(base.mark_area(opacity=0.15).encode(y=alt.Y("lo:Q", title=ylabel, scale=scale), y2="hi:Q",
                                                           color=alt.Color("series:N", scale=_colors(shown), legend=None)))
        tip += [alt.Tooltip("lo:Q", title=f"{band} low", format=FMT), alt.Tooltip("hi:Q", title=f"{band} high", format=FMT)]
    layers.append(base.mark_line(point=alt.OverlayMarkDef(size=18)).encode(
        y=alt.Y("y:Q", title=ylabel, scale=scale), tooltip=tip, order="x:Q"))
    chart = alt.layer(*layers).properties(width=width, height=height).resolve_legend(color="independent")  # the lines' legend
    return spec(chart, rows, omitted=len(names) - len(shown))


def heatmap(cells: list[dict], order: list[str], title: str, games: str = "games") -> Optional[dict]:
    """A win-rate matrix: cells {a, b, w, games}, w = a's win rate against b (0 red .. 1 blue),
    rows and columns in `order` (models not in it are left out); the tooltip gives both names,
    the rate and the number of games."""
    ix = {m: k for k, m in enumerate(order)}
    rows = [{"a": c["a"], "b": c["b"], "ai": ix[c["a"]], "bi": ix[c["b"]], "w": c["w"], "games": c["games"]}
            for c in cells if c["a"] in ix and c["b"] in ix]
    if not rows:
        return None
    base = _base().encode(
        x=alt.X("b:N", title=None, sort=alt.EncodingSortField("bi", op="min"), axis=alt.Axis(labelAngle=-60, labelLimit=140)),
        y=alt.Y("a:N", title=None, sort=alt.EncodingSortField("ai", op="min"), axis=alt.Axis(labelLimit=160)))
    rect = base.mark_rect().encode(
        color=alt.Color("w:Q", title=title, scale=alt.Scale(scheme="redblue", domain=[0, 1], domainMid=0.5)),
        tooltip=[alt.Tooltip("a:N", title="model"), alt.Tooltip("b:N", title="against"),
                 alt.Tooltip("w:Q", title=title, format=".3f"), alt.Tooltip("games:Q", title=games)])
    text = base.mark_text(fontSize=9).encode(text=alt.Text("w:Q", format=".2f"))
    return spec(alt.layer(rect, text).properties(width=alt.Step(28), height=alt.Step(22)), rows)


def intervals(rows: list[dict], xlabel: str, low: str = "95% CI low", high: str = "95% CI high") -> Optional[dict]:
    """Interval bars, one row per model in the given order: rows {model, score, low, high}."""
    data = [{"model": r["model"], "i": k, "score": r["score"], "low": r["low"], "high": r["high"]}
            for k, r in enumerate(rows) if r["score"] is not None]
    if not data:
        return None
    base = _base().encode(y=alt.Y("model:N", title=None, sort=alt.EncodingSortField("i", op="min"),
                                  axis=alt.Axis(labelLimit=200)))
    tip = [alt.Tooltip("model:N"), alt.Tooltip("score:Q", title=xlabel, format=FMT),
           alt.Tooltip("low:Q", title=low, format=FMT), alt.Tooltip("high:Q", title=high, format=FMT)]
    rule = base.mark_rule(strokeWidth=2, color="#888").encode(x=alt.X("low:Q", title=xlabel, scale=alt.Scale(zero=False)),
                                                              x2="high:Q")
    point = base.mark_point(filled=True, size=40).encode(x="score:Q", tooltip=tip)
    return spec(alt.layer(rule, point).properties(width=360, height=alt.Step(16)), data)


def facets(rows: list[dict], x: str, fields: list[str], columns: int = 3) -> Optional[dict]:
    """Small multiples, one per field of the wide `rows` (schema names, not model text), each
    with its own y scale; the tooltip gives x and the value."""
    if not rows or not fields:
        return None
    fold: list[Any] = list(fields)
    chart = _base().transform_fold(fold, as_=["metric", "value"]).transform_filter(
        "isValid(datum.value)").mark_line(point=alt.OverlayMarkDef(size=12)).encode(
        x=alt.X(f"{x}:Q", title=x, axis=alt.Axis(format="d", tickMinStep=1)),
        y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
        tooltip=[alt.Tooltip("metric:N"), alt.Tooltip(f"{x}:Q"), alt.Tooltip("value:Q", format=FMT)],
    ).properties(width=250, height=110).facet(
        facet=alt.Facet("metric:N", title=None, sort=fields, header=alt.Header(labelFontWeight="bold")),
        columns=columns).resolve_scale(y="independent")
    return spec(chart, [{k: r.get(k) for k in [x, *fields]} for r in rows])


@functools.cache
def bundle() -> str:
    """Vega, Vega-Lite (the version Altair writes) and vega-embed as one script, built offline."""
    import vl_convert
    return vl_convert.javascript_bundle("window.vegaEmbed = vegaEmbed;", vl_version=_vl_version())


def _vl_version() -> str:
    return "_".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])


def svg(chart: dict, title: str) -> str:
    """A chart as a standalone SVG file (README, BENCHMARKS), drawn by the same Vega."""
    import vl_convert
    return vl_convert.vegalite_to_svg({**chart, "title": title, "background": "white"}, vl_version=_vl_version())
