"""Kernels behind the attention policies, each with a plain-PyTorch reference of the same function.

``get_kernels("torch")`` returns the references; ``get_kernels("triton")`` the Triton kernels,
which run on CUDA, or on the CPU in Triton's interpreter when ``TRITON_INTERPRET=1`` was set
before they were imported (tests do this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .head_vote import head_soft_vote, head_soft_vote_ref
from .paged_dot import paged_dot, paged_dot_ref
from .sparse_attention import sparse_attention, sparse_attention_ref
from .topk import topk_ref


@dataclass(frozen=True)
class Kernels:
    """paged_dot(q [H,d], k_pool, slots [N]) -> [H,N] fp32; head_soft_vote(q, k_pool, slots, scale) -> [N];
    topk(scores [N], k) -> indices; sparse_attention(q [c,H,d], k_pool, v_pool, slots, key_pos, q_pos,
    inv_freq, rope_scale, sm_scale) -> [c,H,d]."""

    name: str
    paged_dot: Callable
    head_soft_vote: Callable
    topk: Callable
    sparse_attention: Callable


KERNELS = {
    "torch": Kernels("torch", paged_dot_ref, head_soft_vote_ref, topk_ref, sparse_attention_ref),
    "triton": Kernels("triton", paged_dot, head_soft_vote, topk_ref, sparse_attention),
}


def get_kernels(name: str) -> Kernels:
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r}; use torch or triton")
    return KERNELS[name]
