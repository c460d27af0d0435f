"""fp8 weights (``weight_dtype="fp8"``): each layer's four projections held in e4m3 with one scale a matrix.

Half the bytes a decode step reads for weights, and twice the matrix rate in a prefill
(``benchmarks/results/supporting/fp8_weights_h200.md``). A product over a few rows (a decode step's, up to
``kernels.fp8_product.MAX_ROWS``) widens the weight in registers and multiplies the rows as they are
(``fp8_weight_product``): it is bound by the weight's bytes, and each row keeps its own values. Over more rows (a
prefill chunk's) the rows are quantized too, with a scale a row (``quantize_fp8_rows``), and cuBLAS multiplies the
two in fp8 (``torch._scaled_mm``, Hopper GPUs, accumulated in fp32). The embeddings, the norms and the output
head keep the model's dtype: the head's rounding would reach every logit. e4m3 keeps 3 mantissa bits, so each weight
moves by up to 1/16 of itself; on prose the next token agrees with the fp32 model's at 87% of positions for
SmolLM2-135M, 91% for Qwen2.5-Coder-0.5B and 95% for the shipped model
(``benchmarks/results/supporting/fp8_weights_agreement.md``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel
from ..kernels.fp8_product import MAX_ROWS, fp8_weight_product, fp8_weight_product_ref
from ..kernels.fp8_quant import FP8, quantize_fp8_ref, quantize_fp8_rows

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the modules made fp8 (``llama.py``'s names)


def quantizes(x: torch.Tensor) -> bool:
    """Whether an input x [n, in] is quantized and multiplied in fp8 (a prefill chunk's rows) rather than multiplied
    as it is by the widened weight (a decode step's few rows)."""
    return x.shape[0] > MAX_ROWS


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in fp8: weight [out, in] float8_e4m3fn, weight_scale [1] fp32 (W ~= weight *
    weight_scale), bias [out] in the model's dtype or None; forward: x [n, in] -> [n, out] in x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if out_features % 16 or in_features % 16:
            raise ValueError(f"fp8 weights need matrix sides that are multiples of 16 (cuBLAS's fp8 product); this "
                             f"model has a {out_features} x {in_features} projection")
        state = quantized_state("weight", linear.weight)
        self.weight = nn.Parameter(state["weight"], requires_grad=False)
        self.register_buffer("weight_scale", state["weight_scale"])
        self.register_buffer("weight_scale_row", state["weight_scale_row"])
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On a GPU one Triton kernel for a few rows; for more, the rows quantized by one and multiplied by cuBLAS,
        whose row-wise-scaled product writes bf16 (then cast to x's dtype). Elsewhere the same functions in
        PyTorch, in fp32 (PyTorch's own fp8 product on a CPU takes 800 times an fp32 one's time)."""
        if not quantizes(x):
            product = fp8_weight_product if x.is_cuda else fp8_weight_product_ref
            return product(x, self.weight, self.weight_scale, self.bias)
        if not x.is_cuda:
            return fp8_product_ref(x, self)
        q, scale = quantize_fp8_rows(x)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale_row,
                             out_dtype=torch.bfloat16).to(x.dtype)
        return y if self.bias is None else y + self.bias


class RowParallelFp8Linear(Fp8Linear):
    """A tensor-parallel rank's columns of o_proj / down_proj in fp8 (``parallel.RowParallelLinear``'s): its
    partial product, summed over the ranks. Each rank's weight and input have scales of their own, so the sum is
    not bit for bit one GPU's."""

    tp: "parallel.TensorParallel"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.tp.group)
        return out


def quantized_state(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """An ``Fp8Linear``'s state made from its 16-bit weight [out, in] (name: the weight's, ``...proj.weight``): the
    weight in e4m3, its scale [1] and that scale expanded to [1, out] (the contiguous row of scales cuBLAS's row-wise
    product takes), keyed as in the module's state dict."""
    prefix = name.removesuffix("weight")
    q, scale = quantize_fp8_ref(weight)
    return {name: q, f"{prefix}weight_scale": scale,
            f"{prefix}weight_scale_row": scale.expand(1, weight.shape[0]).contiguous()}


def fp8_product_ref(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """What ``Fp8Linear`` computes over many rows, in plain fp32 arithmetic: x [n, in] quantized with a scale a row,
    its fp8 values multiplied by the weight's (each product exact in fp32) and summed in fp32, times the two scales,
    the bias added, rounded to x's dtype -> [n, out]."""
    q, scale = quantize_fp8_ref(x, per_row=True)
    y = (q.float() @ layer.weight.float().t()) * (scale * layer.weight_scale)
    return (y if layer.bias is None else y + layer.bias.float()).to(x.dtype)


def use_fp8_weights(model: nn.Module) -> None:
    """Replace every projection of ``model`` (``PROJECTIONS``, by module name) by its ``Fp8Linear``, one at a time,
    each 16-bit weight freed as its fp8 copy is made. A tensor-parallel rank's row-parallel projections
    (``parallel.RowParallelLinear``) become ``RowParallelFp8Linear``, keeping their all-reduce. On a model on the
    meta device (``loader.build_model``'s, before it is filled) this makes the fp8 modules to be loaded into."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                fp8 = Fp8Linear(child)
                if isinstance(child, parallel.RowParallelLinear):
                    fp8.__class__, fp8.tp = RowParallelFp8Linear, child.tp
                setattr(module, name, fp8)


def check_fp8_products(device: torch.device) -> None:
    """Raise ValueError, saying why, where this GPU and PyTorch cannot run a prefill chunk's fp8 product (cuBLAS's
    row-wise-scaled one, as ``Fp8Linear`` calls it); a CPU multiplies the fp8 values in fp32 (``fp8_product_ref``)."""
    if device.type == "cpu":
        return
    a = torch.zeros(16, 16, dtype=FP8, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(f"weight_dtype fp8 needs row-wise-scaled fp8 matrix products, which this device ({device}) "
                         f"and PyTorch {torch.__version__} lack (on NVIDIA GPUs: Hopper or later): "
                         f"{str(e).splitlines()[0]}") from None
