"""A few rows times an fp8 weight: x [M, K] @ (w [N, K] in e4m3 * scale)^T, the weight read once and widened to x's
dtype in registers, the activations not quantized: a decode step's projections with fp8 weights (``models/fp8.py``).

A decode step's product is bound by reading the weight. cuBLAS's fp8 product would need the activations in fp8 too:
with a scale a row its kernel is slower than bf16 at a few rows (0.3-0.6 of the weight's read floor on an H200), and
one scale over a CUDA graph's bucket of rows would let a padded row's values round the real rows' (the engine's
graphs then gave other tokens than its eager steps). Here each row keeps its own values, and each output is a row's exact products summed in fp32.

Program = ``BLOCK_N`` outputs of every row over one part of K: the weight's ``BLOCK_N`` rows streamed in ``BLOCK_K``
columns at a time (K contiguous), the rows of x (``BLOCK_M``: 16 or 32, at least 16 as ``tl.dot`` needs) read
alongside from L2. A product with few outputs (o and down: N = 4096, 128 programs of 32) would leave each SM one
program reading one stream, a fraction of the bandwidth; so K is split into ``parts`` (``parts_for``) and a second
kernel sums the parts' fp32 sums in a fixed order, scales them and adds the bias (deterministic: the same inputs give
the same bits, eagerly and in a graph). A row's output depends on its own values only, not on the other rows'.
On an H200 at one row the Llama-3-8B shape's four projections take 74 us a layer against bf16's 116 (the weights'
floor: 52), at 32 rows 105 against 124 (``benchmarks/results/supporting/fp8_weights_h200.md``).
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
TILES = {16: (32, 256, 4, 4), 32: (32, 128, 4, 4)}
MAX_ROWS = max(TILES)
PROGRAMS_PER_SM = 4  # K is split until a product has about this many programs an SM (``parts_for``)
MIN_PART_STEPS = 2  # ... and each part at least this many BLOCK_K steps
SUM_BLOCK = 1024  # outputs a program of the parts' sum


def fp8_weight_product_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (any float dtype), weight: [N, K] float8_e4m3fn, scale: [1] fp32, bias: [N] or None -> [M, N] in x's
    dtype: x @ (weight * scale)^T + bias, in fp32."""
    y = (x.float() @ weight.float().t()) * scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


def parts_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """How many parts K is split into for an [N, K] weight on a GPU of ``sms`` SMs: enough that the product has about
    ``PROGRAMS_PER_SM`` programs an SM, each part at least ``MIN_PART_STEPS`` steps of ``BLOCK_K`` columns. Not a
    function of the rows, so that a row's rounding does not change with the batch."""
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(PROGRAMS_PER_SM * sms // tiles, steps // MIN_PART_STEPS))


@triton.jit
def _fp8_weight_product_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, K_PART, HAS_BIAS: tl.constexpr,
                               PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (i, j) = outputs [i * BLOCK_N, +BLOCK_N) of all M rows over columns [j * K_PART, +K_PART) of K.
    PARTIAL: its fp32 sums to out [parts, M, N] as they are; else (one part) the output, scaled, biased, rounded."""
    wait_for_inputs()
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_begin = tl.program_id(1) * K_PART
    for k0 in range(k_begin, tl.minimum(k_begin + K_PART, K), BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                    other=0.0)
        acc += mma(x, w.to(tl.float32).to(dtype), IEEE)  # e4m3 is exact in bf16 and fp16
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        y = acc * tl.load(scale_ptr)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_parts_kernel(parts_ptr, scale_ptr, bias_ptr, out_ptr, MN, N, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program = outputs [pid * BLOCK, +BLOCK) of the flat [M, N]: the PARTS partial sums added in order."""
    wait_for_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(parts_ptr + i, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(parts_ptr + p * MN + i, mask=mask, other=0.0)
    y = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_weight_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       tile: tuple[int, int, int, int] | None = None, parts: int | None = None) -> torch.Tensor:
    """Triton version of :func:`fp8_weight_product_ref` (same arguments, the same result up to the order of the fp32
    sums and the output's rounding), for at most ``MAX_ROWS`` rows. tile (BLOCK_N, BLOCK_K, warps, stages) and
    parts: instead of ``TILES`` and ``parts_for`` (the benchmarks' sweeps; the tests' splits)."""
    rows, width = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_weight_product takes at most {MAX_ROWS} rows, not {rows}")
    x, n = x.contiguous(), weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if not rows:
        return out
    block_m = min(m for m in TILES if m >= rows)
    block_n, block_k, warps, stages = tile or TILES[block_m]
    if parts is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        parts = parts_for(n, width, block_n, block_k, sms)
    # each part a whole number of BLOCK_K steps; parts past the columns' end are dropped
    part_width = triton.cdiv(triton.cdiv(width, parts), block_k) * block_k
    parts = triton.cdiv(width, part_width)
    sums = out if parts == 1 else torch.empty(parts, rows, n, dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scale
    _fp8_weight_product_kernel[(triton.cdiv(n, block_n), parts)](
        x, weight, scale, bias_arg, sums, rows, n, width, part_width, HAS_BIAS=bias is not None, PARTIAL=parts > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=warps,
        num_stages=stages, launch_pdl=dependent(x))
    if parts > 1:
        _sum_parts_kernel[(triton.cdiv(rows * n, SUM_BLOCK),)](
            sums, scale, bias_arg, out, rows * n, n, PARTS=parts, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK,
            launch_pdl=dependent(x))
    return out
