"""A matrix quantized to fp8 (e4m3) with a scale a row (its absolute maximum over 448), found on the device at every
call: the input of an fp8 weight's product over a prefill chunk's rows (``models/fp8.py``), which cuBLAS multiplies
at the fp8 rate. A program a row finds the row's maximum, then writes the row.

Rounding to e4m3 is done in fp32 before the cast (round to nearest, ties to even, as the GPU's conversion rounds),
so that the cast itself is exact: Triton's CPU interpreter converts a value just below a power of two (125.5)
to half the nearest e4m3 value (64 rather than 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
TINY = 1e-12  # the smallest absolute maximum a scale is taken from (an all-zero tensor gets zeros)
BLOCK = 4096  # elements of a row a step of its program reads


def quantize_fp8_ref(x: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K], any float dtype -> (q: [M, K] float8_e4m3fn, scale: fp32 [1] (a weight's), or [M, 1] with
    ``per_row`` (an input's)) with
    q * scale ~= x: scale = max|x| / 448 (of the matrix, or of each row; at least 1e-12 / 448), q = x * (448 /
    max|x|) rounded to nearest, ties to even."""
    if per_row:
        amax = x.abs().amax(dim=-1, keepdim=True).float() if x.shape[-1] else x.new_zeros(x.shape[0], 1).float()
    else:
        amax = x.abs().amax().float().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
    amax = amax.clamp_min(TINY)
    top = torch.full_like(amax, FP8_MAX)  # tensor by tensor: PyTorch divides by a number as a product by its inverse
    q = (x.float() * (top / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, amax / top


@triton.jit
def _e4m3(v):
    """v: fp32 in [-448, 448] -> v rounded to e4m3 (nearest, ties to even), as float8e4nv: below 2^-6 (e4m3's
    subnormals) to a multiple of 2^-9, by adding 1.5 * 2^14, whose fp32 neighbours are 2^-9 apart, and taking it
    away again (from |v|, the sign put back); above it to 3 mantissa bits (the carry runs into the exponent)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    subnormal = (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign bit, a zero's too
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal).to(tl.float8e4nv)


@triton.jit
def _scaled(x, amax):
    """x (fp32) in units of amax / 448, clamped to e4m3's range."""
    y = x * tl.math.div_rn(448.0, amax)
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, BLOCK: tl.constexpr):
    """Program = one row of K elements: its max|x|, then the row quantized; scale_ptr[row] = max / 448."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * K + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    amax = tl.maximum(tl.max(amax, 0), 1e-12)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * K + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + start + offs, _e4m3(_scaled(x, amax)), mask=start + offs < K)
    tl.store(scale_ptr + row, tl.math.div_rn(amax, 448.0))


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`quantize_fp8_ref` with ``per_row`` (x: [M, K] -> q [M, K], scale [M, 1]; the same
    result: every element equal)."""
    x = x.contiguous()
    rows, width = x.shape
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, width, BLOCK=BLOCK, num_warps=8, launch_pdl=dependent(x))
    return q, scale
