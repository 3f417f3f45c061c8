"""The package's layers import only downwards (kernels <- sparse <- models <- engine <-
{offline, serve, batch, cli}); ``python3 scripts/layers.py`` prints the graph. Every Triton
kernel of the package lives in its kernels layer."""

import ast
from pathlib import Path

from conftest import REPO, load_script


def _layers():
    return load_script("scripts/layers.py")


def test_every_import_points_down():
    L = _layers()
    assert L.violations() == []
    g = L.graph()
    # the graph is read from the real source: the arrows we know of are there
    assert "kernels" in g["sparse"] and "sparse" in g["models"] and "models" in g["engine"]
    assert not g.get("kernels"), "kernels import nothing of mminfer"


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    L = _layers()
    pkg = tmp_path / "mminfer"
    for sub in ("kernels", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    # a lazy import inside a function counts as much as a top-level one
    (pkg / "kernels" / "bad.py").write_text("def f():\n    from mminfer.engine import x\n")
    (pkg / "engine" / "x.py").write_text("from ..kernels import bad\n")
    monkeypatch.setattr(L, "PKG", pkg)
    bad = L.violations()
    assert len(bad) == 1 and bad[0].startswith("kernels -> engine")



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
