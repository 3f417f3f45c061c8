"""Compiles every FP8 quantising kernel of mminfer.kernels.fp8_quant ahead of time for Hopper
(sm_90) with the Triton wheel's own ptxas, no GPU needed, and prints one JSON line per kernel:
whether a cubin came out, how many e4m3 conversions its PTX holds by the hardware's
instruction, and whether it still rounds onto the e4m3 grid first (a control kernel that does
is compiled too). Run without TRITON_INTERPRET (the interpreter path rounds on the grid
instead); the test that calls it is
tests/kernels/test_fp8_quant.py::test_compiled_kernels_convert_with_the_hardware_instruction."""

import json
import os

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mminfer.kernels import fp8_quant  # noqa: E402
import triton.language as tl  # noqa: E402

# the grid's rounding constant 1.5 * 2^14 as PTX writes an fp32 immediate: present only where
# a kernel rounds onto the e4m3 grid in fp32 arithmetic (the interpreter's path)
GRID_MARK = "0f46C00000"


@triton.jit
def _grid_control_kernel(X, Q, N, BLOCK: tl.constexpr):
    # the control: the grid's path compiled, so the test sees the mark can be found
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(X + at, mask=at < N, other=0.0)
    tl.store(Q + at, fp8_quant._e4m3_grid(v).to(Q.dtype.element_ty), mask=at < N)


P_IN, P_Q, P_S, P_W = "*bf16", "*fp8e4nv", "*fp32", "*bf16"
STRIDES = {"stride_x": "i32", "stride_q": "i32", "stride_d": "i32", "stride_g": "i32",
           "stride_u": "i32", "stride_h": "i32"}
# kernel, its pointer/scalar arguments, constexprs: each at a width the served models use
KERNELS = [
    (fp8_quant._quant_kernel, {"X": P_IN, "Q": P_Q, "S": P_S, "C": "i32"}, {"BLOCK_C": 1024}),
    (fp8_quant._quant_rows_kernel, {"X": P_IN, "Q": P_Q, "S": P_S, "N": "i32", "C": "i32"},
     {"BLOCK_R": 2, "BLOCK_C": 2048}),
    (fp8_quant._rms_norm_quant_kernel, {"X": P_IN, "D": P_IN, "W": P_W, "Q": P_Q, "S": P_S,
                                  "C": "i32", "eps": "fp32"}, {"HAS_D": True, "BLOCK_C": 4096}),
    (fp8_quant._silu_mul_quant_kernel, {"G": P_IN, "U": P_IN, "Q": P_Q, "S": P_S, "C": "i32"},
     {"BLOCK_C": 1024}),
    (fp8_quant._silu_mul_quant_row_kernel, {"G": P_IN, "U": P_IN, "Q": P_Q, "S": P_S, "C": "i32"},
     {"BLOCK_C": 4096}),
    (fp8_quant._layer_norm_quant_kernel, {"X": P_IN, "D": P_IN, "W": P_W, "B": P_W, "Q": P_Q,
                                    "S": P_S, "C": "i32", "eps": "fp32"},
     {"HAS_D": True, "BLOCK_C": 2048}),
    (fp8_quant._gelu_tanh_quant_kernel, {"H": P_IN, "Q": P_Q, "S": P_S, "C": "i32"},
     {"BLOCK_C": 8192}),
    (_grid_control_kernel, {"X": "*fp32", "Q": P_Q, "N": "i32"}, {"BLOCK": 1024}),
]


def main():
    target = GPUTarget("cuda", 90, 32)
    for fn, args, consts in KERNELS:
        names = fn.arg_names
        sig = {n: args.get(n) or STRIDES.get(n) or "constexpr" for n in names}
        missing = [n for n in names if sig[n] == "constexpr" and n not in consts]
        assert not missing, (fn.__name__, missing)
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                             options={"num_warps": 4})
        ptx = out.asm["ptx"]
        print(json.dumps({"kernel": fn.__name__, "cubin_bytes": len(out.asm["cubin"]),
                          "cvt_e4m3": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                          "grid_mark": ptx.count(GRID_MARK),
                          "sm": 90}), flush=True)


if __name__ == "__main__":
    main()
