"""The kernels package's shape: no import cycle between its modules (lazy imports count), and
the attention kernel lowers for Hopper (sm_90) on a machine without a GPU."""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mminfer.kernels

KERNELS = Path(mminfer.kernels.__file__).parent


def _imports(path: Path) -> set[str]:
    """Modules of mminfer.kernels that ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                found.update(n.split(".")[0] for n in names)
            elif (node.module or "").startswith("mminfer.kernels."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names
                         if a.name.startswith("mminfer.kernels."))
    return {m for m in found if (KERNELS / f"{m}.py").exists()}


def test_no_import_cycle_inside_kernels():
    graph = {p.stem: _imports(p) for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    assert "launch" not in graph["plan"] and "plan" not in graph["density"]
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, f"import cycle: {' -> '.join(path + [d])}"
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _lower(stages=("ttir",)):
    """Lower ``_sparse_attn_fwd`` for sm_90 as the GPU would compile it (no GPU needed:
    Triton's front end and the NVIDIA passes run on the host)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton._C.libtriton import ir

    from mminfer.kernels.sparse_attn_kernel import _sparse_attn_fwd

    target = GPUTarget("cuda", 90, 32)
    try:
        backend = make_backend(target)
    except Exception as e:  # no NVIDIA backend in this triton build
        print(f"SKIP: triton has no CUDA backend here: {e}")
        return []
    names = list(inspect.signature(_sparse_attn_fwd.fn).parameters)
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "OS": "*bf16",
                "L": "*fp32", "LS": "*fp32", "VFlag": "*i8"}
    pointers.update({n: "*i32" for n in ("TILES", "Table", "P", "VIdx", "VCnt", "SIdx",
                                          "SRange", "BIdx", "BCnt", "KGid")})
    out = []
    for family in range(4):
        for key_grouped in (False, True):
            const = dict(HEAD_D=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, FAMILY=family,
                         KEY_GROUPED=key_grouped, WRITE_LSE=True, COUNT=False, IEEE=False,
                         BLOCK_K=64, FAST=True, DMASK=False)
            sig = {n: "constexpr" if n in const else pointers.get(
                n, "fp32" if n == "qk_scale" else "i32") for n in names}
            src = ASTSource(fn=_sparse_attn_fwd, signature=sig,
                            constexprs={(names.index(k),): v for k, v in const.items()})
            options = backend.parse_options({"num_warps": 8, "num_stages": 3})
            ctx = ir.context()
            ir.load_dialects(ctx)
            backend.load_dialects(ctx)
            mod = src.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), ctx)
            passes: dict = {}
            backend.add_stages(passes, options, src.language)
            for stage in stages:
                mod = passes[stage](mod, {})
            out.append(str(mod))
    return out


def test_attention_kernel_lowers_for_hopper():
    """The slot fields are tl.constexpr globals: the interpreter would accept plain ints,
    the GPU compiler would not. Lowering every family for sm_90 catches it on a CPU (in a
    child process: under TRITON_INTERPRET=1 the kernels are not compilable objects)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    code = ("import tests.kernels.test_structure as t; "
            "print(sum('tt.dot' in x for x in t._lower()))")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    if "SKIP:" in res.stdout:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "8"   # 4 families x key groups on/off
