"""Named launch variants of the attention kernel, measured side by side against the current
one (``benchmarks/kernels.py --variants``) before any becomes the default.

A variant is a set of launch options laid over the device's tile config
(``runtime.GPU_CONFIG`` / ``CPU_CONFIG``): tile shape and pipeline depth (``BLOCK_N``,
``num_warps``, ``num_stages``) and the kernel's schedule / traversal switches (see the
head of ``_sparse_attn_fwd``). Every variant computes the same pair set and passes the same
exactness tests (``tests/kernels/test_variants.py``); only speed may differ. ``count_plan``
and ``plan.density()`` always follow the current kernel's traversal.
"""

from __future__ import annotations

# Kernel switches a variant may set, with the current kernel's values.
SWITCHES = {"SCHEDULE": 0, "EVEN_FAR": False, "SLASH_FLAT": False, "VGATHER": False,
            "TMA": False}

_ALL = ("a_shape", "grid", "vertical_slash", "block")

# Pipeline depth of the short masked loops (causal diagonal tiles, partial tail tiles):
# each pipelined loop holds its own K/V buffers, and with the tails pipelined too the
# current 64-key, 3-stage kernel takes 224 KB of shared memory on sm_90 (the limit is
# 227 KB), which is what kept 128-key tiles and 4 stages out. With the tails unpipelined:
# 128 KB at 64/3, 160 KB at 64/4 and 128/2, 224 KB at 128/3 (Triton 3.6, lowered for
# sm_90 on the host; no spills at 128-key tiles, 254 registers).
_TAIL1 = {"TAIL_STAGES": 1}
_BN128 = {"BLOCK_N": 128, "num_stages": 2, **_TAIL1}
_BN128_S3 = {"BLOCK_N": 128, "num_stages": 3, **_TAIL1}
_FAR = {"EVEN_FAR": True, "SLASH_FLAT": True, "VGATHER": True}

# name -> (launch options, families whose kernel it changes)
VARIANTS = {
    "current": ({}, _ALL),
    "tail1": (_TAIL1, _ALL),
    "s4": ({"num_stages": 4, **_TAIL1}, _ALL),
    # 128-key tiles: half the loop trips and online-softmax rescales per key.
    "bn128": (_BN128, _ALL),
    "bn128_s3": (_BN128_S3, _ALL),
    # The query heads of one row block launched side by side (a KV group's heads read the
    # same keys, from L2), longest rows first over all slots.
    "heads_inner": ({"SCHEDULE": 1}, _ALL),
    # Unmasked loads and logits on the full tiles of key blocks and gathered verticals.
    "even_far": ({"EVEN_FAR": True}, ("vertical_slash", "block")),
    # Slash ranges in one flat pipelined tile loop.
    "slash_flat": ({"SLASH_FLAT": True}, ("vertical_slash",)),
    # Verticals from a per-slot gathered copy of their K/V rows: contiguous tiles.
    "vgather": ({"VGATHER": True, "EVEN_FAR": True}, ("vertical_slash",)),
    # Full contiguous tiles through tensor descriptors (the copy engine, TMA).
    "tma": ({"TMA": True, **_TAIL1}, _ALL),
    "tma_bn128": ({"TMA": True, **_BN128}, _ALL),
    "combined": ({"SCHEDULE": 1, **_FAR, **_TAIL1}, _ALL),
    "combined_bn128": ({"SCHEDULE": 1, **_FAR, **_BN128}, _ALL),
    "combined_bn128_s3": ({"SCHEDULE": 1, **_FAR, **_BN128_S3}, _ALL),
    "combined_tma_bn128": ({"SCHEDULE": 1, "TMA": True, **_FAR, **_BN128}, _ALL),
}


# Each family's fastest variant in one H200 kernel run (BENCHMARKS.md section 7, 2026-12-01,
# 128K tokens, density 0.1, bf16 28/4 heads d 128): block 1.053-1.064x the current kernel,
# A-shape 1.065-1.069x, grid 1.054-1.069x, vertical-slash 1.033-1.034x. The default of every
# GPU launch that names no variant, since the product's prefill engine (key-grouped launches
# included) measured its attention stage at 0.970x the current kernel's side by side
# (benchmarks/run_variants_ab_h200.sh, 131K tokens, 2026-12-01).
FAMILY_FASTEST = {"block": "combined_tma_bn128", "a_shape": "combined_bn128_s3",
                  "grid": "combined_bn128_s3", "vertical_slash": "combined_bn128_s3"}


def options(variant: str | None) -> dict:
    """The launch options of a named variant (``None``: the current kernel)."""
    if variant is None:
        return {}
    try:
        return dict(VARIANTS[variant][0])
    except KeyError:
        raise ValueError(f"unknown kernel variant {variant!r}; one of {sorted(VARIANTS)}") \
            from None


def affects(variant: str, family: str) -> bool:
    """Whether the variant changes the kernel that runs for this family."""
    return family in VARIANTS[variant][1]
