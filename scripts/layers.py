"""The import graph between mminfer's layers, and a check that every arrow points down.

    python3 scripts/layers.py          # prints the layer graph; exit 1 on an upward import

Reads the source (ast), so lazy imports inside functions count too. The layers, lowest
first; a module may import its own layer and any layer listed in ALLOWED for it.
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
    "serve": {"errors", "kernels", "sparse", "video", "models", "engine", "cli_options"},
    "batch": {"errors", "kernels", "sparse", "video", "models", "engine", "cli_options"},
    "cli": {"errors", "kernels", "sparse", "video", "models", "engine", "offline", "serve",
            "batch", "cli_options"},
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


def imports_of(path: Path) -> set[str]:
    """Absolute names of the mminfer modules this file imports, lazy imports included."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from mminfer.offline import synthetic` names a submodule, not an attribute
            found.update(f"{target}.{a.name}" for a in node.names
                         if (PKG.parent / target.replace(".", "/") / a.name).exists()
                         or (PKG.parent / (target.replace(".", "/") + f"/{a.name}.py")).exists())
    return {m for m in found if m == "mminfer" or m.startswith("mminfer.")}


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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
