"""The latency report page: plain HTML with SVG charts drawn here, on the server.

No script and no external asset, so the page works offline, behind strict proxies and in a
headless browser alike. Every chart element carries ``data-*`` attributes with the numbers it
draws (bucket, attention, count, milliseconds), which is also what the page test reads.
Dense and sparse requests of one length bucket are separate groups (rows, bars), as in the
report's JSON.
"""

from __future__ import annotations

import html
import math
import time

from mminfer.engine.timing import TTFT_STAGES

from .metrics import PIECE_BUCKETS
from .shadow import html_section as shadow_section
from .store import bucket_of

# Stages that add up to the time to first token, then the answer tokens and the density
# count: together the whole request.
BAR_STAGES = TTFT_STAGES + ("generate", "density")
COLORS = {"upload": "#9e9e9e", "queue": "#bdbdbd", "retry": "#d32f2f", "wait": "#fff176",
          "restore": "#a1887f", "room": "#ff8a65", "suffix": "#7986cb",
          "decode": "#8d6e63", "preprocess": "#ffb74d",
          "vision": "#4db6ac", "index": "#ba68c8", "attention": "#e57373",
          "llm_other": "#64b5f6", "generate": "#81c784", "density": "#f06292",
          "ttft": "#1565c0", "total": "#37474f"}
WINDOWS = (("last 15 min", 900), ("last hour", 3600), ("last day", 86400), ("all", None))

e = html.escape
FONT_PX = 12          # every chart text (the style sheet's .label, .legend, .value, .tick)


def text_width(text: str, px: float = FONT_PX) -> float:
    """A generous width of ``text`` in a sans-serif font of ``px``: enough room for the widest
    common glyphs, so that a layout made with it never clips (no browser measures here)."""
    return 0.65 * px * len(text)


def _fmt_ms(ms: float) -> str:
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "-"
    if ms >= 10_000:
        return f"{ms / 1e3:.1f} s"
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms"


def axis_labels(values) -> list[str]:
    """The labels of one axis, all in one unit: seconds where its largest value is 10 s or
    more (where _fmt_ms switches to seconds), milliseconds otherwise; each with the digits it
    needs (0, 0.5, 10, not 0.0 or 10.0)."""
    values = list(values)
    if max(values, default=0.0) >= 10_000:
        return [f"{round(v / 1e3, 6):g} s" for v in values]
    return [f"{round(v, 6):g} ms" for v in values]


def legend(x0: float, y0: float, width: float, items) -> tuple[list[str], float]:
    """A legend of (name, colour) swatches from ``x0``, wrapped into rows within ``width``:
    its SVG elements and the height it takes."""
    out, x, y = [], x0, y0
    for name, color in items:
        w = 13 + text_width(name) + 12
        if x > x0 and x + w > width:
            x, y = x0, y + 18
        out.append(f'<rect class="swatch" data-stage="{e(name)}" x="{x:.1f}" y="{y}" '
                   f'width="10" height="10" fill="{color}"/><text x="{x + 13:.1f}" '
                   f'y="{y + 9}" class="legend">{e(name)}</text>')
        x += w
    return out, y + 18 - y0


def nice_ticks(peak: float, n: int = 4) -> list[float]:
    """Round axis values from 0 to at least ``peak``: steps of 1, 2 or 5 x 10^k."""
    if not peak > 0:
        return [0.0]
    raw = peak / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(peak / step - 1e-9)) + 1)]


def _cell(report, stage, group):
    for r in report["rows"]:
        if r["stage"] == stage and r["bucket"] == group["bucket"] \
                and r.get("attention") == group["attention"]:
            return r
    return None


def _label(group) -> str:
    a = group["attention"]
    return f'{group["bucket"]} tok' + (f" {a}" if a else "")


def _attrs(group) -> str:
    return (f'data-bucket="{e(group["bucket"])}" '
            f'data-attention="{e(group["attention"] or "")}"')


def stage_bars(report: dict) -> str:
    """One horizontal bar per length bucket and attention: median time of each stage,
    stacked."""
    groups = report.get("groups") or []
    if not groups:
        return '<p class="empty">No successful requests in this window yet.</p>'
    width, row_h = 860, 34
    label_w = max(140.0, 12 + max(text_width(_label(g)) for g in groups))
    keys, key_h = legend(label_w, 6, width - 10, ((s, COLORS[s]) for s in BAR_STAGES))
    top = 6 + key_h + 4
    height = top + row_h * len(groups) + 30
    medians = [[(s, (_cell(report, s, g) or {}).get("p50_ms", 0.0) or 0.0)
                for s in BAR_STAGES] for g in groups]
    biggest = max(sum(ms for _, ms in v) for v in medians) or 1.0
    ticks = nice_ticks(biggest)
    scale = (width - label_w - 150) / ticks[-1]     # room for the total after each bar
    out = [f'<svg class="chart" id="stage-chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="Median time per stage, prompt length and attention">']
    axis_y = top + row_h * len(groups)
    out.append('<g class="axis" data-axis="x">')
    for t, name in zip(ticks, axis_labels(ticks)):   # where the bars' milliseconds are
        x = label_w + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{axis_y}" stroke="#ddd"/>'
                   f'<text class="tick" data-ms="{t:g}" x="{x:.2f}" y="{axis_y + 14}" '
                   f'text-anchor="middle">{name}</text>')
    out.append("</g>")
    out.append('<g class="legend-box">')
    out.extend(keys)
    out.append("</g>")
    for i, g in enumerate(groups):
        y = top + i * row_h
        count = (_cell(report, "total", g) or {}).get("count", 0)
        out.append(f'<g class="bucket" {_attrs(g)} data-count="{count}">')
        out.append(f'<text x="{label_w - 8:.1f}" y="{y + 19}" text-anchor="end" class="label">'
                   f'{e(_label(g))}</text>')
        x = label_w
        for s, ms in medians[i]:
            w = ms * scale
            if w <= 0:
                continue
            out.append(f'<rect class="stage" data-stage="{e(s)}" data-p50-ms="{ms:.3f}" '
                       f'x="{x:.2f}" y="{y + 4}" width="{max(w, 0.5):.2f}" height="{row_h - 10}"'
                       f' fill="{COLORS[s]}"><title>{e(_label(g))}, {e(s)}: median '
                       f'{_fmt_ms(ms)}</title></rect>')
            x += w
        total = sum(ms for _, ms in medians[i])
        out.append(f'<text x="{x + 6:.2f}" y="{y + 19}" class="value">{_fmt_ms(total)} '
                   f'(n={count})</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def percentile_bars(report: dict, stage: str) -> str:
    """p50 / p95 / p99 of one stage per length bucket and attention, as grouped vertical
    bars."""
    groups = [g for g in report.get("groups") or [] if _cell(report, stage, g)]
    if not groups:
        return ""
    width, height, bottom, top = 860, 240, 40, 20
    peak = max(_cell(report, stage, g)["p99_ms"] for g in groups) or 1.0
    ticks = nice_ticks(peak)
    names = axis_labels(ticks)
    left = 12 + max(text_width(n) for n in names)     # the widest tick label fits
    group = (width - left - 20) / len(groups)
    bar = min(36, group / 4)
    scale = (height - top - bottom) / ticks[-1]
    out = [f'<svg class="chart" id="pct-{e(stage)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{e(stage)} percentiles per prompt length">',
           f'<line x1="{left:.1f}" y1="{height - bottom}" x2="{width - 10}" '
           f'y2="{height - bottom}" stroke="#888"/>',
           f'<text x="{left:.1f}" y="14" class="label">{e(stage)}: p50 / p95 / p99 '
           f'(max {_fmt_ms(peak)})</text>', '<g class="axis" data-axis="y">']
    for t, name in zip(ticks, names):   # a numeric axis: how tall a millisecond is
        y = height - bottom - t * scale
        out.append(f'<line x1="{left:.1f}" y1="{y:.2f}" x2="{width - 10}" y2="{y:.2f}" '
                   f'stroke="#eee"/><text class="tick" data-ms="{t:g}" x="{left - 6:.1f}" '
                   f'y="{y + 4:.2f}" text-anchor="end">{name}</text>')
    out.append("</g>")
    shades = (("p50_ms", 1.0), ("p95_ms", 0.65), ("p99_ms", 0.4))
    for i, g in enumerate(groups):
        c = _cell(report, stage, g)
        gx = left + i * group + (group - 3 * bar) / 2
        out.append(f'<g class="bucket" {_attrs(g)} data-count="{c["count"]}">')
        for j, (key, opacity) in enumerate(shades):
            h = c[key] * scale
            out.append(f'<rect class="pct" data-pct="{key[:-3]}" data-ms="{c[key]:.3f}" '
                       f'x="{gx + j * bar:.2f}" y="{height - bottom - h:.2f}" '
                       f'width="{bar - 2:.2f}" height="{max(h, 0.5):.2f}" '
                       f'fill="{COLORS.get(stage, "#1565c0")}" fill-opacity="{opacity}">'
                       f'<title>{e(_label(g))}, {key[:-3]}: {_fmt_ms(c[key])} '
                       f'(n={c["count"]})</title></rect>')
        out.append(f'<text x="{gx + 1.5 * bar:.2f}" y="{height - bottom + 16}" '
                   f'text-anchor="middle" class="label">{e(_label(g))} (n={c["count"]})'
                   f'</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def scatter(rows: list[dict]) -> str:
    """Each recent successful request: prompt tokens (x, log) against ttft (y, log)."""
    pts = [r for r in rows if r["status"] == 200 and r["tokens"]
           and r["timings"].get("ttft", 0) > 0]
    if not pts:
        return ""
    width, height, bottom, top = 860, 270, 36, 26
    xs = [math.log10(r["tokens"]) for r in pts]
    ys = [math.log10(r["timings"]["ttft"]) for r in pts]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs)) + (min(xs) == max(xs))
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys)) + (min(ys) == max(ys))
    y_names = axis_labels(10.0 ** d for d in range(y0, y1 + 1))
    left = 12 + max(max(text_width(n) for n in y_names), text_width(f"{10 ** x0:,} tok") / 2)
    sx = lambda v: left + (v - x0) / (x1 - x0) * (width - left - 20)           # noqa: E731
    sy = lambda v: height - bottom - (v - y0) / (y1 - y0) * (height - top - bottom)  # noqa
    out = [f'<svg class="chart" id="scatter" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="Time to first token against prompt length">']
    legend = (("dense", COLORS["ttft"]), ("sparse", COLORS["attention"]))
    for i, (name, color) in enumerate(legend):
        out.append(f'<circle cx="{left + 10 + 80 * i:.1f}" cy="{top - 6}" r="4" '
                   f'fill="{color}"/><text x="{left + 18 + 80 * i:.1f}" y="{top - 2}" '
                   f'class="legend">{name}</text>')
    for d in range(x0, x1 + 1):
        anchor = "end" if d == x1 else "middle"
        out.append(f'<line x1="{sx(d):.1f}" y1="{top}" x2="{sx(d):.1f}" '
                   f'y2="{height - bottom}" stroke="#eee"/><text x="{sx(d):.1f}" '
                   f'y="{height - bottom + 16}" text-anchor="{anchor}" class="label">'
                   f'{10 ** d:,} tok</text>')
    for d, name in zip(range(y0, y1 + 1), y_names):
        out.append(f'<line x1="{left:.1f}" y1="{sy(d):.1f}" x2="{width - 20}" '
                   f'y2="{sy(d):.1f}" stroke="#eee"/><text x="{left - 6:.1f}" '
                   f'y="{sy(d) + 4:.1f}" text-anchor="end" class="label">{name}</text>')
    for r, x, y in zip(pts, xs, ys):
        color = COLORS["attention"] if r["attention"] == "sparse" else COLORS["ttft"]
        out.append(f'<circle class="point" data-bucket="{e(bucket_of(r["tokens"]))}" '
                   f'data-tokens="{r["tokens"]}" data-ttft-ms="{r["timings"]["ttft"]:.3f}" '
                   f'data-attention="{e(r["attention"] or "")}" cx="{sx(x):.2f}" '
                   f'cy="{sy(y):.2f}" r="4" fill="{color}" fill-opacity="0.7">'
                   f'<title>{r["tokens"]} tokens, ttft {_fmt_ms(r["timings"]["ttft"])}, '
                   f'{e(r["attention"] or "")}</title></circle>')
    out.append("</svg>")
    return "\n".join(out)


def cache_section(cache: dict | None, device: str | None = None) -> str:
    """The video cache: the hit rate, and the time to first token of hits and misses
    apart (a row per outcome; ``data-*`` attributes carry the numbers). ``device``: the
    served model's ("cuda", "cpu"), which names where a hit's prefix was kept."""
    if not cache or not (cache["lookups"] or cache["off"]):
        return '<p class="empty">No answered request looked the video cache up yet.</p>'
    rate = "-" if cache["hit_rate"] is None else f'{cache["hit_rate"] * 100:.1f} %'
    head = ('<tr><th>prefix from</th><th>count</th><th>ttft p50</th><th>p95</th><th>p99</th>'
            '<th>mean</th></tr>')
    kept = {"cuda": "GPU memory", "cpu": "memory"}.get(device, "device memory")
    names = {"miss": "miss (prefilled)", "hit": f"hit ({kept})",
             "host": "hit (host tier, copied back)", "off": "cache off"}
    body = "".join(
        f'<tr class="cache-row" data-cache="{e(r["cache"])}" data-count="{r["count"]}" '
        f'data-p50-ms="{r["p50_ms"]:.3f}" data-p95-ms="{r["p95_ms"]:.3f}" '
        f'data-p99-ms="{r["p99_ms"]:.3f}"><td>{e(names.get(r["cache"], r["cache"]))}</td>'
        f'<td>{r["count"]}</td><td>{_fmt_ms(r["p50_ms"])}</td><td>{_fmt_ms(r["p95_ms"])}'
        f'</td><td>{_fmt_ms(r["p99_ms"])}</td><td>{_fmt_ms(r["mean_ms"])}</td></tr>'
        for r in cache["ttft"])
    shown = "" if cache["hit_rate"] is None else cache["hit_rate"]
    return (f'<p id="cache-summary" data-hit-rate="{shown}" data-lookups="{cache["lookups"]}" '
            f'data-hits="{cache["hits"]}">Hit rate <b>{rate}</b>: {cache["hits"]} of '
            f'{cache["lookups"]} lookups ({cache["host_hits"]} from the host tier, '
            f'{cache["misses"]} misses); {cache["off"]} answered with the cache off.</p>'
            f'<table id="cache-table">{head}{body}</table>')


def streams_section(streams: dict | None) -> str:
    """Live streams: the server's figures (held, full, pulling, ingest rate, lag, memory,
    pieces and their median time) and a row per stream the reader may see."""
    if not streams:
        return '<p class="empty">No live stream yet.</p>'
    st = streams["stats"]
    rate = st.get("ingest_tokens_per_s")
    pieces = st.get("pieces", 0)
    p50 = _piece_median(st.get("piece_buckets"), pieces)
    line = (f'<p id="streams-summary" data-active="{st.get("active", 0)}" '
            f'data-full="{st.get("full", 0)}" data-pieces="{pieces}" '
            f'data-ingest-tokens-per-s="{rate if rate is not None else ""}" '
            f'data-max-lag-s="{st.get("max_lag_seconds", 0)}">Streams: '
            f'<b>{st.get("active", 0)}</b> held ({st.get("full", 0)} full, '
            f'{st.get("pulling", 0)} reading a source); {pieces} pieces, '
            f'{st.get("tokens_ingested", 0)} tokens taken in'
            f'{f", {rate:g} tokens/s lately" if rate is not None else ""}'
            f'{f", a piece in {p50} (median)" if p50 else ""}; largest lag '
            f'{st.get("max_lag_seconds", 0):g} s; KV {_fmt_bytes(st.get("bytes", 0))} of '
            f'{_fmt_bytes(st.get("budget_bytes", 0))}.</p>')
    rows = streams.get("streams") or []
    if not rows:
        return line
    head = ('<tr><th>stream</th><th>state</th><th>source</th><th>seen until</th>'
            '<th>lag</th><th>tokens</th><th>pieces</th><th>last error</th></tr>')
    body = []
    for r in rows:
        src = r.get("source") or {}
        err = (r.get("last_error") or {}).get("message") or ""
        body.append(
            f'<tr class="stream-row" data-stream="{e(r["id"])}" data-state="{e(r["state"])}" '
            f'data-seen-until="{r["seen_until"]}" data-tokens="{r["tokens"]}">'
            f'<td>{e(r["id"])}</td><td>{e(r["state"])}</td>'
            f'<td>{e(src.get("state", "push")) if src else "push"}</td>'
            f'<td>{r["seen_until"]:g} s</td><td>{r.get("lag_seconds") or 0:g} s</td>'
            f'<td>{r["tokens"]}</td><td>{r["pieces"]}</td><td>{e(err[:120])}</td></tr>')
    return f'{line}<table id="streams-table">{head}{"".join(body)}</table>'


def _piece_median(buckets, n) -> str | None:
    """The bucket bound that holds the median piece time (the histogram's resolution)."""
    if not buckets or not n:
        return None
    acc = 0
    for bound, c in zip([*PIECE_BUCKETS, None], buckets):
        acc += c
        if acc * 2 >= n:
            return f"≤ {_fmt_ms(bound * 1e3)}" if bound is not None else \
                f"> {_fmt_ms(PIECE_BUCKETS[-1] * 1e3)}"
    return None


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(report: dict) -> str:
    if not report["rows"]:
        return ""
    head = ("<tr><th>stage</th><th>length</th><th>attention</th><th>count</th><th>p50</th>"
            "<th>p95</th><th>p99</th><th>mean density</th></tr>")
    body = []
    for r in report["rows"]:
        dens = "-" if r["mean_density"] is None else f'{r["mean_density"]:.3f}'
        attn = r.get("attention") or ""
        body.append(f'<tr data-stage="{e(r["stage"])}" data-bucket="{e(r["bucket"])}" '
                    f'data-attention="{e(attn)}">'
                    f'<td>{e(r["stage"])}</td><td>{e(r["bucket"])}</td><td>{e(attn or "-")}'
                    f'</td><td>{r["count"]}</td>'
                    f'<td>{_fmt_ms(r["p50_ms"])}</td><td>{_fmt_ms(r["p95_ms"])}</td>'
                    f'<td>{_fmt_ms(r["p99_ms"])}</td><td>{dens}</td></tr>')
    return f'<table id="latency-table">{head}{"".join(body)}</table>'


def _policy_line(policy: dict | None) -> str:
    if not policy:
        return ""
    cls = ' class="warn"' if policy["head_patterns"] == "uncalibrated" else ""
    line = (f'<p{cls} id="policy">Head patterns: <b>{e(policy["head_patterns"])}</b>; '
            f'attention "auto": {e(policy["auto_attention"])}.</p>')
    sc = policy.get("self_calibration")
    if sc:                          # serve/selfcal.py: which config serves, measured how
        line += (f'<p id="self-calibration" data-state="{e(sc["state"])}" '
                 f'data-serving="{e(sc["serving"])}">Self-calibration: {e(sc["summary"])}.'
                 + (f' <small>{e(sc["checks"])}.</small>' if sc.get("checks") else "")
                 + '</p>')
    return line


def _now_line(now: dict | None) -> str:
    """The requests in the server as the page was made (the scheduler's counts)."""
    if not now:
        return ""
    return (f'<p id="now">Now: {now["queued"]} queued, {now["running"]} in progress '
            f'({now["prefilling"]} building a prefix, {now["waiting_admission"]} waiting to, '
            f'{now["paused"]} paused for short work, {now["decoding"]} decoding). Time waiting '
            f'for other requests is the stage <code>wait</code>.</p>')


def render(report: dict, rows: list[dict], model: str, now: float | None = None) -> str:
    now = time.time() if now is None else now
    links = " · ".join(
        f'<a href="/report{"" if s is None else f"?since={now - s:.0f}"}">{e(name)}</a>'
        for name, s in WINDOWS)
    window = "all time" if report["since"] is None else (
        "since " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report["since"])))
    errors = ", ".join(f"{e(k)}: {v}" for k, v in sorted(report["errors"].items())) or "none"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>mminfer latency report</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 900px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
.label, .legend, .value, .tick {{ font-size: {FONT_PX}px; fill: #333; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: right; }}
td:first-child, th:first-child, td:nth-child(2), td:nth-child(3) {{ text-align: left; }}
.empty {{ color: #777; }}
.warn {{ background: #fff4d6; padding: 6px 10px; }}
</style></head><body>
<h1>mminfer latency report</h1>
{_policy_line(report.get("policy"))}
{_now_line(report.get("now"))}
<p>Model <code>{e(model)}</code>; {window}; {report["requests"]} requests,
{report["succeeded"]} answered; errors: {errors}.<br>{links} ·
<a href="/v1/latency-report">JSON</a> · <a href="/metrics">metrics</a></p>
<h2>Where the time goes (median per stage, by prompt length and attention)</h2>
{stage_bars(report)}
<h2>Time to first token</h2>
{percentile_bars(report, "ttft")}
<h2>Video cache: hit rate, and time to first token of hits and misses</h2>
{cache_section(report.get("cache"), report.get("device"))}
<h2>Live streams</h2>
{streams_section(report.get("streams"))}
<h2>Time to first token against prompt length (recent requests)</h2>
{scatter(rows)}
<h2>All stages</h2>
{table(report)}
{shadow_section(report.get("shadow"))}
</body></html>
"""
