"""lab/experiments/proxy_classes.py on the recorded H100 ingest run: the pieces at which the
estimator's integer arguments first take a new Triton class (after the two the warm-up
compiled) are exactly the pieces whose prefill jumped by more than half a second."""

import json
from pathlib import Path

from lab.experiments import proxy_classes

RUN = (Path(__file__).resolve().parents[2] / "benchmarks" / "results"
       / "2026-12-06-stream-ingest-h100-a3b2cbe" / "stream_ingest.json")


def test_new_classes_are_the_slow_pieces():
    pieces = json.loads(RUN.read_text())["ingest"]["stream"]["pieces"]
    flagged = [i for i, _, _ in proxy_classes.replay([p["tokens"] for p in pieces])]
    ms = [p["prefill_ms"] for p in pieces]
    jumps = [i + 1 for i in range(1, len(ms)) if ms[i] - ms[i - 1] > 500]
    assert flagged == [1, 2, 6, 8, 13, 17, 30]
    assert jumps == [i for i in flagged if i > 2]


def test_a_class_is_one_multiple_of_16_or_other():
    assert [proxy_classes.cls(x) for x in (1, 16, 17, 0, 32)] == ["1", "16", "-", "16", "16"]
    # the chunked layout's first piece is its own new kernel
    assert proxy_classes.replay([1 << 19])[0][2][-1] == "_sets_mass_chunk_kernel"
