"""The package's layers import only downwards (kernels <- sparse <- models <- engine <-
{offline, serve, batch, cli}; video below models, engine and the interfaces), and no modules
import each other in a circle; ``python3 scripts/layers.py`` prints the graph. Every Triton
kernel of the package lives in its kernels layer."""

import ast
from pathlib import Path

from conftest import REPO, load_script


def _layers():
    return load_script("scripts/layers.py")


def _package(root, files: dict[str, str]):
    """A package ``mminfer`` under ``root`` with these files (and every ``__init__.py``)."""
    pkg = root / "mminfer"
    for rel, text in files.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        for d in [f.parent, *f.parent.parents]:
            if d == root:
                break
            (d / "__init__.py").touch()
        f.write_text(text)
    return pkg


def test_every_import_points_down():
    L = _layers()
    assert L.violations() == []
    g = L.graph()
    # the graph is read from the real source: the arrows we know of are there
    assert "kernels" in g["sparse"] and "sparse" in g["models"] and "models" in g["engine"]
    assert "video" in g["models"] and "video" in g["engine"] and "video" in g["serve"]
    assert not g.get("kernels"), "kernels import nothing of mminfer"
    assert set(g["video"]) <= {"errors"}, "video knows nothing of models, engine or HTTP"


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    L = _layers()
    # a lazy import inside a function counts as much as a top-level one
    pkg = _package(tmp_path, {"kernels/bad.py": "def f():\n    from mminfer.engine import x\n",
                              "engine/x.py": "from ..kernels import bad\n"})
    monkeypatch.setattr(L, "PKG", pkg)
    bad = L.violations()
    assert len(bad) == 1 and bad[0].startswith("kernels -> engine")


def test_video_importing_the_models_is_upward(tmp_path, monkeypatch):
    L = _layers()
    pkg = _package(tmp_path, {"video/stream.py": "from mminfer.models import base\n",
                              "models/base.py": "from mminfer.video import stream\n",
                              "engine/pipeline.py": "from mminfer.video import stream\n"})
    monkeypatch.setattr(L, "PKG", pkg)
    bad = L.violations()
    assert len(bad) == 1 and bad[0].startswith("video -> models"), bad


def test_there_are_no_import_cycles():
    L = _layers()
    assert L.cycles() == []
    g = L.module_graph()
    # read from the real source, module-level imports only, the packages passed through
    assert "mminfer.video.session" in g["mminfer.video.remote"]
    assert "mminfer.video" in g["mminfer.models.longvila"]       # video/__init__ runs too
    assert not any(m.startswith("mminfer.video") for m in g["mminfer.serve.cli"])


def test_cycles_in_a_graph_are_found_and_spelled_out():
    L = _layers()
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}, "s": {"s"}}
    assert L.cycles(g) == [["a", "b", "c", "a"], ["s", "s"]]
    assert L.cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_module_level_import_cycles_are_found(tmp_path, monkeypatch):
    """Two modules importing each other at the top make a cycle; lazy imports and ``if
    TYPE_CHECKING:`` do not run on import, and importing a module of a package runs the
    package's ``__init__`` first."""
    L = _layers()
    pkg = _package(tmp_path, {
        "engine/frames.py": "from mminfer.engine import sandbox\n",
        "engine/sandbox.py": "from mminfer.engine.frames import Session\n",
        "engine/lazy.py": "def f():\n    from mminfer.engine import other\n",
        "engine/other.py": "from typing import TYPE_CHECKING\nfrom mminfer.engine import lazy\n"
                           "if TYPE_CHECKING:\n    from mminfer.engine import typed\n",
        "engine/typed.py": "from mminfer.engine import other\n",
        "video/__init__.py": "from mminfer.video.stream import x\n",
        "video/stream.py": "import mminfer.models.m\n",
        "models/m.py": "from mminfer.video.sampling import rule\n",
        "video/sampling.py": "",
    })
    monkeypatch.setattr(L, "PKG", pkg)
    assert L.cycles() == [
        ["mminfer.engine.frames", "mminfer.engine.sandbox", "mminfer.engine.frames"],
        ["mminfer.models.m", "mminfer.video", "mminfer.video.stream", "mminfer.models.m"]]


def test_the_script_fails_on_a_cycle_alone(tmp_path, monkeypatch, capsys):
    L = _layers()
    pkg = _package(tmp_path, {"video/stream.py": "from mminfer.video import remote\n",
                              "video/remote.py": "from .stream import VideoStream\n"})
    monkeypatch.setattr(L, "PKG", pkg)
    assert L.violations() == [] and L.main() == 1
    out = capsys.readouterr().out
    assert "CYCLE mminfer.video.remote -> mminfer.video.stream -> mminfer.video.remote" in out

def _dotted(node) -> str:
    """``triton.jit`` for the decorator ``@triton.jit`` or ``@triton.jit(...)``."""
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def jit_functions_outside_kernels(pkg: Path) -> list[str]:
    """``path:function`` of every ``@triton.jit`` (or ``@jit`` imported from triton)
    function of the package ``pkg`` outside ``pkg/kernels/``."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.parts[0] == "kernels":
            continue
        tree = ast.parse(path.read_text())
        jit_names = {"triton.jit"} | {a.asname or a.name for n in ast.walk(tree)
                                      if isinstance(n, ast.ImportFrom) and n.module == "triton"
                                      for a in n.names if a.name == "jit"}
        found += [f"{rel}:{fn.name}" for fn in ast.walk(tree)
                  if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and any(_dotted(d) in jit_names for d in fn.decorator_list)]
    return found


def test_every_triton_kernel_lives_in_kernels():
    assert jit_functions_outside_kernels(REPO / "mminfer") == [], (
        "Triton kernels belong in mminfer/kernels/ (the model-level code calls their "
        "launchers)")


def test_a_kernel_outside_kernels_is_caught(tmp_path):
    pkg = tmp_path / "mminfer"
    for sub in ("kernels", "models"):
        (pkg / sub).mkdir(parents=True)
    jit = "import triton\n\n\n@triton.jit\ndef k(X):\n    pass\n"
    (pkg / "kernels" / "ok.py").write_text(jit)
    (pkg / "models" / "a.py").write_text(jit.replace("@triton.jit", "@triton.jit(debug=True)"))
    (pkg / "models" / "b.py").write_text("from triton import jit as J\n\n\n@J\ndef g(X):\n"
                                         "    pass\n\n\ndef plain():\n    pass\n")
    assert jit_functions_outside_kernels(pkg) == ["models/a.py:k", "models/b.py:g"]
