"""The import graph between mminfer's layers, a check that every arrow points down, and a
check that no modules import each other in a circle.

    python3 scripts/layers.py          # prints the layer graph; exit 1 on an upward import
                                       # or an import cycle

Reads the source (ast). For the layers, lazy imports inside functions count too. For cycles,
the imports that run when a module is imported (its body, and the if/try/with/class blocks
in it; not functions, not ``if TYPE_CHECKING:``), each with the packages it passes through
(importing ``a.b.c`` runs ``a.b``'s ``__init__``). The layers, lowest first; a module may
import its own layer and any layer listed in ALLOWED for it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mminfer"

# layer -> the layers it may import (besides itself). errors is the shared base.
ALLOWED = {
    "errors": set(),
    "kernels": set(),
    "sparse": {"errors", "kernels"},
    "video": {"errors"},
    "models": {"errors", "kernels", "sparse", "video"},
    "engine": {"errors", "kernels", "sparse", "video", "models"},
    "offline": {"errors", "kernels", "sparse", "video", "models", "engine"},
    # interfaces: the options the command line shares, the service, the batch job, the command
    "cli_options": {"errors"},
    # the server calibrates a model itself (serve/selfcal.py runs offline's calibration)
    "serve": {"errors", "kernels", "sparse", "video", "models", "engine", "offline",
              "cli_options"},
    "batch": {"errors", "kernels", "sparse", "video", "models", "engine", "cli_options"},
    "batch_cli": {"errors", "cli_options", "batch"},
    "watch": {"errors", "video", "models", "engine", "cli_options"},
    "watch_cli": {"errors", "cli_options", "watch"},
    "cli": {"errors", "kernels", "sparse", "video", "models", "engine", "offline", "serve",
            "batch", "batch_cli", "cli_options"},
    "__init__": set(),
    "__main__": {"cli"},
}


def layer_of(module: str) -> str | None:
    """``mminfer.sparse.estimate`` -> ``sparse``; ``mminfer`` itself -> ``__init__``."""
    parts = module.split(".")
    if parts[0] != "mminfer":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_submodule(target: str, name: str) -> bool:
    folder = PKG.parent / target.replace(".", "/")
    return (folder / name).is_dir() or (folder / f"{name}.py").exists()


def _targets(node, package: str, *, names_only: bool = False) -> set[str]:
    """The modules an import statement names. ``from a import b``: ``a`` and, where ``b`` is
    a submodule (`from mminfer.offline import synthetic`), ``a.b``; with ``names_only``,
    ``a`` only where something imported is not a submodule (an attribute of ``a``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = package.split(".")
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = {f"{target}.{a.name}" for a in node.names if _is_submodule(target, a.name)}
    if not names_only or len(subs) < len(node.names):
        subs.add(target)
    return subs


def _package_of(path: Path) -> str:
    me = module_name(path)
    return me if path.name == "__init__.py" else me.rsplit(".", 1)[0]


def _ours(names) -> set[str]:
    return {m for m in names if m == "mminfer" or m.startswith("mminfer.")}


def imports_of(path: Path) -> set[str]:
    """Absolute names of the mminfer modules this file imports, lazy imports included."""
    package = _package_of(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _targets(node, package)
    return _ours(found)


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_on_import(tree):
    """The statements that run when the module is imported: its body and the blocks in it,
    class bodies included; not function bodies, not ``if TYPE_CHECKING:``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        for name in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(node, name, None) or [])


def module_imports_of(path: Path) -> set[str]:
    """The mminfer modules importing this file imports in turn: its module-level imports,
    each with the packages on the way to it (their ``__init__`` runs first), less this
    module's own packages (being imported already, they do not run again)."""
    me = module_name(path)
    package = _package_of(path)
    mine = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)} | {me}
    found = set()
    for node in _run_on_import(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, package, names_only=True):
                parts = target.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return _ours(found) - mine


def module_graph() -> dict[str, set[str]]:
    """mminfer module -> the mminfer modules its import runs (``module_imports_of``)."""
    return {module_name(p): module_imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def cycles(g=None) -> list[list[str]]:
    """Import cycles in the module graph ``g`` (default: mminfer's), one per group of modules
    that reach each other, each as a path ``[a, b, ..., a]`` starting at its first name."""
    g = module_graph() if g is None else g
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(v):                       # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in g.get(v, ()):
                groups.append(group)

    for v in sorted(g):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        # the shortest way back to the start inside the group: a cycle to print
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in g.get(v, ())]:
            nxt = []
            for v in frontier:
                for w in sorted(g.get(v, ())):
                    if w in group and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in g.get(v, ()))
        path = [start]
        while last is not None:
            path.append(last)
            last = prev[last]
        out.append(path[::-1])
    return sorted(out)


def graph() -> dict[str, dict[str, set[str]]]:
    """layer -> imported layer -> the modules making that import."""
    g: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        src = layer_of(me)
        for target in imports_of(path):
            dst = layer_of(target)
            if dst is None or dst == src or (dst == "__init__" and target == "mminfer"):
                continue
            g[src][dst].add(me)
    return g


def violations(g=None) -> list[str]:
    g = graph() if g is None else g
    bad = []
    for src, dsts in g.items():
        for dst, mods in dsts.items():
            if src not in ALLOWED:
                bad.append(f"{src}: not a known layer (add it to ALLOWED in scripts/layers.py)")
            elif dst not in ALLOWED[src]:
                bad.append(f"{src} -> {dst} (upward or sideways): {', '.join(sorted(mods))}")
    return bad


def main() -> int:
    g = graph()
    order = list(ALLOWED)
    for src in order:
        if src in g:
            print(f"{src:8s} -> {', '.join(d for d in order if d in g[src])}")
    bad = violations(g)
    for b in bad:
        print("VIOLATION", b)
    print("layering ok: every import points down" if not bad else f"{len(bad)} violation(s)")
    loops = cycles()
    for c in loops:
        print("CYCLE", " -> ".join(c))
    print("no import cycles" if not loops else f"{len(loops)} import cycle(s)")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    sys.exit(main())
