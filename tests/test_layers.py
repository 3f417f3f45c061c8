"""The package's layers import only downwards (kernels <- sparse <- models <- engine <-
{offline, serve, batch, cli}); ``python3 scripts/layers.py`` prints the graph."""

from conftest import load_script


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
