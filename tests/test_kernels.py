"""Every Triton kernel against its PyTorch reference on fresh random inputs, and the sparse-attention
reference itself against a naive per-query loop.

Without CUDA the Triton kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1);
with CUDA the same tests run on the GPU. Lengths are ragged (1, 7, 1000: not multiples of any block),
slot lists are unsorted subsets of a larger pool, and GQA groups are 1, 4 and 8.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kernels import get_kernels
from tokenselect.kernels.paged_dot import MAX_GROUP_ROWS, paged_dot_ref
from tokenselect.kernels.sparse_attention import sparse_attention, sparse_attention_ref
from tokenselect.kv_cache import KVCache
from tokenselect.policies import SeqView
from tokenselect.policies.tokenselect import TokenSelect
from tokenselect.rope import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON, TORCH = get_kernels("triton"), get_kernels("torch")
N_KV = 2
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def pool(n_slots: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random cache pool [n_slots, N_KV, d]."""
    return torch.randn(n_slots, N_KV, d, generator=gen).to(DEVICE, dtype)


def slot_list(n: int, n_slots: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct slots in random (unsorted) order."""
    return torch.randperm(n_slots, generator=gen)[:n].to(DEVICE)


def query(shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_paged_dot_matches_reference(n, group, dtype, d):
    gen = torch.Generator().manual_seed(n * 1000 + group * 10 + d)
    q, k_pool = query((N_KV * group, d), dtype, gen), pool(n + 300, d, dtype, gen)
    slots = slot_list(n, n + 300, gen)
    got = TRITON.paged_dot(q, k_pool, slots)
    assert got.shape == (N_KV * group, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, TORCH.paged_dot(q, k_pool, slots), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_head_soft_vote_matches_reference(n, group, dtype, d):
    gen = torch.Generator().manual_seed(n * 1000 + group * 10 + d + 1)
    q, k_pool = query((N_KV * group, d), dtype, gen), pool(n + 300, d, dtype, gen)
    slots = slot_list(n, n + 300, gen)
    scale = 1.0 if d == 128 else d ** -0.5  # raw scores (the paper's default) and scaled ones
    got = TRITON.head_soft_vote(q, k_pool, slots, scale)
    want = TORCH.head_soft_vote(q, k_pool, slots, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert got.sum().item() == pytest.approx(N_KV * group, rel=1e-4)  # one vote per head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("n,live", [(7, 1), (300, 129), (1000, 1000), (1000, 517), (600, 0)])
def test_head_soft_vote_over_a_live_prefix(n, live, group, dtype):
    """A fixed-length slot list of which only a prefix is live (what a CUDA graph votes over): the live
    tokens get exactly the vote of the prefix alone, the rest -inf; slots past the prefix may be anything.
    None live (a decode graph's Selection Cache hit): all -inf."""
    gen = torch.Generator().manual_seed(n + live + group)
    q, k_pool = query((N_KV * group, 128), dtype, gen), pool(n + 300, 128, dtype, gen)
    slots = slot_list(n, n + 300, gen)
    n_valid = torch.tensor(live, device=DEVICE)
    for kern in (TRITON, TORCH):
        got = kern.head_soft_vote(q, k_pool, slots, 0.125, n_valid)
        if live:
            torch.testing.assert_close(got[:live], TORCH.head_soft_vote(q, k_pool, slots[:live], 0.125),
                                       atol=1e-5, rtol=1e-4)
        assert got.shape == (n,) and torch.isneginf(got[live:]).all()


def test_head_soft_vote_reads_fp8_keys():
    gen = torch.Generator().manual_seed(5)
    k_pool = pool(3000, 128, torch.float32, gen).to(torch.float8_e4m3fn)
    q, slots = query((8, 128), torch.bfloat16, gen), slot_list(2500, 3000, gen)
    torch.testing.assert_close(TRITON.head_soft_vote(q, k_pool, slots, 0.1),
                               TORCH.head_soft_vote(q, k_pool, slots, 0.1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernels", [TRITON, TORCH], ids=lambda k: k.name)
def test_tokenselect_votes_over_an_fp8_pool_with_an_unquantized_query(kernels):
    """An fp8 KV pool: the vote must be the one over the same key values in bf16 (the keys upcast on
    load), with the query in its own dtype; quantizing the query to fp8 changes it far more."""
    gen = torch.Generator().manual_seed(8)
    n, d, group = 600, 64, 4
    cache = KVCache(1, n, N_KV, d, torch.float8_e4m3fn, torch.device(DEVICE))
    cache.k[0].copy_(torch.randn(n, N_KV, d, generator=gen).to(DEVICE, torch.float8_e4m3fn))
    same_keys = KVCache(1, n, N_KV, d, torch.bfloat16, torch.device(DEVICE))
    same_keys.k[0].copy_(cache.k[0].to(torch.bfloat16))
    q = query((3, N_KV * group, d), torch.bfloat16, gen)  # a chunk of the model's (bf16) queries
    middle = slot_list(500, n, gen)
    fp8, bf16 = (TokenSelect(c, kernels, k=40, score_scale="sqrt_d") for c in (cache, same_keys))
    mean = q.float().mean(dim=0).to(torch.bfloat16)
    want = bf16.votes(mean, same_keys.k[0], middle)
    torch.testing.assert_close(fp8.votes(mean, cache.k[0], middle), want, atol=1e-6, rtol=1e-5)
    quantized = bf16.votes(mean.to(torch.float8_e4m3fn).to(torch.bfloat16), same_keys.k[0], middle)
    assert (quantized - want).abs().max() > 100 * 1e-6 + 1e-5 * want.abs().max()
    seq = SeqView(0, middle, decode=False)  # select: the chunk's mean query goes in the queries' dtype
    assert torch.equal(fp8.select(0, seq, q, middle), bf16.select(0, seq, q, middle))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4096), (7, 80), (3, 5, 16), (0, 64)])  # a decode row, ragged, per head, none
def test_rms_norm_matches_reference(shape, dtype):
    from tokenselect.kernels.rms_norm import rms_norm, rms_norm_ref

    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    got, want = rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else
                                             {"atol": 1e-2, "rtol": 8e-3}))  # bf16: one rounding step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 14336), (7, 300), (0, 64)])  # a decode row, ragged, none
def test_silu_mul_matches_reference(shape, dtype):
    from tokenselect.kernels.silu_mul import silu_mul, silu_mul_ref

    gen = torch.Generator().manual_seed(sum(shape) + 1)
    gate, up = (4 * torch.randn(2, *shape, generator=gen)).to(DEVICE, dtype)
    got = silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype
    torch.testing.assert_close(got, silu_mul_ref(gate, up), **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                                               else {"atol": 1e-2, "rtol": 8e-3}))


@pytest.mark.parametrize("n", [64, 1000, 4096])  # query sizes n_heads * head_dim, one ragged
def test_selection_check_matches_reference(n):
    from tokenselect.kernels.selection_check import selection_check, selection_check_ref

    gen = torch.Generator().manual_seed(n)
    rows, layers = 5, 3
    unit = torch.nn.functional.normalize(torch.randn(rows, layers, n, generator=gen), dim=-1).to(DEVICE)
    valid = (torch.rand(rows, layers, generator=gen) < 0.7).to(DEVICE)
    counts = {name: torch.zeros(2, dtype=torch.int64, device=DEVICE) for name in ("triton", "torch")}
    for trial in range(12):
        row, layer = trial % rows, trial % layers
        cached = unit[row, layer].cpu()
        q = (cached * torch.randn(1, generator=gen) + 0.7 * torch.randn(n, generator=gen) / n ** 0.5).to(DEVICE)
        theta = float(torch.empty(1).uniform_(-0.5, 0.95, generator=gen))
        row_t = torch.tensor(row, device=DEVICE)
        got = selection_check(q, unit, valid, row_t, layer, theta, counts["triton"])
        want = selection_check_ref(q, unit, valid, row_t, layer, theta, counts["torch"])
        assert got.shape == () and got.dtype == torch.bool and bool(got) == bool(want)
    assert torch.equal(counts["triton"], counts["torch"]) and counts["torch"].sum() == 12
    assert 0 < counts["torch"][0] < 12  # both outcomes were exercised


def test_paged_dot_reference_is_the_definition():
    gen = torch.Generator().manual_seed(3)
    q, k_pool, slots = torch.randn(8, 16, generator=gen), torch.randn(20, 2, 16, generator=gen), torch.randperm(20)[:9]
    ref = paged_dot_ref(q, k_pool, slots)
    for h in range(8):
        for t in range(9):
            assert ref[h, t].item() == pytest.approx((q[h] @ k_pool[slots[t], h // 4]).item(), abs=1e-5)


def test_topk_returns_the_largest():
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(1000, generator=gen).to(DEVICE)
    for kernels in (TRITON, TORCH):
        got = kernels.topk(scores, 50)
        assert set(got.tolist()) == set(scores.argsort(descending=True)[:50].tolist())
        assert kernels.topk(scores[:7], 50).numel() == 7


def rope_inputs(c: int, n: int, d: int, gen: torch.Generator):
    """Key positions: any distinct values up to 100K, unsorted (causality follows the list order, not
    the positions); the chunk's own queries sit at the positions of the last c keys."""
    key_pos = torch.randperm(100_000, generator=gen)[:n].to(DEVICE)
    inv_freq, scale = RopeSpec(d, theta=500_000.0, kind="yarn", factor=4.0, max_position=8192).inv_freq()
    return key_pos, key_pos[-c:], inv_freq.to(DEVICE), scale


ATTENTION_SHAPES = [(1, 1), (1, 7), (1, 1000), (7, 7), (7, 1000), (100, 300)]  # (chunk c, list length n)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("c,n", ATTENTION_SHAPES)
def test_sparse_attention_matches_reference(c, n, group, dtype, d):
    gen = torch.Generator().manual_seed(c * 100_000 + n * 100 + group * 10 + d)
    q = query((c, N_KV * group, d), dtype, gen)
    k_pool, v_pool = pool(n + 300, d, dtype, gen), pool(n + 300, d, dtype, gen)
    slots = slot_list(n, n + 300, gen)
    key_pos, q_pos, inv_freq, scale = rope_inputs(c, n, d, gen)
    args = (q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale)
    got = TRITON.sparse_attention(*args)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, TORCH.sparse_attention(*args), **TOL[dtype])


@pytest.mark.parametrize("d", [16, 80])  # tiny test models; a head_dim that is no power of two
def test_small_and_odd_head_dims(d):
    gen = torch.Generator().manual_seed(d)
    q = query((3, 8, d), torch.float32, gen)
    k_pool, v_pool = pool(400, d, torch.float32, gen), pool(400, d, torch.float32, gen)
    slots = slot_list(300, 400, gen)
    key_pos, q_pos, inv_freq, scale = rope_inputs(3, 300, d, gen)
    torch.testing.assert_close(TRITON.paged_dot(q[0], k_pool, slots), TORCH.paged_dot(q[0], k_pool, slots),
                               atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(TRITON.head_soft_vote(q[0], k_pool, slots, 0.3),
                               TORCH.head_soft_vote(q[0], k_pool, slots, 0.3), atol=1e-5, rtol=1e-4)
    args = (q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale)
    torch.testing.assert_close(TRITON.sparse_attention(*args), TORCH.sparse_attention(*args), **TOL[torch.float32])


def test_sparse_attention_explicit_softmax_scale_and_fp8_pool():
    gen = torch.Generator().manual_seed(7)
    q = query((5, 8, 128), torch.bfloat16, gen)
    k_pool = pool(900, 128, torch.float32, gen).to(torch.float8_e4m3fn)
    v_pool = pool(900, 128, torch.float32, gen).to(torch.float8_e4m3fn)
    slots = slot_list(800, 900, gen)
    key_pos, q_pos, inv_freq, _ = rope_inputs(5, 800, 128, gen)
    args = (q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, 1.0, 0.05)
    torch.testing.assert_close(TRITON.sparse_attention(*args), TORCH.sparse_attention(*args), **TOL[torch.bfloat16])


def naive_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, rope_scale, sm_scale):
    """Query by query and head by head in fp64: rotate each (x_i, x_{i+d/2}) pair by angle
    pos * inv_freq[i] (the angle rounded to fp32, as every RoPE implementation computes it), score the
    visible keys, softmax, average the values."""
    c, n_heads, d = q.shape
    n, group = len(slots), n_heads // k_pool.shape[1]

    def rot(x, pos):  # x: [d] -> [d]
        angle = (pos * inv_freq.float()).double()
        x1, x2 = x[: d // 2], x[d // 2:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()]) * rope_scale

    out = torch.zeros(c, n_heads, d, dtype=torch.float64)
    for i in range(c):
        visible = n - c + i + 1
        for h in range(n_heads):
            qi = rot(q[i, h].double(), q_pos[i].float())
            keys = torch.stack([rot(k_pool[slots[j], h // group].double(), key_pos[j].float()) for j in range(visible)])
            p = torch.softmax(keys @ qi * sm_scale, dim=0)
            out[i, h] = p @ v_pool[slots[:visible], h // group].double()
    return out


@pytest.mark.parametrize("c,n,group", [(1, 1, 1), (1, 9, 4), (4, 13, 2)])
def test_sparse_attention_reference_equals_naive_loop(c, n, group):
    gen = torch.Generator().manual_seed(c + n + group)
    d = 32
    q = torch.randn(c, 2 * group, d, generator=gen)
    k_pool, v_pool = torch.randn(20, 2, d, generator=gen), torch.randn(20, 2, d, generator=gen)
    slots = torch.randperm(20, generator=gen)[:n]
    key_pos = torch.randperm(5000, generator=gen)[:n]
    inv_freq, scale = RopeSpec(d, theta=10_000.0, kind="yarn", factor=8.0, max_position=1024).inv_freq()
    args = (q, k_pool, v_pool, slots, key_pos, key_pos[-c:], inv_freq, scale)
    want = naive_attention(*args, sm_scale=1 / math.sqrt(d))
    torch.testing.assert_close(sparse_attention_ref(*args).double(), want, atol=1e-5, rtol=1e-5)


def test_triton_policy_equals_torch_policy(tiny_llama):
    """The whole TokenSelect path (selection and attention, prefill chunks and decode with the
    Selection Cache) gives the same logits and tokens with either kernel set."""
    ids = torch.randint(2, 300, (160,), generator=torch.Generator().manual_seed(4)).tolist()
    settings = dict(chunk_size=32, k=24, n_init=4, n_local=16, theta=0.8, device=DEVICE, dtype=torch.float32)
    ours = LLM(tiny_llama, "tokenselect", kernels="triton", **settings)
    ref = LLM(tiny_llama, "tokenselect", kernels="torch", **settings)
    torch.testing.assert_close(ours.prompt_logits(ids), ref.prompt_logits(ids), atol=1e-4, rtol=1e-4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ours.generate([ids], greedy)[0].token_ids == ref.generate([ids], greedy)[0].token_ids
    assert ours.stats()["selection_cache_misses"] > 0


def test_registry():
    assert get_kernels("triton").sparse_attention is sparse_attention
    assert get_kernels("torch").sparse_attention is sparse_attention_ref
    with pytest.raises(ValueError, match="torch or triton"):
        get_kernels("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_dot_with_a_whole_chunk_of_rows_per_kv_head(dtype):
    """InfLLM and ReAttention score every query of a chunk: hundreds of rows per kv head, which the
    kernel takes in slices (the last one ragged) so its tile fits in shared memory."""
    gen = torch.Generator().manual_seed(11)
    group = 2 * MAX_GROUP_ROWS + 37
    q, k_pool = query((N_KV * group, 64), dtype, gen), pool(400, 64, dtype, gen)
    slots = slot_list(150, 400, gen)
    got = TRITON.paged_dot(q, k_pool, slots)
    assert got.shape == (N_KV * group, 150)
    torch.testing.assert_close(got, TORCH.paged_dot(q, k_pool, slots), atol=1e-3, rtol=1e-4)
