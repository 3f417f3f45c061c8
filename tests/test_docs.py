"""Every command in README.md and docs/*.md runs as written.

Each fenced ``bash`` block must parse (``bash -n``), and each command in it is checked by what
it calls: an ``mminfer`` command line must parse with the real parser (its subcommand and every
flag exist), a ``make`` target and the variables given to it must be the Makefile's, a ``curl``
must name a route the service has and files that exist, a script must exist and accept the flags
given. The cheap ones run for real: the CPU answer about a sample, and the sparse answer about
the long sample (slow: the Triton interpreter), whose density must be below 1. ``python``
blocks must compile. A command nothing here knows how to check fails the test, so a new kind
of command gets a checker instead of going unchecked.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mminfer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SAMPLES = ROOT / "samples" / "videos"


def blocks(lang: str):
    for path in DOCS:
        for m in FENCE.finditer(path.read_text()):
            if m.group(1) == lang:
                line = path.read_text()[:m.start()].count("\n") + 1
                yield f"{path.relative_to(ROOT)}:{line}", m.group(2)


def commands():
    """(where, argv) for every command of every bash block: continuation lines joined,
    comments dropped, ``$PWD`` as the repository root."""
    for where, text in blocks("bash"):
        pending = ""
        for line in text.replace("\\\n", " ").splitlines():
            pending += line.replace("$PWD", str(ROOT)) + "\n"
            try:                     # a quoted string may go on over the next lines
                argv = shlex.split(pending, comments=True)
            except ValueError:
                continue
            pending = ""
            if argv:
                yield where, argv
        assert not pending, f"{where}: unclosed quotation"


def split_env(argv):
    """``A=1 B=2 cmd ...`` -> ({A: 1, B: 2}, [cmd, ...])."""
    env = {}
    while argv and ASSIGN.match(argv[0]):
        k, v = argv[0].split("=", 1)
        env[k] = v
        argv = argv[1:]
    return env, argv


def mminfer_args(argv):
    """The arguments after the ``mminfer`` program, or None when argv does not run mminfer."""
    if argv[0] in (".venv/bin/mminfer", "mminfer"):
        return argv[1:]
    if "-m" in argv and argv[0] in ("torchrun", "python", "python3", ".venv/bin/python"):
        i = argv.index("-m")
        if argv[i + 1] == "mminfer":
            return argv[i + 2:]
    return None


def check_mminfer(args):
    parser = build_parser(args)
    try:
        parsed = parser.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"mminfer {' '.join(args)}: does not parse (exit {e.code})")
    assert getattr(parsed, "_run", None), f"mminfer {args}: no subcommand"


def makefile():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M))
    return targets, variables


def routes():
    src = "".join(p.read_text() for p in (ROOT / "mminfer" / "serve").glob("*.py"))
    return set(re.findall(r'"(/[a-z0-9/_-]*)"', src))


def check_curl(argv):
    urls = [a for a in argv if a.startswith("http")]
    assert len(urls) == 1, f"curl with one URL: {argv}"
    path = "/" + urls[0].split("/", 3)[3]
    assert path in routes(), f"{path}: no such route"
    for a in argv:
        if "=@" in a:
            f = a.split("=@", 1)[1]
            assert (ROOT / f).is_file(), f"{f}: no such file"
    if "-d" in argv:   # a JSON body; file:// URLs in it name files that exist
        body = json.loads(argv[argv.index("-d") + 1])
        for url in re.findall(r'"url": "file://([^"]+)"', json.dumps(body)):
            assert Path(url).is_file(), url


def check_script(interpreter, argv):
    """``python3 SCRIPT --flag ...`` / ``bash SCRIPT ...``: the script exists; a Python
    script's --help names every flag given."""
    script = ROOT / argv[0]
    assert script.is_file(), f"{argv[0]}: no such script"
    if interpreter == "bash":
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return
    flags = [a.split("=")[0] for a in argv[1:] if a.startswith("--")]
    if flags:
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        for f in flags:
            assert f in r.stdout, f"{argv[0]}: no flag {f}"


def check_ray(argv):
    """``ray start|stop|status ...`` (Ray's command, from the ray extra): its --help names
    every flag given."""
    assert argv[1] in ("start", "stop", "status"), argv
    flags = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
    ray = Path(sys.executable).parent / "ray"
    if not ray.is_file():
        pytest.skip("ray is not installed (pip install '.[ray]')")
    r = subprocess.run([str(ray), argv[1], "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for f in flags:
        assert f in r.stdout, f"ray {argv[1]}: no flag {f}"


def check(argv):
    _, argv = split_env(argv)
    args = mminfer_args(argv)
    if args is not None:
        return check_mminfer(args)
    cmd = argv[0]
    if cmd == "make":
        targets, variables = makefile()
        for a in argv[1:]:
            if "=" in a:
                name, value = a.split("=", 1)
                assert name in variables, f"make: no variable {name}"
                if name == "ARGS":             # `make run` passes them to `mminfer serve`
                    check_mminfer(["serve", *shlex.split(value)])
            else:
                assert a in targets, f"make: no target {a}"
    elif cmd == "curl":
        check_curl(argv)
    elif cmd in ("python", "python3", ".venv/bin/python"):
        if argv[1] == "-m":
            assert argv[2] == "pytest", argv
            rest = argv[3:]
            for i, a in enumerate(rest):       # test paths exist (values of -m/-k are not paths)
                if not a.startswith("-") and (i == 0 or rest[i - 1] not in ("-m", "-k")):
                    assert (ROOT / a.split("::")[0]).exists(), f"pytest: no {a}"
        else:
            check_script(cmd, argv[1:])
    elif cmd == "bash":
        check_script("bash", argv[1:])
    elif cmd == "ray":
        check_ray(argv)
    elif cmd == "docker":
        assert argv[1] in ("build", "run"), argv
        if argv[1] == "build":
            assert (ROOT / "Dockerfile").is_file()
    else:
        raise AssertionError(f"no check for a command starting with {cmd!r}: add one")


def test_docs_have_commands_and_every_bash_block_parses():
    found = list(blocks("bash"))
    assert len(found) >= 10
    for where, text in found:
        r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, f"{where}: {r.stderr}"


@pytest.mark.parametrize("where,argv", list(commands()),
                         ids=[f"{w}:{a[0]}" for w, a in commands()])
def test_command_is_runnable_as_written(where, argv):
    try:
        check(argv)
    except AssertionError as e:
        raise AssertionError(f"{where}: {shlex.join(argv)}\n{e}") from None


def test_python_blocks_compile():
    for where, text in blocks("python"):
        compile(text, where, "exec")


def test_docs_lines_are_short_and_plain():
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert len(line) <= 200, f"{path.name}:{i}: {len(line)} characters"
            for word in ("ft10", "ft11", "un-holds-out"):
                assert word not in line, f"{path.name}:{i}: {word}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 300


def _run_readme(argv, timeout):
    env, argv = split_env(argv)
    args = mminfer_args(argv)
    env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mminfer", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def _readme_answer(video):
    """The README's ``mminfer answer`` command about ``video``."""
    for where, argv in commands():
        if where.startswith("README") and video in " ".join(argv) and "answer" in argv:
            return argv
    raise AssertionError(f"the README has no answer command about {video}")


def test_readme_answer_about_the_sample_runs():
    r = _run_readme(_readme_answer("needle_0.mp4"), 300)
    assert r.returncode == 0, r.stderr[-2000:]
    expected = json.loads((SAMPLES / "answers.json").read_text())["needle_0.mp4"]["answer"]
    assert r.stdout.splitlines()[0] == expected


@pytest.mark.slow
def test_readme_sparse_answer_on_the_cpu_skips_work():
    """The README's sparse command about the long sample, as written (the Triton interpreter:
    a minute or two): the right answer, and a density below 1 printed."""
    r = _run_readme(_readme_answer("needle_long.mp4"), 600)
    assert r.returncode == 0, r.stderr[-2000:]
    expected = json.loads((SAMPLES / "answers.json").read_text())["needle_long.mp4"]["answer"]
    assert r.stdout.splitlines()[0] == expected
    density = float(re.search(r"attention sparse \(density ([0-9.]+)\)", r.stdout).group(1))
    assert density < 0.8, r.stdout
    # and it is the density the README says it prints
    said = re.search(r"attention sparse \(density ([0-9.]+)\)", (ROOT / "README.md").read_text())
    assert said and abs(float(said.group(1)) - density) <= 0.002, (said, density)


def test_readme_upload_once_example_shows_a_miss_first():
    """Followed in order, the README's first upload to /v1/videos is of bytes no earlier
    command asked about, so its first question is the miss the text promises."""
    asked = []
    for where, argv in commands():
        if not where.startswith("README"):
            continue
        files = [a.split("=@", 1)[1] for a in argv if "=@" in a]
        files += [a for a in argv if a.endswith(".mp4") and "=@" not in a]
        if argv[0] == "curl" and any(u.endswith("/v1/videos") for u in argv):
            (uploaded,) = files
            assert Path(uploaded).name not in asked, (uploaded, asked)
            return
        asked += [Path(f).name for f in files]
    raise AssertionError("the README uploads no video to /v1/videos")
