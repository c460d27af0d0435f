"""Exponentials as one special-function instruction an element.

Triton lowers ``tl.exp2`` to PTX ``ex2.approx.f32``, which ptxas expands to four instructions an element (a compare
and two multiplies keep results below 2^-126 as denormals); ``tl.exp`` adds the multiply by log2(e). A softmax's
exponentials never need those denormals: each sum holds a term of 1 (the row's max), beside which 2^-126 is lost
anyway. ``ex2.approx.ftz.f32`` flushes them to zero in one instruction. Over fp8 keys the scores kernel's softmax
statistics issue a quarter of its instructions, and timed on its own the kernel is bound by instruction issue: the
flushed exponential takes it from 54.2 to 51.4 us a layer at 128K on an H200
(``benchmarks/results/supporting/scores_epilogue_157b2aa_h200.md``); the vote uses it too. The attention kernels
keep ``tl.exp2``: bound by memory or latency, they gained nothing from it (``decode_attention_ftz_h200.md`` there).
The CPU interpreter runs the plain ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dot import INTERPRETED


@triton.jit
def exp2_ftz(x):
    """2^x (fp32), results below 2^-126 flushed to zero; the interpreter's tl.exp2 elsewhere."""
    if INTERPRETED:
        return tl.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def exp_ftz(x):
    """e^x (fp32) as ``tl.exp`` computes it (2^(x log2 e)), results below 2^-126 flushed to zero."""
    return exp2_ftz(x * 1.4426950408889634)
