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


class _Sm90:
    """Triton's compiler for sm_90 on the host (front end, NVIDIA passes and ptxas; no GPU),
    set up for ``_sparse_attn_fwd``: its argument names and pointer types. None-like
    (``ok`` False, the reason printed as ``SKIP:``) where this triton has no CUDA backend."""

    POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "OS": "*bf16",
                "L": "*fp32", "LS": "*fp32", "VFlag": "*i8", "KVert": "*bf16",
                "VVert": "*bf16", **{n: "*i32" for n in ("Table", "P", "VIdx", "VCnt",
                                                          "SIdx", "SRange", "BIdx", "BCnt",
                                                          "KGid")}}

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        from mminfer.kernels.sparse_attn_kernel import _sparse_attn_fwd
        self.fn = _sparse_attn_fwd
        self.target = GPUTarget("cuda", 90, 32)
        try:
            self.backend = make_backend(self.target)
        except Exception as e:  # no NVIDIA backend in this triton build
            print(f"SKIP: triton has no CUDA backend here: {e}")
            self.ok = False
            return
        self.ok = True
        self.names = list(inspect.signature(_sparse_attn_fwd.fn).parameters)

    def stages(self, const: dict, stages, *, num_warps: int, num_stages: int,
               descriptors: str | None = None, divisible: bool = False):
        """Yield ``(stage, module, metadata)`` through ``stages``. ``divisible``: pointers,
        strides and N marked divisible by 16, as a real launch specialises them (without it
        the loads are never pipelined)."""
        from triton.compiler import ASTSource
        from triton._C.libtriton import ir
        sig = {n: "constexpr" if n in const else self.POINTERS.get(
            n, "fp32" if n == "qk_scale" else "i32") for n in self.names}
        if descriptors:
            sig.update(KDesc=descriptors, VDesc=descriptors)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(self.names)
                 if divisible and n not in const and (sig[n].startswith("*") or
                                                     n.startswith("s") or n == "N")
                 and not sig[n].startswith("t")}
        src = ASTSource(fn=self.fn, signature=sig, attrs=attrs,
                        constexprs={(self.names.index(k),): v for k, v in const.items()})
        options = self.backend.parse_options({"num_warps": num_warps,
                                              "num_stages": num_stages})
        ctx = ir.context()
        ir.load_dialects(ctx)
        self.backend.load_dialects(ctx)
        mod = src.make_ir(self.target, options, self.backend.get_codegen_implementation(options),
                          self.backend.get_module_map(), ctx)
        passes: dict = {}
        md: dict = {}
        self.backend.add_stages(passes, options, src.language)
        for stage in stages:
            mod = passes[stage](mod, md)
            yield stage, mod, md


def _in_child(code: str, timeout: int):
    """Run ``code`` in a child python without TRITON_INTERPRET (under it the kernels are not
    compilable objects); skips where the child found no CUDA backend."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", "import tests.kernels.test_structure as t; "
                          + code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=timeout)
    if "SKIP:" in res.stdout:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _lower(stages=("ttir",)):
    """Lower ``_sparse_attn_fwd`` for sm_90 as the GPU would compile it, every family with
    and without key groups; the last stage's modules as text."""
    sm = _Sm90()
    if not sm.ok:
        return []
    out = []
    for family in range(4):
        for key_grouped in (False, True):
            const = dict(HEAD_D=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, FAMILY=family,
                         KEY_GROUPED=key_grouped, WRITE_LSE=True, PRECISION="tf32", BLOCK_K=64,
                         DMASK=False, TMA=False)
            *_, (_, mod, _) = sm.stages(const, stages, num_warps=8, num_stages=3)
            out.append(str(mod))
    return out


def test_attention_kernel_lowers_for_hopper():
    """The slot fields are tl.constexpr globals: the interpreter would accept plain ints,
    the GPU compiler would not. Lowering every family for sm_90 catches it on a CPU."""
    stdout = _in_child("print(sum('tt.dot' in x for x in t._lower()))", timeout=600)
    assert stdout.strip().splitlines()[-1] == "8"   # 4 families x key groups on/off


def _shared_bytes_sm90():
    """Shared memory (bytes) of every family's kernel at its H200 launch configuration
    (``runtime.tile_config``), compiled to a cubin for sm_90 the way a launch specialises
    it. Returns [(family, BLOCK_N, shared, async copies, TMA copies in the ttgir)]."""
    from mminfer.kernels.layout import BLOCK, FAMILIES
    from mminfer.kernels.runtime import tile_config

    sm = _Sm90()
    if not sm.ok:
        return []
    out = []
    # the benchmark's plans: 128-row blocks, 64-key (block: 128-key) blocks
    for fname, family in FAMILIES.items():
        block_n = 128 if fname == "block" else 64
        cfg = tile_config(True, fname, 128, block_n)
        tma = family == BLOCK
        const = dict(HEAD_D=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=cfg["BLOCK_N"],
                     FAMILY=family, KEY_GROUPED=False, WRITE_LSE=False, PRECISION="tf32",
                     BLOCK_K=block_n, DMASK=False, TMA=tma)
        desc = f"tensordesc<bf16[1,1,{cfg['BLOCK_N']},128]>" if tma else None
        n_async = n_tma = 0
        for stage, mod, md in sm.stages(const, ("ttir", "ttgir", "llir", "ptx", "cubin"),
                                        num_warps=cfg["num_warps"],
                                        num_stages=cfg["num_stages"], descriptors=desc,
                                        divisible=True):
            if stage == "ttgir":
                n_async = str(mod).count("async_copy_global_to_local")
                n_tma = str(mod).count("async_tma_copy_global_to_local")
        out.append((fname, cfg["BLOCK_N"], int(md["shared"]), n_async, n_tma))
    return out


# sm_90's shared memory per block (227 KB): a kernel over it fails to launch on the H200.
SM90_SHARED = 232448


def test_each_family_fits_hopper_shared_memory_at_its_tiles():
    """Every family's kernel compiles for sm_90 (through ptxas) at its H200 tiles (128-key,
    the block family 128-key over 128-key blocks) with pipelined K/V loads, and fits the
    shared memory of one block: the unpipelined masked tails are what make room. Only the
    block family reads through the copy engine (TMA)."""
    stdout = _in_child("[print(*r) for r in t._shared_bytes_sm90()]", timeout=1200)
    rows = [line.split() for line in stdout.strip().splitlines()]
    got = {f: tuple(int(x) for x in rest) for f, *rest in rows}
    assert set(got) == {"a_shape", "grid", "vertical_slash", "block"}
    for f, (block_n, shared, n_async, n_tma) in got.items():
        assert block_n == 128, f"{f}: {block_n}-key tiles"
        assert n_async + n_tma > 0, f"{f}: K/V loads not pipelined"
        assert shared <= SM90_SHARED, f"{f}: {shared} B of shared memory"
        assert (n_tma > 0) == (f == "block"), f"{f}: {n_tma} TMA copies"
