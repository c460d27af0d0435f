"""The gated MLP's activation, silu(gate) * up, as one kernel.

PyTorch runs it as two kernels with a tensor of the MLP's width in between (for Llama-3-8B a 512-token
prefill chunk writes and reads back 14 MB per layer); the Triton kernel reads gate and up once and
writes the product once, rounding where PyTorch rounds (silu's result to the input dtype, then the
product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .rms_norm import rounded

BLOCK = 1024  # elements per program


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., width] -> silu(gate) * up, same shape and dtype."""
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program = BLOCK consecutive elements of the flattened tensors."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
    act = rounded(g / (1.0 + tl.exp(-g)), g_ptr.dtype.element_ty)
    y = rounded(act * u, out_ptr.dtype.element_ty)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_mul_ref` (same arguments, same result up to rounding)."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out
