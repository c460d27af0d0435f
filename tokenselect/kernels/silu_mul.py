"""The gated MLP's activation, silu(gate) * up, as one kernel, read from the stacked gate/up product.

The model computes gate and up as one product ``[n, 2 * width]`` (gate first). PyTorch would split it,
copy the two strided halves or run two kernels with a tensor of the MLP's width in between (for Llama-3-8B
a 512-token prefill chunk writes and reads back 14 MB per layer); the Triton kernel reads each half in place,
once, and writes the product once, rounding where PyTorch rounds (silu's result to the input dtype, then
the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs
from .rms_norm import rounded

BLOCK = 1024  # columns per program


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * width], gate then up -> silu(gate) * up: [..., width], same dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, row_stride, BLOCK: tl.constexpr):
    """Program = BLOCK columns of one row: gate at x[row, col], up at x[row, width + col]."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < width
    g = tl.load(x_ptr + row * row_stride + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * row_stride + width + col, mask=ok, other=0.0).to(tl.float32)
    act = rounded(g / (1.0 + tl.exp(-g)), x_ptr.dtype.element_ty)
    y = rounded(act * u, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + col, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_mul_ref` (same argument, same result up to rounding)."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)  # a view for the model's [n, 2 * width] product
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK))](rows, out, width, rows.stride(0), BLOCK=BLOCK,
                                                                     launch_pdl=dependent(out))
    return out.view(*gate_up.shape[:-1], width)
