"""The tensor-core product the kernels share, and the operand type each product runs in.

A query times keys runs on the tensor cores in the query's own 16-bit type wherever the keys convert into it
exactly: keys of that type. fp8 keys (every e4m3 and e5m2 value is an fp16) run in fp16 whatever the query's 16-bit
type: on sm_90 e4m3 converts to fp16 in one instruction a pair of values but to bf16 through fp32, and that
conversion held TokenSelect's scoring over fp8 keys at 57% of its floor on an H200 against 70-76% in fp16
(``benchmarks/results/supporting/fp8_scores_h200.md``). A bf16 query converts into fp16 exactly from 2^-14 to
65504 in magnitude; values beyond are clamped to 65504 (``as_dot_type``), smaller ones keep fewer bits. A product
of two 16-bit floats is exact in the fp32 accumulator, so the scores equal fp32 arithmetic on the same values up to
the order of the sums, at twice the tensor cores' tf32 rate and half the operand registers. fp32 operands get IEEE
fp32 products; a bf16 query against fp16 keys (or the reverse) goes through tf32, in which both are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton 3.6's CPU interpreter multiplies bf16 dot operands as their raw 16-bit patterns; there the
# 16-bit operands go to tl.dot as fp32 (the same products: a product of two 16-bit floats is exact in fp32)
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)

DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def exact_dot_type(q_dtype: torch.dtype, k_dtype: torch.dtype) -> tuple[tl.dtype, bool]:
    """(the type a query of q_dtype times keys of k_dtype is multiplied in, IEEE) for :func:`mma`, with no
    rounding of the keys and none of the query within fp16's range (see the module): the query's 16-bit type for
    keys of that type, fp16 for fp8 keys, else fp32 (IEEE products when either side is fp32, tf32 products
    otherwise)."""
    if torch.float32 in (q_dtype, k_dtype):
        return tl.float32, True
    if q_dtype in DOT_TYPES and k_dtype in FP8_TYPES:
        return tl.float16, False
    if q_dtype in DOT_TYPES and k_dtype == q_dtype:
        return DOT_TYPES[q_dtype], False
    return tl.float32, False


def query_dot_type(q_dtype: torch.dtype, k_dtype: torch.dtype) -> tuple[tl.dtype, bool]:
    """(the type, IEEE) for :func:`mma` where the keys (and probabilities) are cast to the query's type, as the
    attention kernels and their references do: the query's 16-bit type, or fp32 with IEEE products when either
    side is fp32."""
    if torch.float32 in (q_dtype, k_dtype):
        return tl.float32, True
    return DOT_TYPES[q_dtype], False


@triton.jit
def as_dot_type(x, DOT_TY: tl.constexpr):
    """x in the product's type; into fp16 clamped to its largest finite value (a bf16 query against fp8 keys)."""
    if DOT_TY == tl.float16:
        return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return x.to(DOT_TY)


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] accumulated in fp32, both operands already in one type: full-precision products for
    fp32 operands with IEEE, tf32 ones without; 16-bit operands' products on the tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="tf32")
    return tl.dot(a, b)
