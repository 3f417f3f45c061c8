"""The /report page opened in headless Chromium: after a few requests, its charts hold them
(the DOM Chromium built, and the pixels it drew)."""

import html
import json
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve.app import Settings, create_app
from mminfer.serve.report import COLORS

CHROMIUM = "/usr/bin/chromium"
NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="headless Chromium not installed at /usr/bin/chromium (Debian package `chromium`)")


# Counts the texts of the page's charts and lists those whose box Chromium drew beyond their
# chart's box (clipped: "000 ms" for "5000 ms", a legend past the right edge).
MEASURE = """<script>
let texts = 0;
const clipped = [];
for (const svg of document.querySelectorAll("svg")) {
  const box = svg.getBoundingClientRect();
  for (const t of svg.querySelectorAll("text")) {
    const r = t.getBoundingClientRect();
    texts += 1;
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 ||
        r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
      clipped.push([svg.id, t.textContent, Math.round(r.left - box.left),
                    Math.round(r.right - box.left)]);
  }
}
const pre = document.createElement("pre");
pre.id = "clipped";
pre.textContent = JSON.stringify([texts, clipped]);
document.body.appendChild(pre);
</script>"""


def chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
         *args], capture_output=True, text=True, timeout=120)


class Elements(HTMLParser):
    """Every element of a document as (tag, attributes), in order."""

    def __init__(self, doc: str):
        super().__init__()
        self.found: list[tuple[str, dict]] = []
        self.feed(doc)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def select(self, tag, cls=None, **attrs):
        return [a for t, a in self.found if t == tag
                and (cls is None or cls in a.get("class", "").split())
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def test_report_page_charts_the_requests(tmp_path, live_server):
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny-qwen")
    # the video cache off: three questions about one video would be a miss and two hits, whose
    # median decode, vision and attention are 0 (no bar); the chart is what is tested here
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path / "data"),
                              video_cache=False))
    s = live_server(app)

    empty = httpx.get(f"{s.url}/report")
    assert empty.status_code == 200 and "No successful requests" in empty.text
    assert httpx.get(f"{s.url}/report", params={"since": "soon"}).status_code == 400

    tokens = []
    for q in ("what number appears?", "what color is the ball?", "how many objects?"):
        r = httpx.post(f"{s.url}/v1/answer", timeout=60, data={"question": q,
                                                                "max_new_tokens": "3"},
                       files={"video": ("needle.mp4", NEEDLE.read_bytes(), "video/mp4")})
        assert r.status_code == 200, r.text
        tokens.append(r.json()["tokens"]["total"])
    httpx.post(f"{s.url}/v1/answer", data={"question": "x"},
               files={"video": ("e.mp4", b"", "video/mp4")})          # one error

    run = chromium(tmp_path, "--dump-dom", f"{s.url}/report")
    assert run.returncode == 0, run.stderr[-2000:]
    dom = Elements(run.stdout)
    assert dom.select("svg", id="stage-chart"), run.stdout[:2000]
    (bucket,) = dom.select("g", "bucket", data_bucket="<1K")[:1]
    assert bucket["data-count"] == "3"
    stages = {a["data-stage"] for a in dom.select("rect", "stage")}
    assert {"decode", "preprocess", "vision", "attention", "generate"} <= stages
    points = dom.select("circle", "point")
    assert sorted(int(p["data-tokens"]) for p in points) == sorted(tokens)
    assert {p["data-bucket"] for p in points} == {"<1K"}
    pct = dom.select("rect", "pct")
    assert [p["data-pct"] for p in pct] == ["p50", "p95", "p99"]
    assert float(pct[0]["data-ms"]) <= float(pct[2]["data-ms"])
    assert dom.select("tr", data_stage="ttft", data_bucket="<1K")
    assert "bad_video: 1" in run.stdout
    # the legend names every stage drawn (generate and density included)
    legend = {a["data-stage"] for a in dom.select("rect", "swatch")}
    assert stages <= legend and {"generate", "density"} <= legend, (stages, legend)

    # and no text is cut by its chart's edge, as Chromium lays it out: the page with a script
    # that measures every text of every chart (the page itself has none)
    measured = tmp_path / "measured.html"
    measured.write_text(httpx.get(f"{s.url}/report").text.replace("</body>", MEASURE + "</body>"))
    run = chromium(tmp_path, "--window-size=1000,1200", "--dump-dom", measured.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r'<pre id="clipped">(.*?)</pre>', run.stdout, re.S)
    assert found, run.stdout[-2000:]
    texts, clipped = json.loads(html.unescape(found.group(1)))
    assert texts > 20 and clipped == [], clipped

    # and it is drawn: the screenshot has the colours of the stage bars
    shot = tmp_path / "report.png"
    run = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1000,1200",
                   "--hide-scrollbars", f"{s.url}/report")
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    from PIL import Image
    colours = {c for _, c in Image.open(shot).convert("RGB").getcolors(1 << 20)}
    for stage in ("vision", "preprocess", "generate"):
        hexc = COLORS[stage].lstrip("#")
        assert tuple(int(hexc[i:i + 2], 16) for i in (0, 2, 4)) in colours, stage
