"""The product apart from the lab, and code whose comments say why rather than when.

Every module of the ``mminfer`` package is used by the product: imported by another module of
the package, or an entry point (the ``mminfer`` command, ``python -m mminfer``, the modules
named in ``cli.SUBCOMMANDS``, the adapters named in ``engine.pipeline.ADAPTER_MODULES``, the
decode worker's ``video.sandbox.WORKER_MODULE``). A module that only tests, benchmarks or the
lab import belongs with them. The package never imports the lab. And the built wheel holds the
package and its data (head-pattern configs, the embedded model), and nothing of the lab: no
fonts, renderers or training code.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
import zipfile
from pathlib import Path

import pytest

from mminfer.cli import SUBCOMMANDS
from mminfer.engine.pipeline import ADAPTER_MODULES
from mminfer.video.sandbox import WORKER_MODULE

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mminfer"
ENTRY_POINTS = {"mminfer", "mminfer.__main__", "mminfer.cli"}


def _modules(pkg=PKG) -> dict[str, Path]:
    """``mminfer.video.stream`` -> its file; a package by its ``__init__.py``."""
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _lazy_names(init: Path) -> dict[str, str]:
    """A package whose ``__getattr__`` imports names on first use (``mminfer.kernels``): its
    dict literals mapping a name to a submodule of the package, ``{name: submodule}``."""
    subs = {p.stem for p in init.parent.glob("*.py")}
    out = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if (isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                        and v.value in subs):
                    out[k.value] = v.value
    return out


def _imported_by_package(pkg=PKG) -> set[str]:
    """The mminfer modules some other module of the package imports (lazily or not; a name
    from a package's lazy table counts as its submodule), with the packages above each
    (importing ``a.b.c`` runs ``a.b``'s ``__init__``)."""
    modules = _modules(pkg)
    lazy = {name: _lazy_names(path) for name, path in modules.items()
            if path.name == "__init__.py"}
    used = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.add(target)
                for a in node.names:          # a submodule, or a name a lazy table resolves
                    if f"{target}.{a.name}" in modules:
                        found.add(f"{target}.{a.name}")
                    elif a.name in lazy.get(target, {}):
                        found.add(f"{target}.{lazy[target][a.name]}")
        for m in found - {name}:
            if m == "mminfer" or m.startswith("mminfer."):
                parts = m.split(".")
                used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return used


def unused_modules(pkg=PKG, entry_points=()) -> list[str]:
    used = _imported_by_package(pkg) | ENTRY_POINTS | set(entry_points)
    return sorted(set(_modules(pkg)) - used)


def test_every_package_module_is_used_by_the_product():
    entry = {m for m, _ in SUBCOMMANDS.values()} | set(ADAPTER_MODULES) | {WORKER_MODULE}
    assert unused_modules(entry_points=entry) == [], (
        "imported only by tests, benchmarks or the lab: move them there (or import them "
        "from the product)")


def test_a_module_only_tests_import_is_caught(tmp_path):
    pkg = tmp_path / "mminfer"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("def run():\n    from mminfer.engine import used\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "used.py").write_text("")
    (pkg / "engine" / "orphan.py").write_text("from mminfer.engine import used\n")
    # a package that imports names on first use: the name imported is what counts
    (pkg / "kernels").mkdir()
    (pkg / "kernels" / "__init__.py").write_text('_WHERE = {"f": "launch", "g": "spare"}\n')
    (pkg / "kernels" / "launch.py").write_text("def f(): pass\n")
    (pkg / "kernels" / "spare.py").write_text("def g(): pass\n")
    (pkg / "engine" / "used.py").write_text("from mminfer.kernels import f\n")
    assert unused_modules(pkg) == ["mminfer.engine.orphan", "mminfer.kernels.spare"]


def test_the_package_never_imports_the_lab():
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and
                     not node.level else [])
            assert not any(n == "lab" or n.startswith("lab.") for n in names), name


# History in a comment: an issue number, or a section number of the lab notes (which
# BENCHMARKS.md does not have: it is cited by its headings). Git and lab/NOTES.md keep history.
HISTORY = re.compile(r"\bissues? #?\d+|BENCHMARKS\.md,? (section|§) ?\d|§ ?\d|\bas before\b",
                     re.I)


def _comments_and_docstrings(path: Path):
    """(line, text) of every comment and docstring of a module; a Markdown file whole."""
    src = path.read_text()
    if path.suffix == ".md":
        yield 1, src
        return
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def history_in_comments(paths) -> list[str]:
    return [f"{p}:{line}: {m.group(0)}" for p in paths
            for line, text in _comments_and_docstrings(p) for m in HISTORY.finditer(text)]


def test_comments_say_why_not_when():
    """Comments and docstrings of the package cite no issue numbers and no lab-notes section
    numbers: the reason itself, or BENCHMARKS.md by heading."""
    paths = sorted([*PKG.rglob("*.py"), *PKG.rglob("*.md")])
    assert history_in_comments(paths) == [], "say why, not when (history goes to git)"


def test_history_in_a_comment_is_caught(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""A module (issue 34)."""\n\n\ndef f():\n    """Measured: BENCHMARKS.md '
                 'section 7."""\n    x = "issue 12"   # bf16: as before\n    return x  # why\n')
    md = tmp_path / "README.md"
    md.write_text("The landmarks (BENCHMARKS.md §4).\n")
    found = sorted(h.split(": ", 1)[1] for h in history_in_comments([f, md]))
    # the string literal "issue 12" is code, not a comment
    assert found == ["BENCHMARKS.md section 7", "BENCHMARKS.md §4", "as before", "issue 34"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the tree git knows (what a release builds from), so no stray build/ or
    # egg-info of the working tree gets into the wheel
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((ROOT / f).read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("mminfer-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_holds_the_package_and_its_data_and_no_lab(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"mminfer", next(t for t in top if t.endswith(".dist-info"))}, top
    assert not [n for n in names if n.endswith((".ttf", ".otf", ".npz"))]
    assert not [n for n in names if "/toy/" in n or "train" in Path(n).name
                or "render" in Path(n).name or "variety" in Path(n).name]
    for data in ("mminfer/models/configs/qwen2_5_vl_7b.json",
                 "mminfer/models/configs/longvila_7b_1m.json",
                 "mminfer/models/mminfer-embedded/model.safetensors",
                 "mminfer/models/mminfer-embedded/config.json",
                 "mminfer/models/mminfer-embedded/mminfer_patterns.json",
                 "mminfer/offline/synthetic.py", "mminfer/cli.py"):
        assert data in names, data
    # every module of the source package is in the wheel
    assert {f"mminfer/{p.relative_to(PKG)}" for p in PKG.rglob("*.py")} <= set(names)


def _unexplained_local_imports(path: Path) -> list[int]:
    """Lines of the imports inside a function of ``path`` that do not say why they are
    there: a ``# lazy:`` comment on the import, or a comment starting ``# lazy:`` right
    above it or above the imports just before it."""
    lines = path.read_text().splitlines()

    def explained(node) -> bool:
        if any("# lazy:" in lines[k - 1] for k in range(node.lineno, node.end_lineno + 1)):
            return True
        k = node.lineno - 1
        while k >= 1 and lines[k - 1].strip().startswith(("#", "import ", "from ")):
            if lines[k - 1].strip().startswith("# lazy:"):
                return True
            k -= 1
        return False

    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [n.lineno for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and not explained(n)]
    return sorted(set(out))


def test_imports_are_at_the_top_unless_a_comment_says_why():
    """An import inside a function hides where a name comes from: one stays there only for
    a reason its ``# lazy:`` comment gives (an optional or platform-only dependency, the
    command's edge: a subcommand's run loading the engine)."""
    found = {f"{p.relative_to(ROOT)}:{line}" for p in sorted(PKG.rglob("*.py"))
             for line in _unexplained_local_imports(p)}
    assert not found, "move these imports to the top, or say why not with '# lazy: ...'"


# The imports that may stay inside functions: the command's edge (a subcommand's run loads
# the engine, the app or the job; cli.py, serve/cli.py, batch_cli.py, offline/cli.py) and
# optional or platform-only dependencies (ray, decord, PyAV as a video backend, fcntl and
# resource). Everything else imports at the top of its module.
MAX_LOCAL_IMPORTS = 19


def _local_imports(path: Path) -> list[int]:
    """Lines of the import statements inside a function or method of ``path`` (nested
    ones counted once)."""
    out = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.update(n.lineno for n in ast.walk(fn)
                       if isinstance(n, (ast.Import, ast.ImportFrom)))
    return sorted(out)


def test_imports_inside_functions_are_few():
    """A function-local import is an exception (see MAX_LOCAL_IMPORTS): a module that needs
    torch, transformers, triton or FastAPI imports them at its top, and `mminfer --help` stays
    fast at the command's edge instead (tests/test_cli.py test_help_is_light)."""
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(PKG.rglob("*.py"))
             for line in _local_imports(p)]
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} imports inside functions (at most {MAX_LOCAL_IMPORTS}): move them to "
        "the top of their modules\n" + "\n".join(found))


def test_local_imports_are_counted(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\n\ndef f():\n    import json\n\n    def g():\n"
                 "        from a import b\n\n\nclass C:\n    import re\n\n"
                 "    async def m(self):\n        import ray\n")
    assert _local_imports(f) == [5, 8, 15]


def test_an_unexplained_local_import_is_caught(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import os\n\n\ndef g():\n    # lazy: a reason\n"
                 "    import ray\n    import ray.util\n\n\ndef h():\n"
                 "    import av  # lazy: a reason\n    import json\n")
    assert _unexplained_local_imports(f) == [2, 13]
