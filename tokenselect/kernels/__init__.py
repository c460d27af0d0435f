"""Kernels behind the attention policies, each with a plain-PyTorch reference of the same function.

``get_kernels("torch")`` returns the references; ``get_kernels("triton")`` the Triton kernels, and
``get_kernels("triton", "cudnn")`` those with a prefill chunk's sparse attention by cuDNN where it runs
(``sparse_attention(cudnn=PlanBudget())``, a budget of its own each call); ``chunk_attention_backend`` says which a
device gets by default.

Triton compiles for GPUs only; on a machine without CUDA its kernels can run only in Triton's
interpreter, which is chosen when ``@triton.jit`` decorates them, i.e. when the kernel modules are
first imported: set ``TRITON_INTERPRET=1`` before starting to use them on a CPU (the tests do).
Importing this package changes no setting of the process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from ..settings import CHUNK_ATTENTION
from .cudnn_attention import CUDNN_DTYPES, PlanBudget, cudnn_preferred
from .block_scores import block_scores, block_scores_ref
from .head_vote import head_soft_vote, head_soft_vote_ref
from .page_bounds import page_scores, page_scores_ref
from .paged_argmax import paged_argmax, paged_argmax_ref
from .paged_dot import _scores_kernel, paged_dot, paged_dot_ref
from .query_mean import query_mean, query_mean_ref
from .row_copy import gather_into, gather_into_ref
from .selection_check import selection_check, selection_check_ref
from .selection_update import selection_update, selection_update_ref
from .sparse_attention import sparse_attention, sparse_attention_ref
from .topk import topk, topk_ref
from .window_mass import window_mass, window_mass_ref


@dataclass(frozen=True)
class Kernels:
    """paged_dot(q [H, d], k_pool [S, H_kv, d], slots [N]) -> [H, N] fp32;
    head_soft_vote(q, k_pool, slots, scale, n_valid=None) -> [N] fp32;
    topk(scores [N], k, n_valid=None, values=None, out=None) -> indices [min(k, N)] of the largest scores,
    ascending (or values [N] at them; in ``out`` when given);
    sparse_attention(q [c, H, d], k_pool, v_pool, slots [n], key_pos [n], q_pos [c], inv_freq [d/2],
    rope_scale, sm_scale, n_valid=None) -> [c, H, d];
    selection_check(q [n], unit, valid, row, layer, theta, counts) -> miss (the Selection Cache's decision,
    ``selection_check.py``);
    selection_update(q [n], unit, selection, valid, row, layer, new [width], miss, out=None) -> entry [width] (its
    store-or-reuse in a decode graph, ``selection_update.py``);
    window_mass(q [c, H, d], k_pool, slots [n], c, t0, lo, n_local, scale) -> [t0 + c - lo, H] fp32 (InfLLM's
    local score, ``window_mass.py``);
    block_scores(rows [R, K], index [n], query [K] (any float dtype, read in fp32), n_valid=None) -> [n] fp32
    (InfLLM's memory lookup, ``block_scores.py``);
    paged_argmax(q [R, d] head-major, k_pool, slots [N], n_valid=None) -> [R] int64, each row's best slot index
    (ReAttention's vote, ``paged_argmax.py``);
    gather_into(src [S], index [n] int64, out [n]) -> out holding src[index] (the chosen slots into the attended
    list, ``row_copy.py``);
    page_scores(query [H, d], lo [rows, P, n_kv, d], hi, row, tail_lo [n_kv, d], tail_hi, tail_at, n_valid=None) ->
    [P] fp32, the best head's upper bound on q . k a page, -inf past n_valid (QUEST's selection, ``page_bounds.py``);
    query_mean(q [c, H, d], dtype=fp32) -> [H, d] in dtype, the mean of a chunk's queries accumulated in fp32 (the
    query a chunk selects with, ``query_mean.py``).

    A batch of sequences in one launch (a whole-step decode graph's: TokenSelect's selection): head_soft_vote with
    q [B, H, d], slots [B, N], n_valid [B] -> [B, N]; topk with scores [B, N], n_valid [B], values [B, N], out
    [B, k] -> [B, k]; selection_check with q [B, n], row, live, candidates [B] -> [B]; selection_update with q
    [B, n], row [B], new [B, width], miss [B], out [B, width] -> [B, width]; gather_into with src [B, S], index
    and out [B, n]; query_mean with q [B, c, H, d] (a chunk's groups) -> [B, H, d]. Rows may be strided views (a
    graph's slot table, its metadata): each is read in place."""

    name: str
    paged_dot: Callable
    head_soft_vote: Callable
    topk: Callable
    sparse_attention: Callable
    selection_check: Callable
    selection_update: Callable
    window_mass: Callable
    block_scores: Callable
    paged_argmax: Callable
    gather_into: Callable
    page_scores: Callable
    query_mean: Callable


KERNELS = {
    "torch": Kernels("torch", paged_dot_ref, head_soft_vote_ref, topk_ref, sparse_attention_ref, selection_check_ref,
                      selection_update_ref, window_mass_ref, block_scores_ref, paged_argmax_ref, gather_into_ref,
                      page_scores_ref, query_mean_ref),
    "triton": Kernels("triton", paged_dot, head_soft_vote, topk, sparse_attention, selection_check, selection_update,
                      window_mass, block_scores, paged_argmax, gather_into, page_scores, query_mean),
}


def triton_interpreted() -> bool:
    """True when the Triton kernels were built for the CPU interpreter."""
    return type(_scores_kernel).__name__ == "InterpretedFunction"


def check_chunk_attention(choice: str) -> str:
    """The choice if it is one of ``CHUNK_ATTENTION``, else a ValueError naming them (before any device is known)."""
    if choice not in CHUNK_ATTENTION:
        raise ValueError(f"chunk_attention={choice!r}: one of {', '.join(CHUNK_ATTENTION)}")
    return choice


def chunk_attention_backend(choice: str, kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """What runs a prefill chunk's sparse attention with ``kernels`` for queries of ``dtype`` on ``device``:
    "triton" (the sparse attention kernel) or "cudnn" (``sparse_attention``'s cuDNN path), as named; "auto": cuDNN
    where it is the faster (``cudnn_attention.cudnn_preferred``: Hopper, bf16/fp16), else Triton. The torch
    kernels have one path of their own: "triton" stands for it."""
    check_chunk_attention(choice)
    if choice == "cudnn" and (kernels != "triton" or device.type != "cuda" or
                              dtype not in CUDNN_DTYPES):
        raise ValueError(f"chunk_attention=cudnn runs with the triton kernels on CUDA in bf16 or fp16, not with "
                         f"{kernels} kernels on {device.type} in {dtype}")
    if choice == "auto":
        return "cudnn" if kernels == "triton" and cudnn_preferred(device, dtype) else "triton"
    return choice


def kernels_for(setting: str | None, device: torch.device) -> str:
    """The kernels a ``kernels`` setting names on ``device``: itself, or unset, Triton on CUDA and the PyTorch
    references elsewhere (Triton on a CPU needs its interpreter, a test's setting)."""
    return setting or ("triton" if device.type == "cuda" else "torch")


def get_kernels(name: str, chunk_attention: str = "triton") -> Kernels:
    """name: "torch" | "triton"; chunk_attention (with "triton"): "triton" | "cudnn", what runs a prefill chunk's
    sparse attention (``chunk_attention_backend``; "cudnn": with a ``PlanBudget`` of its own, so one per engine)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r}; use torch or triton")
    if name == "triton" and not torch.cuda.is_available() and not triton_interpreted():
        raise RuntimeError("Triton kernels on the CPU run only in Triton's interpreter, and TRITON_INTERPRET=1 was "
                           "not set when tokenselect.kernels was imported: set TRITON_INTERPRET=1 before starting "
                           "(slow; meant for tests), or use kernels='torch'")
    if chunk_attention == "triton":
        return KERNELS[name]
    if chunk_attention != "cudnn" or name != "triton":
        raise ValueError(f"chunk_attention={chunk_attention!r} with {name} kernels: triton, or cudnn with triton")
    return replace(KERNELS[name], name="triton+cudnn", sparse_attention=partial(sparse_attention, cudnn=PlanBudget()))
