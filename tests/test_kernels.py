"""Every Triton kernel against its PyTorch reference on fresh random inputs (the Triton
interpreter on a CPU, the real compiler on CUDA), and the references against naive loops."""

from __future__ import annotations

import math

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kernels import get_kernels
from tokenselect.kernels.head_vote import head_soft_vote, head_soft_vote_ref
from tokenselect.kernels.paged_dot import paged_dot, paged_dot_ref
from tokenselect.kernels.sparse_attention import sparse_attention, sparse_attention_ref
from tokenselect.rope import RopeSpec

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (n_heads, n_kv_heads, head_dim, N): GQA 1/4/8, ragged lengths 1, 7, 1000, head_dim 64/128/256
SHAPES = [(4, 4, 64, 1), (8, 2, 64, 7), (32, 8, 128, 1000), (8, 1, 128, 333), (8, 8, 256, 70), (16, 2, 64, 129)]


def random_pool(n_heads, n_kv, d, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    size = n + 37
    q = torch.randn(n_heads, d, generator=g).to(device, dtype)
    k_pool = torch.randn(size, n_kv, d, generator=g).to(device, dtype)
    slots = torch.randperm(size, generator=g)[:n].to(device)  # unsorted, no duplicates
    return q, k_pool, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_dot_matches_reference(device, dtype, shape):
    q, k_pool, slots = random_pool(*shape, dtype, device, seed=hash(shape) % 1000)
    out = paged_dot(q, k_pool, slots)
    assert out.shape == (shape[0], shape[3]) and out.dtype == torch.float32
    torch.testing.assert_close(out, paged_dot_ref(q, k_pool, slots), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_head_soft_vote_matches_reference(device, dtype, shape):
    q, k_pool, slots = random_pool(*shape, dtype, device, seed=1 + hash(shape) % 1000)
    scale = 1 / math.sqrt(shape[2])
    vote = head_soft_vote(q, k_pool, slots, scale)
    ref = head_soft_vote_ref(q, k_pool, slots, scale)
    torch.testing.assert_close(vote, ref, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=1e-3)
    assert vote.sum().item() == pytest.approx(shape[0], rel=1e-4)  # one unit of vote per head


def test_paged_dot_reference_is_the_definition():
    q, k_pool, slots = random_pool(8, 2, 16, 9, torch.float32, "cpu", seed=3)
    ref = paged_dot_ref(q, k_pool, slots)
    for h in range(8):
        for t in range(9):
            assert ref[h, t].item() == pytest.approx((q[h] @ k_pool[slots[t], h // 4]).item(), abs=1e-5)


# (c, n_heads, n_kv_heads, head_dim, n): decode (c=1) and chunks, ragged n
ATTN_SHAPES = [(1, 4, 4, 64, 1), (1, 32, 8, 128, 1000), (7, 8, 2, 64, 7), (16, 8, 1, 128, 300),
               (33, 4, 4, 256, 100), (1, 16, 2, 64, 513)]


def attention_inputs(c, n_heads, n_kv, d, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    size = n + 40
    q = torch.randn(c, n_heads, d, generator=g).to(device, dtype)
    k_pool = torch.randn(size, n_kv, d, generator=g).to(device, dtype)
    v_pool = torch.randn(size, n_kv, d, generator=g).to(device, dtype)
    slots = torch.randperm(size, generator=g)[:n].to(device)
    key_pos = torch.randperm(2 * n, generator=g)[:n].to(device)  # any positions, not sorted
    q_pos = torch.arange(2 * n, 2 * n + c, device=device)
    inv_freq, _ = RopeSpec(d, theta=10000.0).inv_freq()
    return q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_sparse_attention_matches_reference(device, dtype, shape):
    args = attention_inputs(*shape, dtype, device, seed=hash(shape) % 1000)
    out = sparse_attention(*args, rope_scale=1.2)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out, sparse_attention_ref(*args, rope_scale=1.2), **TOL[dtype])


def test_sparse_attention_reference_is_the_definition():
    """Rotate-half RoPE at the given positions, GQA, bottom-right causal mask, softmax(q.k / sqrt(d)) v."""
    c, n_heads, n_kv, d, n = 3, 4, 2, 8, 6
    q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq = attention_inputs(c, n_heads, n_kv, d, n, torch.float32, "cpu", 5)

    def rope(x, pos):
        angle = pos * inv_freq
        x1, x2 = x[: d // 2], x[d // 2:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])

    out = sparse_attention_ref(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq)
    for i in range(c):
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            qi = rope(q[i, h], q_pos[i])
            visible = [j for j in range(n) if j <= i + n - c]
            logits = torch.stack([qi @ rope(k_pool[slots[j], kv], key_pos[j]) / math.sqrt(d) for j in visible])
            want = (torch.softmax(logits, 0)[:, None] * v_pool[slots[visible], kv]).sum(0)
            torch.testing.assert_close(out[i, h], want, atol=1e-5, rtol=1e-5)


def test_triton_policy_equals_torch_policy(tiny_llama):
    """The whole TokenSelect path with kernels='triton' (selection and attention) matches 'torch'."""
    ids = torch.randint(2, 300, (160,), generator=torch.Generator().manual_seed(4)).tolist()
    settings = dict(chunk_size=32, k=24, n_init=4, n_local=16, theta=0.8)
    ours = LLM(tiny_llama, "tokenselect", kernels="triton", **settings)
    ref = LLM(tiny_llama, "tokenselect", kernels="torch", **settings)
    torch.testing.assert_close(ours.prompt_logits(ids), ref.prompt_logits(ids), atol=1e-4, rtol=1e-4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ours.generate([ids], greedy)[0].token_ids == ref.generate([ids], greedy)[0].token_ids
    assert ours.stats()["selection_cache_misses"] > 0


def test_registry():
    assert get_kernels("triton").sparse_attention is sparse_attention
    assert get_kernels("torch").head_soft_vote is head_soft_vote_ref
    with pytest.raises(ValueError, match="unknown kernels"):
        get_kernels("cuda")
