"""PyTorch's cuDNN attention, where it is faster, and the merge that lets it run a causal chunk after cached keys.

On Hopper (compute capability 9.x) cuDNN's attention ran prefill shapes about 2x faster than PyTorch's flash
attention and 2.2x faster than the sparse attention kernel's tile (625 against 284 TFLOP/s over a TokenSelect
chunk's lists: results/supporting/dense_backends_h200.md, results/supporting/chunk_attention_paths_h200.md); it
takes bf16 and fp16. It takes a top-left causal flag only, and runs an explicit mask about 2x slower, so a chunk of
c queries after cached keys (causal aligned bottom-right) runs as two calls: the context unmasked, the chunk's own
c keys causal (a square, where top-left is bottom-right). Each part's output is normalised over its own keys; with
their log-sum-exps the two combine exactly: ``out = (w_a out_a + w_b out_b) / (w_a + w_b)``,
``w = exp(lse - max(lse_a, lse_b))``. PyTorch's elementwise version of that runs about ten kernels over fp32 copies
of both outputs (191 us a layer for four groups of 512 queries, against 14.5 for ``merge_by_lse``'s one kernel).

PyTorch caches cuDNN's execution plan by the exact shape; building one takes about 60 ms of host time
(results/supporting/dense_chunk_lengths_h200.md), so callers keep the shapes they send few.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs


CUDNN_DTYPES = (torch.bfloat16, torch.float16)  # what cuDNN's attention takes


class PlanBudget:
    """The chunk shapes one engine lets cuDNN run. PyTorch builds a cuDNN plan for each new shape (about 60 ms on the
    host) and keeps every one it builds (its cache has no bound), so a server whose clients choose per-request
    settings (a TokenSelect ``k``, hence a list length) must not build one per setting: the first ``limit`` shapes
    are admitted, any other runs on the Triton kernel. An engine's own settings meet a handful (a chunk's full
    groups, a prompt's last chunk with fewer of them)."""

    def __init__(self, limit: int = 64):
        self.limit, self.shapes = limit, set()
        self.calls = 0  # chunks that took the cuDNN path: run eagerly, or recorded into a CUDA graph (once a graph)

    def admits(self, shape: tuple) -> bool:
        """Whether a chunk of ``shape`` runs by cuDNN, admitting it while there is room."""
        if shape not in self.shapes and len(self.shapes) < self.limit:
            self.shapes.add(shape)
        admitted = shape in self.shapes
        self.calls += admitted
        return admitted


def cudnn_preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention is the faster choice for ``dtype`` on ``device``: a Hopper GPU, bf16 or fp16 (slower
    than flash on Ampere and Blackwell by transformers' measurements), cuDNN present."""
    return (device.type == "cuda" and dtype in CUDNN_DTYPES and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def cudnn_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`cudnn_attention` computes, in plain PyTorch (fp32 scores and softmax): the same arguments and
    results, where cuDNN cannot run (a CPU)."""
    heads, c, d = q.shape[1:]
    group = heads // keys.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    scores = q.float() @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    if causal:
        hidden = torch.ones(c, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return ((scores - lse).exp() @ v).to(q.dtype), lse


def cudnn_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, c, d], keys, values: [B, KV, L, d] (any strides, each row contiguous; query head h reads kv head
    h // (H // KV)) -> (out [B, H, c, d], its log-sum-exp [B, H, c, 1] in fp32, natural log); causal: top-left."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, keys, values, None, True, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1]


def chunk_by_cudnn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention aligned bottom-right by cuDNN: q [B, H, c, d] over keys, values [B, KV, L, d] (c <= L,
    keys and queries rotated), query i sees keys j <= i + L - c -> [B, H, c, d], into ``out`` when given (any view
    whose rows are contiguous). The context unmasked and the own c keys causal, merged (``merge_by_lse``)."""
    c, L = q.shape[2], keys.shape[2]
    if c == 1 or c == L:  # one call: a single query sees every key; a square is causal either way
        got = cudnn_attention(q, keys, values, c > 1, scale)[0]
        return got if out is None else out.copy_(got)
    context = cudnn_attention(q, keys[:, :, :L - c], values[:, :, :L - c], False, scale)
    own = cudnn_attention(q, keys[:, :, L - c:], values[:, :, L - c:], True, scale)
    return merge_by_lse(*context, *own, out=out)


def merge_by_lse_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> torch.Tensor:
    """out_a, out_b: [B, H, c, d], each part's attention normalised over its own keys; lse_a, lse_b: [B, H, c]
    (natural log; any trailing size-1 dimension) -> [B, H, c, d] in out_a's dtype, the attention over both key sets
    (in fp32). A part without keys for a row has lse -inf and weighs 0."""
    lse_a, lse_b = (x.reshape(*out_a.shape[:3], 1).float() for x in (lse_a, lse_b))
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return ((out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)).to(out_a.dtype)


@triton.jit
def _merge_kernel(a_ptr, la_ptr, b_ptr, lb_ptr, out_ptr, C, H, D, a_s0, a_s1, a_s2, b_s0, b_s1, b_s2, la_s0, la_s1,
                  la_s2, lb_s0, lb_s1, lb_s2, o_s0, o_s1, o_s2, BLOCK_C: tl.constexpr, D_P: tl.constexpr):
    """Program = (block of BLOCK_C queries, sequence and head bh): the merged rows of (b, h). Strides in elements;
    a row's D values are contiguous in every operand."""
    wait_for_inputs()
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    i = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, D_P)
    i_ok = i < C
    ok = i_ok[:, None] & (dims < D)[None, :]
    i64 = i.to(tl.int64)
    lse_a = tl.load(la_ptr + b * la_s0 + h * la_s1 + i64 * la_s2, mask=i_ok, other=0.0).to(tl.float32)
    lse_b = tl.load(lb_ptr + b * lb_s0 + h * lb_s1 + i64 * lb_s2, mask=i_ok, other=0.0).to(tl.float32)
    top = tl.maximum(lse_a, lse_b)
    w_a, w_b = tl.exp(lse_a - top), tl.exp(lse_b - top)
    x_a = tl.load(a_ptr + b * a_s0 + h * a_s1 + (i64 * a_s2)[:, None] + dims[None, :], mask=ok, other=0.0)
    x_b = tl.load(b_ptr + b * b_s0 + h * b_s1 + (i64 * b_s2)[:, None] + dims[None, :], mask=ok, other=0.0)
    out = (x_a.to(tl.float32) * w_a[:, None] + x_b.to(tl.float32) * w_b[:, None]) / (w_a + w_b)[:, None]
    tl.store(out_ptr + b * o_s0 + h * o_s1 + (i64 * o_s2)[:, None] + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


BLOCK_C = 32  # queries a program: 32 x 128 values of each part, 8 KB in bf16


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`merge_by_lse_ref` (same arguments, the same result up to the order of fp32
    operations), written into ``out`` when given: any [B, H, c, d] view whose rows are contiguous (the engine's
    [B, c, H, d] output seen through a transpose). The parts and their log-sum-exps are read at their strides."""
    batch, heads, c, d = out_a.shape
    lse_a, lse_b = (x.reshape(batch, heads, c) for x in (lse_a, lse_b))
    out = torch.empty_like(out_a) if out is None else out
    if out.shape != out_a.shape or out_b.shape != out_a.shape:
        raise ValueError(f"merge_by_lse: parts {tuple(out_a.shape)} and {tuple(out_b.shape)}, out {tuple(out.shape)}")
    if any(x.stride(3) != 1 for x in (out_a, out_b, out)):
        raise ValueError("merge_by_lse: each row's values must be contiguous")
    if out.numel():
        _merge_kernel[(triton.cdiv(c, BLOCK_C), batch * heads)](
            out_a, lse_a, out_b, lse_b, out, c, heads, d, *out_a.stride()[:3], *out_b.stride()[:3], *lse_a.stride(),
            *lse_b.stride(), *out.stride()[:3], BLOCK_C=BLOCK_C, D_P=triton.next_power_of_2(d),
            launch_pdl=dependent(out))
    return out
