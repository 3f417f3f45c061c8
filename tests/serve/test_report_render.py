"""The /report page as the server renders it, from a latency store filled here: what it says
and where it puts its text (no browser; test_report_page.py opens it in Chromium)."""

import re
import time
from html.parser import HTMLParser

from mminfer.serve.report import BAR_STAGES, render, text_width
from mminfer.serve.store import LatencyStore


class Svgs(HTMLParser):
    """Each <svg> of a page: its width and its elements as (tag, attributes, text)."""

    def __init__(self, doc: str):
        super().__init__()
        self.svgs: dict[str, dict] = {}
        self._svg = None
        self._open = None
        self.feed(doc)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self._svg = self.svgs[a["id"]] = {"width": float(a["width"]), "items": []}
        elif self._svg is not None:
            self._open = [tag, a, ""]
            self._svg["items"].append(self._open)

    def handle_startendtag(self, tag, attrs):
        if self._svg is not None:
            self._svg["items"].append([tag, dict(attrs), ""])

    def handle_data(self, data):
        if self._open is not None and self._open[0] == "text":
            self._open[2] += data

    def handle_endtag(self, tag):
        if tag == "svg":
            self._svg = None
        self._open = None

    def texts(self, svg: str, cls: str | None = None):
        return [(a, t) for tag, a, t in self.svgs[svg]["items"] if tag == "text"
                and (cls is None or cls in a.get("class", "").split())]


def page(tmp_path, ttfts_ms, device="cuda", cache="hit"):
    """The page over one answered request per time to first token, each with every stage."""
    st = LatencyStore(tmp_path / "lat.sqlite3")
    now = time.time()
    for i, ttft in enumerate(ttfts_ms):
        stages = {s: ttft / len(BAR_STAGES) for s in BAR_STAGES}
        st.add(id=f"r{i}", endpoint="answer", status=200, attention=("dense", "sparse")[i % 2],
               tokens=(500, 200_000)[i % 2], density=(1.0, 0.2)[i % 2], ts=now - i,
               timings={**stages, "ttft": ttft, "total": 2 * ttft}, cache=cache)
    rep = st.report()
    rows = st.rows(limit=1000)
    st.close()
    rep["device"] = device
    rep["policy"] = None
    return render(rep, rows, "m")


def within(svg, items):
    """Every text of ``items`` drawn inside the chart's width, as generously measured."""
    out = []
    for a, text in items:
        x, w = float(a["x"]), text_width(text)
        left = {"end": x - w, "middle": x - w / 2}.get(a.get("text-anchor"), x)
        right = left + w
        if left < 0 or right > svg["width"]:
            out.append((text, round(left), round(right)))
    return out


def test_the_legend_names_every_stage_drawn_and_fits(tmp_path):
    doc = Svgs(page(tmp_path, [40.0, 15_000.0, 120.0]))
    chart = doc.svgs["stage-chart"]
    drawn = {a["data-stage"] for tag, a, _ in chart["items"]
             if tag == "rect" and "stage" in a.get("class", "").split()}
    keys = [t for _, t in doc.texts("stage-chart", "legend")]
    assert {"generate", "density"} <= drawn and drawn <= set(keys), (drawn, keys)
    assert keys == list(BAR_STAGES)
    assert within(chart, doc.texts("stage-chart")) == []


def test_every_axis_label_fits_its_chart(tmp_path):
    doc = Svgs(page(tmp_path, [2_500.0, 4_000.0, 8_000.0, 9_000.0]))
    for svg in ("stage-chart", "pct-ttft", "scatter"):
        assert within(doc.svgs[svg], doc.texts(svg)) == [], svg


def test_one_axis_one_unit(tmp_path):
    """0 to 15 s: every tick in seconds, with the digits it needs (not "0.0 ms" beside
    "10.0 s"); under 10 s, milliseconds."""
    for ttfts, unit in (([40.0, 15_000.0], "s"), ([40.0, 900.0], "ms")):
        doc = Svgs(page(tmp_path / unit, ttfts))
        for svg in ("stage-chart", "pct-ttft", "scatter"):
            ticks = [t for a, t in doc.texts(svg) if "tick" in a.get("class", "").split()
                     or re.fullmatch(r"[\d.]+ m?s", t)]
            assert len(ticks) >= 2, (svg, ticks)
            assert {t.split()[1] for t in ticks} == {unit}, (svg, ticks)
            assert not any(re.match(r"\d+\.0 ", t) for t in ticks), (svg, ticks)


def test_a_cpu_servers_hits_are_not_said_to_be_on_a_gpu(tmp_path):
    cpu = page(tmp_path / "cpu", [50.0], device="cpu")
    row = re.search(r'<tr class="cache-row" data-cache="hit".*?</tr>', cpu).group(0)
    assert "GPU" not in row and "hit (memory)" in row
    gpu = page(tmp_path / "gpu", [50.0], device="cuda")
    assert "hit (GPU memory)" in gpu
