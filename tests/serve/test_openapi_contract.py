"""/openapi.json is a contract clients are generated from: a schema-driven fuzz run
(schemathesis: its coverage, fuzzing and stateful phases, a bounded number of cases) against a
real `mminfer serve` process (CPU, the tiny Qwen2.5-VL checkpoint) finds no server error, no
undocumented status or content type, no response off its documented schema, no schema-invalid
request accepted, and 405s whose `Allow` lists the documented methods. Every route documents
each error it answers in the one JSON error shape."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.serve.app import ERROR_RESPONSES
from mminfer.serve.errors import ErrorResponse

ROOT = Path(__file__).resolve().parents[2]
# every check but positive_data_acceptance: a schema-valid form holds arbitrary bytes as its
# video, which the server must refuse (400/415/422), so "valid data accepted" cannot hold
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "unsupported_method,allow_header_conformance,missing_required_header,use_after_free,"
          "ensure_resource_availability")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    ckpt = save_tiny_qwen2_5_vl(tmp / "tiny-qwen")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MMINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", "serve", "--model", str(ckpt),
                          "--port", "0", "--data-dir", str(tmp / "data"), "--device", "cpu",
                          "--log-level", "warning", "--max-new-tokens", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url, lines = None, []
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline and p.poll() is None:
        line = p.stdout.readline()
        lines.append(line)
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
    assert url, "the server did not start:\n" + "".join(lines[-30:])
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()   # drain
    while httpx.get(f"{url}/health", timeout=10).json().get("status") != "ok":
        time.sleep(0.2)
    yield url
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


def test_schemathesis_finds_no_contract_failure(server, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server}/openapi.json",
         "--checks", CHECKS, "--phases", "coverage,fuzzing,stateful", "--max-examples", "15",
         "--workers", "1", "--seed", "47", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts, out[-3000:]
    generated, passed = map(int, counts.groups())
    assert generated == passed and generated >= 300, out[-3000:]
    selected, tested = re.search(r"Selected: (\d+)/\d+\s+Tested: (\d+)", out).groups()
    assert tested == selected == str(len(ERROR_RESPONSES)), out[-3000:]   # every operation


def test_every_route_documents_its_errors(server):
    spec = httpx.get(f"{server}/openapi.json").json()
    ops = {(m, p): op for p, methods in spec["paths"].items() for m, op in methods.items()}
    assert set(ops) == set(ERROR_RESPONSES)          # a new route says what it answers
    assert "ErrorResponse" in spec["components"]["schemas"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for key, op in ops.items():
        errors = {int(s) for s in op["responses"] if s != "200"}
        if key == ("get", "/health"):
            assert errors == {503}
            continue
        assert errors == set(ERROR_RESPONSES[key]), key
        for s in errors:
            (ctype, media), = op["responses"][str(s)]["content"].items()
            assert ctype == "application/json"
            assert media["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    for status in (400, 404, 413, 415, 422, 429, 503, 504, 507):
        assert str(status) in ops[("post", "/v1/chat/completions")]["responses"]
    assert set(ops[("get", "/metrics")]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(ops[("post", "/v1/chat/completions")]["responses"]["200"]["content"]) == \
        {"application/json", "text/event-stream"}
    form = spec["components"]["schemas"]["AnswerForm"]
    assert form["additionalProperties"] is False
    assert form["oneOf"] == [{"required": ["video"]}, {"required": ["video_id"]}]
    assert form["properties"]["max_new_tokens"]["type"] == "integer"   # never null
    # what is answered has that shape
    r = httpx.get(f"{server}/v1/videos/video-nope")
    assert r.status_code == 404
    ErrorResponse.model_validate(r.json())
    r = httpx.post(f"{server}/v1/answer", data={"question": "q", "colour": "red"},
                   files={"video": ("v.mp4", b"x", "video/mp4")})
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]


def test_a_405_allows_the_documented_methods(server):
    r = httpx.request("OPTIONS", f"{server}/v1/videos/video-x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD"
    r = httpx.put(f"{server}/v1/answer")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.delete(f"{server}/v1/videos")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
    ErrorResponse.model_validate(r.json())
