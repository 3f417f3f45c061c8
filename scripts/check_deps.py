"""Do the dependency pins resolve against the public index alone? (issue 32, item 8)

A machine with a local wheel folder (find-links, extra indexes in pip.conf) can install what
a new user's machine cannot: the Makefile once pinned torch 2.13.0, whose PyPI (CUDA) wheel
requires triton 3.7.1, beside pyproject's triton 3.6.0, and only the local CPU wheel of torch
hid the ResolutionImpossible. This script resolves each set-up with ``pip install --dry-run
--report`` in isolation: ``PIP_CONFIG_FILE=/dev/null``, ``--isolated``, no ``PIP_*``
variables, so no find-links, no extra index, no constraint of this machine; only the indexes
the set-up itself names. Every file pip would fetch must come from an https index.

    cpu   the Makefile's set-up: its torch line (read from the Makefile: the version and the
          index it names), then triton and the package with its test extra, for this Python
    cuda  the Dockerfile's set-up: its torch line, then the package, for the image's Python
          on manylinux x86_64 (binary wheels, as the image installs them)

Exit 0: every set resolved (or was skipped because an index it needs is unreachable, said
so); 1: a set does not resolve (pip's reason printed); 3: nothing could be checked (no
network). ``--json`` prints the resolved versions.

    python scripts/check_deps.py [--set cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
UNREACHABLE = 3


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:                       # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements(extras: tuple[str, ...] = ()) -> list[str]:
    """The package's dependencies plus those of ``extras`` (a self-reference such as
    ``mminfer[ray]`` expanded)."""
    proj = pyproject()["project"]
    name = proj["name"]
    out = list(proj["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in proj.get("optional-dependencies", {})[extra]:
            m = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", req.replace(" ", ""))
            if m:
                todo.extend(m.group(1).split(","))
            else:
                out.append(req)
    return out


def make_variables(text: str) -> dict:
    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"^([A-Z_]+)\s*[:?]?=\s*(.*)$", text, re.M)}


def install_lines(text: str, marker: str, variables: dict | None = None) -> list[list[str]]:
    """The arguments after ``marker`` ("pip install") on each line that has it, make
    variables expanded."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or marker not in line:
            continue
        rest = line.split(marker, 1)[1]
        for k, v in (variables or {}).items():
            rest = rest.replace(f"$({k})", v)
        out.append(shlex.split(rest))
    return out


def split_args(args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(requirements, indexes, extras of the local package) of pip install arguments."""
    reqs, indexes, extras = [], [], []
    it = iter(args)
    for a in it:
        if a in ("&&", "||", ";", "\\", "|"):        # the end of this command on the line
            break
        if a in ("--index-url", "-i", "--extra-index-url"):
            indexes.append(next(it))
        elif a in ("-q", "--upgrade", "-U", "-e", "--editable", "--no-cache-dir"):
            continue
        elif a.startswith("."):
            m = re.fullmatch(r"\.\[([^\]]+)\]", a)
            extras += m.group(1).split(",") if m else []
            reqs.append(".")
        elif not a.startswith("-"):
            reqs.append(a)
    return reqs, indexes, extras


def cpu_set() -> list[dict]:
    """The Makefile's set-up as resolution steps: a torch line that names its own index is
    resolved on its own (that index holds torch only), the rest against PyPI."""
    text = (ROOT / "Makefile").read_text()
    lines = install_lines(text, "pip install", make_variables(text))
    steps, rest, rest_extras = [], [], []
    for args in lines:
        reqs, indexes, extras = split_args(args)
        if reqs == [] or "pip" in reqs:
            continue
        if indexes and all(r.startswith("torch") for r in reqs):
            steps.append({"name": "cpu: torch from " + ", ".join(indexes), "reqs": reqs,
                          "indexes": indexes, "no_deps": True})
            continue
        rest += [r for r in reqs if r != "."]
        rest_extras += extras
        if "." in reqs:
            rest += requirements(tuple(rest_extras))
    if steps:             # torch came from its own index: the rest must live without it
        rest = [r for r in rest if not re.match(r"torch\b(?![-_])", r)]
    steps.append({"name": "cpu: the package and the rest from PyPI", "reqs": rest,
                  "indexes": []})
    return steps


def cuda_set() -> list[dict]:
    text = (ROOT / "Dockerfile").read_text()
    reqs = []
    for args in install_lines(text, "uv pip install"):
        r, _, extras = split_args(args)
        reqs += [x for x in r if x != "."]
        if "." in r:
            reqs += requirements(tuple(extras))
    m = re.search(r"uv venv --python (\d+\.\d+)", text)
    return [{"name": "cuda: the image (torch + the package) from PyPI", "reqs": reqs,
             "indexes": [], "python": m.group(1) if m else "3.11",
             # the image's glibc (Ubuntu 22.04: 2.35) takes every manylinux tag up to 2_35
             "platforms": [f"manylinux_2_{m}_x86_64" for m in range(35, 4, -1)] +
                          ["manylinux2014_x86_64", "manylinux2010_x86_64",
                           "manylinux1_x86_64"]}]


def reachable(url: str, timeout: float = 15.0) -> str | None:
    """None if ``url`` answers, else why not."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/", timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return None if e.code < 500 else f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def resolve(step: dict) -> dict:
    """pip's dry-run report of one step, or {"error": pip's reason}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run",
               "--ignore-installed", "--disable-pip-version-check", "-q",
               "--report", str(report), "--index-url", PYPI]
        for index in step["indexes"]:
            cmd += ["--extra-index-url", index]
        if step.get("no_deps"):
            cmd.append("--no-deps")
        if step.get("platforms"):
            for tag in step["platforms"]:
                cmd += ["--platform", tag]
            cmd += ["--python-version", step["python"], "--only-binary=:all:",
                    "--target", str(Path(tmp) / "target")]
        cmd += step["reqs"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
        if r.returncode != 0:
            return {"error": (r.stderr or r.stdout).strip()[-3000:]}
        data = json.loads(report.read_text())
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}
    local = [i["download_info"]["url"] for i in data["install"]
             if not i["download_info"]["url"].startswith("https://")]
    if local:
        return {"error": f"files from outside an https index: {local[:5]}"}
    return {"versions": got}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("cpu", "cuda"), action="append",
                    help="check only this set-up (default: both)")
    ap.add_argument("--json", action="store_true", help="print the resolved versions")
    a = ap.parse_args(argv)
    why = reachable(PYPI)
    if why is not None:
        print(f"check_deps: skipped: the public index {PYPI} cannot be reached ({why})")
        return UNREACHABLE
    steps = []
    for name in a.set or ("cpu", "cuda"):
        steps += cpu_set() if name == "cpu" else cuda_set()
    failed, results = 0, {}
    for step in steps:
        down = [i for i in step["indexes"] if reachable(i) is not None]
        if down:
            print(f"skipped  {step['name']}: the index {down[0]} cannot be reached from "
                  f"here ({reachable(down[0])}); CI with network checks it")
            continue
        out = resolve(step)
        results[step["name"]] = out
        if "error" in out:
            failed += 1
            print(f"FAILED   {step['name']}\n  requirements: {' '.join(step['reqs'])}\n"
                  f"{out['error']}")
        else:
            v = out["versions"]
            print(f"ok       {step['name']}: " + ", ".join(
                f"{k} {v[k]}" for k in ("torch", "triton", "transformers", "httpx", "ray")
                if k in v))
    if a.json:
        print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
