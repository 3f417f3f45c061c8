"""Compiles the lab's decode kernels (lab/experiments/ragged_decode.py, fork_flash.py) ahead of
time for Hopper (sm_90) with the Triton wheel's compiler, no GPU needed, and prints one JSON
line per kernel and variant: whether it compiled, and the error where not. The interpreter
runs code the compiler refuses (a variable whose type differs between the branches of an
``if``, or changes in a loop), so the CPU tests alone do not show a kernel builds. Run without
TRITON_INTERPRET; lab/tests/test_compile_sm90.py calls it."""

import json
import os

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without the interpreter"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lab.experiments import fork_flash, ragged_decode  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, signature: dict, consts: dict, variant: str):
    sig = {n: signature.get(n, "constexpr") for n in fn.arg_names}
    missing = [n for n in fn.arg_names if sig[n] == "constexpr" and n not in consts]
    assert not missing, (fn.__name__, missing)
    row = {"kernel": fn.__name__, "variant": variant}
    try:
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                             options={"num_warps": 4})
        row["cubin_bytes"] = len(out.asm["cubin"])
    except Exception as e:        # noqa: BLE001 - reported, the test fails on it
        row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(row), flush=True)


def main():
    ptrs = {"PTRS": "*i64", "LENS": "*i64"}
    for cache, fp8, q in ((tl.bfloat16, False, "*bf16"), (tl.float8e4nv, True, "*bf16"),
                          (tl.float16, False, "*fp16")):
        name = f"{cache}"
        compile_one(ragged_decode._append_kernel,
                    {**ptrs, "KN": q, "VN": q, "skn_b": "i32", "skn_h": "i32", "svn_b": "i32",
                     "svn_h": "i32"}, {"D": 128, "BLOCK_D": 128, "CACHE": cache, "FP8": fp8},
                    name)
        for G, block_m in ((7, 64), (1, 16)):          # the 7B's groups; one head a group
            compile_one(ragged_decode._attend_kernel,
                        {**ptrs, "Q": q, "GROUPS": "*i32", "PO": "*fp32", "PL": "*fp32",
                         "sq_b": "i32", "sq_h": "i32", "qk_scale": "fp32", "SPLIT": "i32"},
                        {"G": G, "D": 128, "HKV": 4, "S": 30, "S0": 29, "MAXM": 8,
                         "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_D": 128,
                         "PRECISION": "ieee", "CACHE": cache, "FP8": fp8}, f"{name} G={G}")
    compile_one(ragged_decode._merge_kernel,
                {"PO": "*fp32", "PL": "*fp32", "LENS": "*i64", "O": "*bf16", "so_b": "i32",
                 "so_h": "i32", "SPLIT": "i32"},
                {"G": 7, "D": 128, "HKV": 4, "S": 30, "BLOCK_G": 8, "BLOCK_D": 128}, "bf16")
    strides = ("so1_h", "so1_m", "sl1_h", "sl1_m", "spo_s", "spo_h", "spo_m", "spl_s", "spl_h",
               "spl_m", "so_h", "n_slots")
    compile_one(fork_flash._merge_flash,
                {"O1": "*bf16", "L1": "*fp32", "PO": "*fp32", "PL": "*fp32", "O": "*bf16",
                 **{n: "i32" for n in strides}, "l2_factor": "fp32"},
                {"G": 7, "D": 128, "BLOCK_G": 8, "BLOCK_D": 128}, "bf16")


if __name__ == "__main__":
    main()
