"""A few rows times an fp8 weight: x [M, K] @ (w [N, K] in e4m3 * scale)^T, the weight read once and widened to x's
dtype in registers, the activations not quantized: a decode step's projections with fp8 weights (``models/fp8.py``).

A decode step's product is bound by reading the weight. cuBLAS's fp8 product would need the activations in fp8 too:
with a scale a row its kernel is slower than bf16 at a few rows (0.3-0.6 of the weight's read floor on an H200), and
one scale over a CUDA graph's bucket of rows would let a padded row's values round the real rows' (the engine's
graphs then gave other tokens than its eager steps). Here each row keeps its own values, and each output is a row's exact products summed in fp32.

Program = ``BLOCK_N`` outputs of every row: the weight's ``BLOCK_N`` rows streamed in ``BLOCK_K`` columns at a time
(K contiguous), the rows of x (``BLOCK_M``: 16 or 32, at least 16 as ``tl.dot`` needs) read alongside from L2.
On an H200 at one row the Llama-3-8B shape's four projections take 86 us a layer against bf16's 118 (the weight
read at 40-80% of its floor; cuBLAS's fp8 product with one scale for the activations too takes 67 plus their
quantization); at 32 rows 114 against 123.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import mma
from .launch import dependent, wait_for_inputs

# rows of x (BLOCK_M, every row: the next of these at or above M) -> (BLOCK_N outputs, BLOCK_K columns a step, warps,
# pipeline stages), the fastest of benchmarks/fp8_weights_gpu.py's candidates on an H200 over the four projections.
# Past 32 rows cuBLAS's row-wise fp8 product with the rows quantized is faster (at 64: 123 against 190 us a layer).
TILES = {16: (32, 256, 4, 4), 32: (32, 256, 4, 4)}
MAX_ROWS = max(TILES)


def fp8_weight_product_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (any float dtype), weight: [N, K] float8_e4m3fn, scale: [1] fp32, bias: [N] or None -> [M, N] in x's
    dtype: x @ (weight * scale)^T + bias, in fp32."""
    y = (x.float() @ weight.float().t()) * scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _fp8_weight_product_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               IEEE: tl.constexpr):
    """Program = outputs [pid * BLOCK_N, +BLOCK_N) of all M rows."""
    wait_for_inputs()
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                    other=0.0)
        acc += mma(x, w.to(tl.float32).to(dtype), IEEE)  # e4m3 is exact in bf16 and fp16
    y = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_weight_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`fp8_weight_product_ref` (same arguments, the same result up to the order of the fp32
    sums and the output's rounding), for at most ``MAX_ROWS`` rows."""
    rows, width = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_weight_product takes at most {MAX_ROWS} rows, not {rows}")
    x, n = x.contiguous(), weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block_m = min(m for m in TILES if m >= rows)
        block_n, block_k, warps, stages = TILES[block_m]
        _fp8_weight_product_kernel[(triton.cdiv(n, block_n),)](
            x, weight, scale, bias if bias is not None else scale, out, rows, n, width, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=warps,
            num_stages=stages, launch_pdl=dependent(x))
    return out
