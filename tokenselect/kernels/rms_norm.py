"""RMS norm of rows (Llama's RMSNorm) as one kernel, optionally after a residual add.

    y = weight * round_to_x_dtype(x / sqrt(mean(x^2) + eps)),   computed in fp32
    add_rms_norm: s = round_to_x_dtype(x + a), then y of s; returns (s, y)

In PyTorch this is a chain of six small kernels (cast up, square, mean, rsqrt, product, cast back, and
the weight's product), each a launch, or a node of a CUDA graph. A decode step normalises its rows
2 * n_layers + 1 times (Qwen3 also every head's q and k), so in a decode step captured as one graph
(``cuda_graphs.py``) those chains are hundreds of nodes. The Triton kernel reads each row once and
writes it once, rounding where the PyTorch version rounds. A residual stream adds each sublayer's output
and normalises the sum for the next sublayer (``x = x + o_proj(...)``, then ``norm(x)``): with the add in the
same kernel that is one node a sublayer instead of two, and the sum is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import INTERPRETED
from .launch import dependent, wait_for_inputs


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> [..., dim] (Llama's RMSNorm: statistics in fp32, the normalised
    row rounded to x's dtype before the weight's product)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, add: [..., dim] of one dtype, weight: [dim] -> (x + add, rms_norm_ref(x + add)), the sum rounded to
    x's dtype as PyTorch's add rounds it."""
    total = x + add
    return total, rms_norm_ref(total, weight, eps)


@triton.jit
def rounded(v, dtype: tl.constexpr):
    """fp32 v rounded to ``dtype`` (to nearest, ties to even), as fp32. Triton 3.6's CPU interpreter
    casts fp32 to bf16 by truncation, so there the rounding is done on the bits."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, sum_ptr, w_ptr, out_ptr, dim, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """Program = one row of ``dim`` values (BLOCK >= dim). ADD: the row is x + add (rounded to x's dtype, written
    to sum_ptr) instead of x."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        x = rounded(x + tl.load(add_ptr + row + cols, mask=ok, other=0.0).to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row + cols, x.to(sum_ptr.dtype.element_ty), mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    h = rounded(x * rstd, x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = rounded(h * w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`rms_norm_ref` (same arguments, same result up to rounding)."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`add_rms_norm_ref` (same arguments, same result up to rounding), one launch."""
    if add.shape != x.shape or add.dtype != x.dtype:
        raise ValueError(f"add {tuple(add.shape)} {add.dtype} to x {tuple(x.shape)} {x.dtype}")
    return _launch(x, add, weight, eps)


def _launch(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """-> (x + add or None, the normalised rows), shaped as x."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = None if add is None else torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        added = None if add is None else add.reshape(-1, dim).contiguous()
        _rms_norm_kernel[(rows.shape[0],)](rows, added, total, weight.contiguous(), out, dim, float(eps),
                                           ADD=add is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)),
                                           launch_pdl=dependent(out))
    return None if total is None else total.view(x.shape), out.view(x.shape)
