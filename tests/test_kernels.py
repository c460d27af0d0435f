"""Every Triton kernel against its PyTorch reference on fresh random inputs, and the sparse-attention
reference itself against a naive per-query loop.

Without CUDA the Triton kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1);
with CUDA the same tests run on the GPU. Lengths are ragged (1, 7, 1000: not multiples of any block),
slot lists are unsorted subsets of a larger pool, and GQA groups are 1, 4 and 8.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenselect import LLM, SamplingParams
from tokenselect.kernels import chunk_attention_backend, get_kernels
from tokenselect.kernels.cudnn_attention import PlanBudget, merge_by_lse, merge_by_lse_ref
from tokenselect.kernels.dot import exact_dot_type, query_dot_type
from tokenselect.kernels.fast_exp import exp2_ftz, exp_ftz
from tokenselect.kernels.head_vote import head_soft_vote_ref
from tokenselect.kernels.page_bounds import page_scores, page_scores_ref
from tokenselect.kernels.paged_dot import MAX_GROUP_ROWS, paged_dot_ref, scores_block, scores_with_stats
from tokenselect.kernels.query_mean import query_mean_ref
from tokenselect.kernels.row_copy import gather_rows, gather_rows_ref, scatter_rows, scatter_rows_ref
from tokenselect.kernels.sparse_attention import sparse_attention, sparse_attention_ref
from tokenselect.kv_cache import KVCache
from tokenselect.policies.reattention import ReAttention
from tokenselect.policies.tokenselect import TokenSelect
from tokenselect.rope import RopeSpec

from policy_steps import step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
paged_dot_module = importlib.import_module("tokenselect.kernels.paged_dot")  # (the package's name is the function)
attention_module = importlib.import_module("tokenselect.kernels.sparse_attention")
cudnn_module = importlib.import_module("tokenselect.kernels.cudnn_attention")
TRITON, TORCH = get_kernels("triton"), get_kernels("torch")
N_KV = 2
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
BF16_RTOL, BF16_ATOL_OF_MAX = 2 ** -6, 2e-2


def assert_attention_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Sparse attention against its reference. fp32: TOL. bf16 (and fp8 pools read in bf16): rtol 2^-6 (two bf16
    ulps) plus an atol of 2e-2 of the largest output. The bound was 3e-2 absolute, as large as the outputs of a
    1000-key list (mean |out| 0.05), so dropping 16 of the 1000 keys passed; that now misses by 5x or more (it needs
    an atol of at least 9e-2 of the largest output). Measured with d = 128 (Triton's interpreter on a CPU): the
    atol needed (with that rtol) is at most 1.5e-2 of the largest output (c 1, n 7, group 4: 2.5e-2 of 1.64;
    at n = 1000 at most 1.4e-2), half of it the bf16 reference's own error against fp64; an emulation of the
    GPU's bf16 tensor-core path (bf16 q, k and probabilities, fp32 accumulation) is closer to the reference still."""
    if dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, **TOL[dtype])
        return
    torch.testing.assert_close(got, want, rtol=BF16_RTOL, atol=BF16_ATOL_OF_MAX * want.float().abs().max().item())


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


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_every_fp8_value_is_exact_in_both_16_bit_types():
    """The premise of ``exact_dot_type``: fp8 keys convert into fp16 (the type they are multiplied in) and bf16 with
    no rounding."""
    for fp8 in FP8:
        values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fp8).float()
        values = values[values.isfinite()]
        for wide in (torch.bfloat16, torch.float16):
            assert torch.equal(values.to(wide).float(), values), (fp8, wide)


def test_exact_dot_type():
    """The query's 16-bit type for keys of that type; fp16 for fp8 keys; tf32 for mixed 16-bit types; IEEE fp32 with
    fp32 on either side. ``query_dot_type``: the query's type whatever the keys', IEEE fp32 with fp32."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert exact_dot_type(bf16, bf16) == (tl.bfloat16, False) and exact_dot_type(fp16, fp16) == (tl.float16, False)
    for fp8 in FP8:
        assert exact_dot_type(bf16, fp8) == (tl.float16, False) and exact_dot_type(fp16, fp8) == (tl.float16, False)
    assert exact_dot_type(bf16, fp16) == (tl.float32, False) and exact_dot_type(fp16, bf16) == (tl.float32, False)
    for other in (bf16, fp16, FP8[0], fp32):
        assert exact_dot_type(fp32, other) == (tl.float32, True) and exact_dot_type(other, fp32) == (tl.float32, True)
    # the attention kernels cast the keys to the query's type instead (as their references do)
    assert query_dot_type(bf16, fp16) == (tl.bfloat16, False) and query_dot_type(fp16, FP8[1]) == (tl.float16, False)
    assert query_dot_type(bf16, fp32) == (tl.float32, True) and query_dot_type(fp32, bf16) == (tl.float32, True)


@pytest.mark.parametrize("q_dtype, k_dtype", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2),
                                              (torch.float16, torch.float16), (torch.bfloat16, torch.float16),
                                              (torch.float16, torch.bfloat16)])
def test_paged_dot_and_argmax_with_every_pair_of_operand_types(q_dtype, k_dtype):
    """A query of one type against keys of another: the scores of the values as stored (the reference upcasts both
    to fp32), however the kernel multiplies them (its own 16-bit type, or tf32 for mixed 16-bit types)."""
    gen = torch.Generator().manual_seed(17)
    q, k_pool = query((N_KV * 4, 128), q_dtype, gen), pool(1500, 128, torch.float32, gen).to(k_dtype)
    slots = slot_list(1200, 1500, gen)
    torch.testing.assert_close(TRITON.paged_dot(q, k_pool, slots), TORCH.paged_dot(q, k_pool, slots),
                               atol=1e-3, rtol=1e-4)
    best = TRITON.paged_argmax(q, k_pool, slots)
    scores = TORCH.paged_dot(q, k_pool, slots)
    torch.testing.assert_close(scores.gather(1, best[:, None]).flatten(), scores.max(dim=1).values,
                               atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fp8", FP8)
def test_a_bf16_query_against_fp8_keys_is_clamped_to_fp16s_range(fp8):
    """fp8 keys are multiplied in fp16: a bf16 query's entries beyond 65504 count as 65504 (scores stay finite, the
    reference's of the clamped query), those within fp16's normal range exactly; the argmax of ReAttention too."""
    gen = torch.Generator().manual_seed(23)
    q, k_pool = query((N_KV * 4, 128), torch.bfloat16, gen), pool(1500, 128, torch.float32, gen).to(fp8)
    q[0, 3], q[5, 0], q[6, 7] = 3e5, -1e6, 2e4  # two beyond fp16's range, one within
    slots = slot_list(1200, 1500, gen)
    clamped = q.float().clamp(-65504, 65504)
    got = TRITON.paged_dot(q, k_pool, slots)
    assert got.isfinite().all()
    torch.testing.assert_close(got, TORCH.paged_dot(clamped, k_pool, slots), atol=1e-3, rtol=1e-4)
    assert not torch.allclose(got, TORCH.paged_dot(q, k_pool, slots), atol=1e-3, rtol=1e-4)
    scores = TORCH.paged_dot(clamped, k_pool, slots)
    best = TRITON.paged_argmax(q, k_pool, slots)
    torch.testing.assert_close(scores.gather(1, best[:, None]).flatten(), scores.max(dim=1).values,
                               atol=1e-3, rtol=1e-4)


def fp8_pool_and_its_bf16_twin(n: int, d: int, gen: torch.Generator) -> tuple[KVCache, KVCache]:
    """A one-layer cache with random fp8 keys, and one holding the same key values in bf16."""
    cache = KVCache(1, n, N_KV, d, torch.float8_e4m3fn, torch.device(DEVICE))
    cache.k[0].copy_(torch.randn(n, N_KV, d, generator=gen).to(DEVICE, torch.float8_e4m3fn))
    same_keys = KVCache(1, n, N_KV, d, torch.bfloat16, torch.device(DEVICE))
    same_keys.k[0].copy_(cache.k[0].to(torch.bfloat16))
    return cache, same_keys


@pytest.mark.parametrize("kernels", [TRITON, TORCH], ids=lambda k: k.name)
def test_tokenselect_votes_over_an_fp8_pool_with_an_unquantized_query(kernels):
    """An fp8 KV pool: the vote must be the one over the same key values in bf16 (the keys upcast on
    load), with the query in its own dtype; quantizing the query to fp8 changes it far more."""
    gen = torch.Generator().manual_seed(8)
    n, d, group = 600, 64, 4
    cache, same_keys = fp8_pool_and_its_bf16_twin(n, d, gen)
    q = query((3, N_KV * group, d), torch.bfloat16, gen)  # a chunk of the model's (bf16) queries
    middle = slot_list(500, n, gen)
    fp8, bf16 = (TokenSelect(c, kernels, k=40, score_scale="sqrt_d") for c in (cache, same_keys))
    mean = q.float().mean(dim=0).to(torch.bfloat16)
    want = bf16.votes(mean, same_keys.k[0], middle)
    torch.testing.assert_close(fp8.votes(mean, cache.k[0], middle), want, atol=1e-6, rtol=1e-5)
    quantized = bf16.votes(mean.to(torch.float8_e4m3fn).to(torch.bfloat16), same_keys.k[0], middle)
    assert (quantized - want).abs().max() > 100 * 1e-6 + 1e-5 * want.abs().max()
    chunk = query_mean_ref(q, q.dtype)  # a chunk selects with its mean query, in the queries' dtype
    assert torch.equal(fp8.top(chunk, cache.k_select[0], middle), bf16.top(chunk, same_keys.k_select[0], middle))


@pytest.mark.parametrize("kernels", [TRITON, TORCH], ids=lambda k: k.name)
def test_reattention_selects_over_an_fp8_pool_with_unquantized_queries(kernels):
    """ReAttention scores every chunk query: over an fp8 pool it picks what it picks over the same key values
    in bf16 (the queries are not rounded to fp8)."""
    gen = torch.Generator().manual_seed(9)
    n, d, group = 600, 64, 4
    cache, same_keys = fp8_pool_and_its_bf16_twin(n, d, gen)
    q = query((6, N_KV * group, d), torch.bfloat16, gen)
    middle = slot_list(500, n, gen)
    fp8, bf16 = (ReAttention(c, kernels, window=4096, n_init=4, n_local=16, span=4, n_spans=30, chunk=6)
                 for c in (cache, same_keys))
    chosen = [step(policy, middle, q, decode=False) for policy in (fp8, bf16)]
    assert torch.equal(chosen[0].slots, chosen[1].slots) and chosen[0].slots.numel() > 4 + 16


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
@pytest.mark.parametrize("shape", [(1, 4096), (7, 80), (3, 5, 16), (0, 64)])  # a decode row, ragged, per head, none
def test_add_rms_norm_matches_reference(shape, dtype):
    """The residual add and the norm after it in one launch: the sum rounded as PyTorch's add rounds it (exactly
    the reference's), the norm of that sum as rms_norm's."""
    from tokenselect.kernels.rms_norm import add_rms_norm, add_rms_norm_ref

    gen = torch.Generator().manual_seed(7 + sum(shape))
    x, add = ((3 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    total, normed = add_rms_norm(x, add, weight, 1e-5)
    want_total, want = add_rms_norm_ref(x, add, weight, 1e-5)
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else
                                                {"atol": 1e-2, "rtol": 8e-3}))  # bf16: one rounding step


def test_add_rms_norm_refuses_operands_of_another_shape_or_dtype():
    from tokenselect.kernels.rms_norm import add_rms_norm

    x, w = torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    for add in (torch.ones(2, 4, device=DEVICE), torch.ones(2, 8, device=DEVICE, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="add"):
            add_rms_norm(x, add, w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])  # rows of a wider tensor, as a view (row stride > 2 * width)
@pytest.mark.parametrize("shape", [(1, 14336), (7, 300), (0, 64)])  # (rows, width): a decode row, ragged, none
def test_silu_mul_matches_reference(shape, strided, dtype):
    from tokenselect.kernels.silu_mul import silu_mul, silu_mul_ref

    gen = torch.Generator().manual_seed(sum(shape) + 1)
    rows, width = shape
    wide = (4 * torch.randn(rows, 2 * width + (24 if strided else 0), generator=gen)).to(DEVICE, dtype)
    gate_up = wide[:, :2 * width]  # gate, then up
    got = silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype
    want = silu_mul_ref(gate_up)
    torch.testing.assert_close(want, F.silu(gate_up[:, :width]) * gate_up[:, width:])
    torch.testing.assert_close(got, want, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                             else {"atol": 1e-2, "rtol": 8e-3}))


@triton.jit
def _fast_exps_kernel(x_ptr, exp2_ptr, exp_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(exp2_ptr + i, exp2_ftz(x), mask=i < n)
    tl.store(exp_ptr + i, exp_ftz(x), mask=i < n)


def test_fast_exps_match_torch_and_flush_denormal_results():
    """exp2_ftz and exp_ftz against float64 over the whole range (a softmax's logits minus their max: <= 0, down to
    -inf), with the boundary of the flush: 2^-126 is the smallest normal result and stays; below it, 0 on the GPU
    (ex2.approx.ftz), the exact value in the interpreter (plain tl.exp2). The bound 2^-21 relative held on an H200
    (ex2.approx is an approximation of a few ulp); exp_ftz's rounding of x * log2(e) adds up to |x| * 2^-24 * ln 2."""
    x = torch.cat([torch.linspace(-200.0, 100.0, 3001), torch.tensor([0.0, -1.0, -126.0, -126.5, -149.0, -150.0,
                                                                      float("-inf"), 88.0])])
    x = x.to(DEVICE)
    got2, got = torch.empty_like(x), torch.empty_like(x)
    _fast_exps_kernel[(triton.cdiv(x.numel(), 1024),)](x, got2, got, x.numel(), BLOCK=1024)
    for fn, out, rtol_at in ((torch.exp2, got2, lambda x: 2 ** -21 + 0 * x),
                            (torch.exp, got, lambda x: 2 ** -21 + x.abs() * 2 ** -23)):
        want = fn(x.double())
        normal, below_normal = (want >= 2.0 ** -126) & (want <= torch.finfo(torch.float32).max), want < 2.0 ** -126
        assert normal.sum() > 1000 and below_normal.sum() > 100
        rel = ((out.double() - want).abs() / want)[normal]
        assert (rel <= rtol_at(x.double())[normal]).all(), rel.max()
        below = out[below_normal]
        if DEVICE == "cuda":
            assert (below == 0).all()  # flushed: the denormals and the underflows
        else:
            torch.testing.assert_close(below, want[below_normal].float(), rtol=1e-5, atol=2 ** -148)  # fp32 denormals
    assert (got2[x == -126.0] == 2.0 ** -126).all() and (got2[x == float("-inf")] == 0.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a decode graph passes the model's query
@pytest.mark.parametrize("n", [64, 1000, 4096])  # query sizes n_heads * head_dim, one ragged
def test_selection_check_matches_reference(n, dtype):
    """The decision and the counters on both paths; each trial also with the candidates a decode step's selection
    sees (live on a miss, 0 on a hit), on counters of its own."""
    from tokenselect.kernels.selection_check import selection_check, selection_check_ref

    gen = torch.Generator().manual_seed(n)
    rows, layers = 5, 3
    unit = torch.nn.functional.normalize(torch.randn(rows, layers, n, generator=gen), dim=-1).to(DEVICE)
    valid = (torch.rand(rows, layers, generator=gen) < 0.7).to(DEVICE)
    kernels = {"triton": selection_check, "torch": selection_check_ref}
    counts = {(form, name): torch.zeros(2, dtype=torch.int64, device=DEVICE) for form in ("plain", "gated")
              for name in kernels}
    for trial in range(12):
        row, layer = trial % rows, trial % layers
        cached = unit[row, layer].cpu()
        q = (cached * torch.randn(1, generator=gen) + 0.7 * torch.randn(n, generator=gen) / n ** 0.5).to(DEVICE, dtype)
        theta = float(torch.empty(1).uniform_(-0.5, 0.95, generator=gen))
        row_t, live = torch.tensor(row, device=DEVICE), torch.tensor(100 + trial, device=DEVICE)
        misses = set()
        for name, check in kernels.items():
            plain = check(q, unit, valid, row_t, layer, theta, counts["plain", name])
            candidates = torch.full((), -1, dtype=torch.int64, device=DEVICE)
            gated = check(q, unit, valid, row_t, layer, theta, counts["gated", name], live, candidates)
            assert plain.shape == () and plain.dtype == torch.bool and bool(gated) == bool(plain)
            assert int(candidates) == (100 + trial if bool(plain) else 0)
            misses.add(bool(plain))
        assert len(misses) == 1  # the kernel decides as the reference
    for form in ("plain", "gated"):
        assert torch.equal(counts[form, "triton"], counts[form, "torch"]) and counts[form, "torch"].sum() == 12
    assert 0 < counts["plain", "torch"][0] < 12  # both outcomes were exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a decode graph passes the model's query
@pytest.mark.parametrize("n,width", [(64, 3), (1000, 2176), (4096, 4352)])  # query sizes and entry widths, ragged
def test_selection_update_matches_reference(n, width, dtype):
    """Store-or-reuse on both paths from the same tables: a miss stores the unit query and the new selection and
    returns it, a hit changes nothing and returns the cached one; other rows and layers are never touched. Every
    other trial writes the entry into a given tensor (a decode graph's list) instead of a new one."""
    from tokenselect.kernels.selection_update import selection_update, selection_update_ref

    gen = torch.Generator().manual_seed(n + width)
    rows, layers = 4, 3
    unit = torch.nn.functional.normalize(torch.randn(rows, layers, n, generator=gen), dim=-1).to(DEVICE)
    selection = torch.randint(0, 1 << 40, (rows, layers, width), generator=gen).to(DEVICE)
    valid = (torch.rand(rows, layers, generator=gen) < 0.5).to(DEVICE)
    tables = {name: (unit.clone(), selection.clone(), valid.clone()) for name in ("triton", "torch")}
    misses = 0
    for trial in range(8):
        row, layer, miss = trial % rows, trial % layers, trial % 3 != 1
        misses += miss
        q = (torch.randn(n, generator=gen) * 3).to(DEVICE, dtype)
        new = torch.randint(0, 1 << 40, (width,), generator=gen).to(DEVICE)
        args = (torch.tensor(row, device=DEVICE), layer, new, torch.tensor(miss, device=DEVICE))
        before = [t.clone() for t in tables["torch"]]
        outs = [torch.full((width + 2,), -1, dtype=torch.int64, device=DEVICE) for _ in range(2)]
        given = [out[1:-1] if trial % 2 else None for out in outs]  # inside a longer buffer, as a graph's list
        got = selection_update(q, *tables["triton"], *args, given[0])
        want = selection_update_ref(q, *tables["torch"], *args, given[1])
        assert torch.equal(got, want) and torch.equal(want, new if miss else before[1][row, layer])
        if trial % 2:
            assert got.data_ptr() == given[0].data_ptr() and want.data_ptr() == given[1].data_ptr()
            assert all(out[0] == out[-1] == -1 for out in outs)  # nothing written outside
        torch.testing.assert_close(tables["triton"][0], tables["torch"][0], atol=1e-6, rtol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(tables["triton"][1:], tables["torch"][1:]))
        for r, lay in ((r, lay) for r in range(rows) for lay in range(layers)):  # only a miss's entry changes
            same = all(torch.equal(t[r, lay], b[r, lay]) for t, b in zip(tables["torch"], before))
            assert same or (miss and (r, lay) == (row, layer))
        if miss:
            assert tables["torch"][2][row, layer]
            torch.testing.assert_close(tables["torch"][0][row, layer], q.float() / q.float().norm())
    assert 0 < misses < 8
    with pytest.raises(ValueError, match="selection of"):  # the kernel's row strides come from these sizes
        selection_update(q, *tables["triton"], args[0], 0, new[:-1], args[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 1000, 4096])  # row sizes n_heads * head_dim, one ragged
@pytest.mark.parametrize("n,live", [(1, None), (7, 3), (1000, None), (1000, 517), (300, 0)])
def test_block_scores_matches_reference(n, live, k, dtype):
    """The pool rows an index lists (scattered through a larger pool, some twice), the entries from the live count
    on scoring -inf whatever their index holds; the reference is the definition, a gather then a product."""
    from tokenselect.kernels.block_scores import block_scores, block_scores_ref

    gen = torch.Generator().manual_seed(n * 7 + k)
    rows = torch.randn(2 * n + 5, k, generator=gen).to(DEVICE, dtype)
    index = torch.randint(0, 2 * n + 5, (n,), generator=gen).to(DEVICE)
    query = torch.randn(k, generator=gen).to(DEVICE)
    n_valid = None if live is None else torch.tensor(live, device=DEVICE)
    live = n if live is None else live
    index[live:] = 1 << 40  # past the live prefix: never read
    got, want = block_scores(rows, index, query, n_valid), block_scores_ref(rows, index, query, n_valid)
    direct = torch.stack([rows[int(i)].float() @ query.float() for i in index[:live]]) if live else want[:0]
    torch.testing.assert_close(want[:live], direct, atol=1e-3, rtol=1e-4)
    assert torch.isneginf(want[live:]).all() and torch.isneginf(got[live:]).all()
    torch.testing.assert_close(got[:live], want[:live], atol=1e-3 * k ** 0.5, rtol=1e-4)
    with pytest.raises(ValueError, match="contiguous rows"):
        block_scores(rows.T, index, query)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_scores_read_a_bf16_query_as_its_fp32_copy(dtype):
    """InfLLM's decode step hands its query to the block scores in the model's dtype (no fp32 copy a layer): both
    kernels read it in fp32, so the scores are those of its fp32 copy, exactly."""
    from tokenselect.kernels.block_scores import block_scores, block_scores_ref

    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 1000, generator=gen).to(DEVICE, dtype)
    index, query = torch.randperm(40, generator=gen)[:30].to(DEVICE), torch.randn(1000, generator=gen).to(DEVICE)
    query = query.to(torch.bfloat16)
    for kernel in (block_scores, block_scores_ref):
        for n_valid in (None, torch.tensor(17, device=DEVICE)):
            assert torch.equal(kernel(rows, index, query, n_valid), kernel(rows, index, query.float(), n_valid))


def page_bounds_case(pages: int, n_kv: int, group: int, d: int, seed: int):
    """Three sequences' rows of page bounds (lo <= hi), one of them the sequence's, and a finite tail page."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, 3, pages, n_kv, d, generator=gen)
    tail = torch.randn(2, n_kv, d, generator=gen)
    return (torch.randn(n_kv * group, d, generator=gen).to(DEVICE), torch.minimum(a, b).to(DEVICE),
            torch.maximum(a, b).to(DEVICE), tail.amin(0).to(DEVICE), tail.amax(0).to(DEVICE))


def test_page_scores_reference_is_the_definition():
    """score[p] = max over query heads h of sum_c max(q[h, c] lo[row, p, h // group, c], q[h, c] hi[...]), the
    tail page's bounds taken from the tail (plain loops)."""
    query, lo, hi, tail_lo, tail_hi = page_bounds_case(5, 2, 3, 4, seed=1)
    query, lo, hi, tail_lo, tail_hi = (x.cpu() for x in (query, lo, hi, tail_lo, tail_hi))
    got = page_scores_ref(query, lo, hi, torch.tensor(2), tail_lo, tail_hi, torch.tensor(3))
    for p in range(5):
        l, h = (tail_lo, tail_hi) if p == 3 else (lo[2, p], hi[2, p])
        want = max(sum(max(float(query[head, c] * l[head // 3, c]), float(query[head, c] * h[head // 3, c]))
                       for c in range(4)) for head in range(6))
        assert got[p].item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pages,n_kv,group,d", [(1, 1, 1, 16), (7, 2, 4, 64), (33, 8, 1, 128), (130, 1, 8, 128),
                                                (45, 4, 4, 80)])
def test_page_scores_match_reference(pages, n_kv, group, d, dtype):
    """Ragged page counts (one block, a partial block, several), GQA groups of 1, 4 and 8, head sizes a power of
    two or not, a bf16 query read in fp32; the tail page first, in the middle and last, each sequence's row."""
    query, lo, hi, tail_lo, tail_hi = page_bounds_case(pages, n_kv, group, d, seed=pages * 31 + d)
    query = query.to(dtype)
    for row, tail_at in ((0, 0), (1, pages // 2), (2, pages - 1)):
        args = (query, lo, hi, torch.tensor(row, device=DEVICE), tail_lo, tail_hi, torch.tensor(tail_at, device=DEVICE))
        # measured: 2e-6 at d = 128 (fp32 sums in another order)
        torch.testing.assert_close(page_scores(*args), page_scores_ref(*args), atol=1e-5 * d ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("n_valid", [0, 1, 31, 32, 33, 70, 100])
def test_page_scores_past_n_valid_score_minus_infinity_and_the_rest_are_unchanged(n_valid):
    """Pages 0..n_valid-1 score as without ``n_valid`` (a block boundary at 32 on both sides, none live, all live,
    more than the row holds); the others -inf, the kernel and the reference alike."""
    query, lo, hi, tail_lo, tail_hi = page_bounds_case(70, 2, 4, 64, seed=n_valid)
    args = (query, lo, hi, torch.tensor(1, device=DEVICE), tail_lo, tail_hi, torch.tensor(40, device=DEVICE))
    whole = page_scores_ref(*args)
    live = min(n_valid, 70)
    for scores in (page_scores_ref(*args, torch.tensor(n_valid, device=DEVICE)),
                   page_scores(*args, torch.tensor(n_valid, device=DEVICE))):
        torch.testing.assert_close(scores[:live], whole[:live], atol=1e-5 * 8, rtol=1e-5)
        assert torch.isneginf(scores[live:]).all()


def test_page_scores_read_the_layer_view_of_the_bounds():
    """QUEST hands a layer's view of its [rows, layers, pages, n_kv, d] bounds (strided rows); a dead tail page
    (bounds +inf / -inf, no live key) scores what it scores, and the pages around it are unaffected."""
    query, lo, hi, _, _ = page_bounds_case(20, 2, 4, 32, seed=9)
    layers_lo, layers_hi = torch.stack([lo, lo + 1], dim=1), torch.stack([hi, hi + 1], dim=1)  # [rows, 2, P, n_kv, d]
    tail_lo = torch.full((2, 32), float("inf"), device=DEVICE)  # a tail page with no live key
    tail_hi = -tail_lo
    args = (query, layers_lo[:, 1], layers_hi[:, 1], torch.tensor(1, device=DEVICE), tail_lo, tail_hi,
            torch.tensor(19, device=DEVICE))
    got, want = page_scores(*args), page_scores_ref(*args)
    torch.testing.assert_close(got[:19], want[:19], atol=1e-4, rtol=1e-5)
    plain = page_scores_ref(query, lo + 1, hi + 1, torch.tensor(1, device=DEVICE), lo[1, 0] + 1, hi[1, 0] + 1,
                            torch.tensor(0, device=DEVICE))
    torch.testing.assert_close(got[1:19], plain[1:19], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="share their strides"):
        page_scores(query, lo, hi.transpose(2, 3), torch.tensor(0, device=DEVICE), tail_lo, tail_hi,
                    torch.tensor(0, device=DEVICE))


def test_paged_dot_reference_is_the_definition():
    gen = torch.Generator().manual_seed(3)
    q, k_pool, slots = torch.randn(8, 16, generator=gen), torch.randn(20, 2, 16, generator=gen), torch.randperm(20)[:9]
    ref = paged_dot_ref(q, k_pool, slots)
    for h in range(8):
        for t in range(9):
            assert ref[h, t].item() == pytest.approx((q[h] @ k_pool[slots[t], h // 4]).item(), abs=1e-5)


def test_head_soft_vote_reference_is_the_definition():
    """vote[t] = sum over heads h of softmax_t(q_h . k_t) at the default scale 1, and with a live prefix the
    dead entries vote -inf while the live ones are a softmax over the live ones alone (plain loops)."""
    gen = torch.Generator().manual_seed(4)
    q, k_pool, slots = torch.randn(8, 16, generator=gen), torch.randn(20, 2, 16, generator=gen), torch.randperm(20)[:9]
    dots = torch.tensor([[float(q[h] @ k_pool[slots[t], h // 4]) for t in range(9)] for h in range(8)])
    expect = sum(torch.exp(dots[h]) / torch.exp(dots[h]).sum() for h in range(8))
    torch.testing.assert_close(head_soft_vote_ref(q, k_pool, slots), expect, atol=1e-5, rtol=1e-5)
    live = sum(torch.exp(dots[h, :5]) / torch.exp(dots[h, :5]).sum() for h in range(8))
    got = head_soft_vote_ref(q, k_pool, slots, n_valid=torch.tensor(5))
    torch.testing.assert_close(got[:5], live, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(got[5:]).all()


# one chunk, ragged and past a block of rows, of a head count that leaves a block of columns part-full, a batch of a
# chunk's groups, and a view of a wider q, k, v product (a token stride past the heads)
@pytest.mark.parametrize("shape, view", [((1, 4, 16), None), ((33, 4, 16), None), ((130, 7, 24), None),
                                         ((3, 64, 4, 32), None), ((40, 8, 32), "qkv")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_mean_is_the_fp32_mean_of_a_chunks_queries(shape, view, dtype):
    """Both kernels against an fp64 mean (measured error below 1e-7), in fp32 and in the queries' dtype (within a
    rounding of the reference's: the sums run in other orders), whatever the token stride; the same sum on every
    call."""
    torch.manual_seed(len(shape) + shape[-3])
    if view == "qkv":  # the queries of a q, k, v product: each token's row also holds its keys and values
        c, h, d = shape
        q = torch.randn(c, (h + 2 * 2) * d).to(dtype)[:, :h * d].view(c, h, d)
    else:
        q = torch.randn(shape).to(dtype)
    q = q.to(DEVICE)
    want = q.double().mean(dim=-3)
    for kern in (TRITON, TORCH):
        got = kern.query_mean(q)
        assert got.dtype == torch.float32 and got.shape == shape[:-3] + shape[-2:]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        rounded = kern.query_mean(q, dtype)
        assert rounded.dtype == dtype
        ulp = 0 if dtype == torch.float32 else 2 ** -7  # bf16: a rounding apart at most
        torch.testing.assert_close(rounded, query_mean_ref(q, dtype), rtol=ulp, atol=1e-6)
    assert torch.equal(TRITON.query_mean(q), TRITON.query_mean(q))


@pytest.mark.parametrize("extra", [0, 1])
def test_query_mean_takes_pytorchs_mean_past_its_longest_chunk(monkeypatch, extra):
    """A chunk of MAX_ROWS queries is summed by the kernel; one more query and PyTorch's mean (the reference) runs,
    where the kernel was measured slower; the mean is the same either way."""
    module = importlib.import_module("tokenselect.kernels.query_mean")
    calls, reference = [], module.query_mean_ref
    monkeypatch.setattr(module, "query_mean_ref", lambda *args: calls.append(args) or reference(*args))
    q = torch.randn(module.MAX_ROWS + extra, 2, 16, device=DEVICE)
    got = module.query_mean(q)
    assert len(calls) == extra
    torch.testing.assert_close(got.double(), q.double().mean(dim=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n, k", [(1, 1), (7, 3), (7, 50), (2047, 2047), (2048, 100), (5000, 2048), (9000, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_reference(n, k, dtype):
    """Distinct random scores: exactly the reference's positions, ascending."""
    gen = torch.Generator().manual_seed(n + k)
    bits = torch.randperm(2 * n, generator=gen)[:n] + 0x3000  # distinct bfloat16 bit patterns: no ties in either dtype
    scores = bits.to(torch.int16).view(torch.bfloat16).to(DEVICE, dtype)
    got, ref = TRITON.topk(scores, k), TORCH.topk(scores, k)
    assert got.dtype == torch.int64 and torch.equal(got, ref)
    assert torch.equal(ref, scores.argsort(descending=True)[:k].sort().values)
    slots = torch.randperm(3 * n, generator=gen)[:n].to(DEVICE)  # values: the picks' slots, gathered in order
    assert torch.equal(TRITON.topk(scores, k, values=slots), slots[ref])
    assert torch.equal(TORCH.topk(scores, k, values=slots), slots[ref])


# keys that differ in the last byte only, in the second byte and up with equal last bytes, from bit 10 up, across
# bits 9 and 10, across two bytes, and in the second byte and up (a radix select of other digit widths, tried in
# issue #28, ends its digits at bits 10 and 21)
@pytest.mark.parametrize("step", [1, 1 << 8, 1 << 10, 3 << 9, 3 << 7, 1 << 13])
@pytest.mark.parametrize("sign", [1, -1])
def test_topk_resolves_every_digit(step, sign):
    """fp32 scores whose bit patterns share their top bits and differ step apart below them (distinct, in a random
    order, of one sign): the radix select has to pin the k-th largest in its lower bytes."""
    gen = torch.Generator().manual_seed(step)
    n, k = 6000, 1777
    bits = 0x3F800000 + torch.randperm(n, generator=gen).to(torch.int64) * step
    scores = (sign * bits.to(torch.int32).view(torch.float32)).to(DEVICE)
    got = TRITON.topk(scores, k)
    assert torch.equal(got, TORCH.topk(scores, k))
    assert torch.equal(got, scores.argsort(descending=True)[:k].sort().values)


# (the bits of the k keys above the others, the pass that settles the choice; None: none before the last): keys
# apart in the top byte, in the second, in the third, in the last; the k keys tied at one value among more (the
# k-th key's bin holds more keys than are wanted at every pass), and a live prefix of fewer than k keys (the -inf
# keys past it tie, and only the first of them are wanted)
@pytest.mark.parametrize("high, settles", [(0x40800000, 0), (0x3FC00000, 1), (0x3F808000, 2), (0x3F800080, None),
                                           ("tied", None), ("few live", None)])
def test_topk_settles_once_every_key_sharing_the_bytes_found_is_wanted(monkeypatch, high, settles):
    """n - k keys of 1.0 (0x3F800000) and k keys of a larger score: once a pass finds that every key sharing the
    bytes found so far is wanted, the passes after it have nothing to do (``SETTLED``); the k-th largest stands as
    the lowest key with that prefix, and the picks are the reference's."""
    topk_module = importlib.import_module("tokenselect.kernels.topk")
    n, k = 5000, 700
    gen = torch.Generator().manual_seed(n)
    order = torch.randperm(n, generator=gen)
    bits = torch.full((n,), 0x3F800000, dtype=torch.int64)
    live = None
    if high == "tied":  # 2k tied keys above the others: the k-th key's bin holds 2k at every pass
        bits[order[:2 * k]] = 0x40000000
    elif high == "few live":
        live = torch.tensor(k // 2, device=DEVICE)
    else:
        bits[order[:k]] = high
    scores = bits.to(torch.int32).view(torch.float32).to(DEVICE)
    states, zeros = [], torch.zeros

    def keep_state(*args, **kwargs):
        out = zeros(*args, **kwargs)
        states.append(out)
        return out

    monkeypatch.setattr(torch, "zeros", keep_state)
    got = TRITON.topk(scores, k, live)
    monkeypatch.undo()
    assert torch.equal(got, TORCH.topk(scores, k, live))
    state = states[0][0].cpu()  # [STATE] int32 of the one sequence
    assert state.numel() == topk_module.STATE.value and state[topk_module.SETTLED.value] == (settles is not None)
    if settles is not None:  # the passes after it took no ticket
        tickets = state[topk_module.TICKETS.value:topk_module.TICKETS.value + 4]
        assert (tickets[:settles + 1] > 0).all() and (tickets[settles + 1:] == 0).all()


@pytest.mark.parametrize("n, k", [(10, 4), (3000, 700), (5000, 4999)])
def test_topk_takes_the_first_of_tied_scores(n, k):
    """Scores from a handful of values, so the k-th largest is tied: every score above it, then the first
    of the tied ones in order until k are chosen."""
    gen = torch.Generator().manual_seed(n)
    scores = torch.randint(0, 5, (n,), generator=gen).float()
    kth = scores.sort(descending=True).values[k - 1]
    above = (scores > kth).nonzero().flatten()
    ties = (scores == kth).nonzero().flatten()[:k - above.numel()]
    got = TRITON.topk(scores.to(DEVICE), k).cpu()
    assert torch.equal(got, torch.cat([above, ties]).sort().values)
    assert torch.equal(TORCH.topk(scores.to(DEVICE), k).cpu(), got)  # the reference takes the first ones too
    live = torch.tensor(n // 2, device=DEVICE)  # and past a live prefix, whatever the padding
    assert torch.equal(TORCH.topk(scores.to(DEVICE), k // 2, live), TORCH.topk(scores[:n // 2].to(DEVICE), k // 2))
    assert torch.equal(TRITON.topk(scores.to(DEVICE), k // 2, live), TORCH.topk(scores.to(DEVICE), k // 2, live))


@pytest.mark.parametrize("n, live, k", [(5000, 3000, 100), (5000, 4097, 2048), (300, 1, 1), (5000, 1000, 1500)])
def test_topk_over_a_live_prefix(n, live, k):
    """Only scores[:live] are read; the rest count as -inf, taken (first ones first) only when fewer than k
    are live."""
    gen = torch.Generator().manual_seed(live)
    scores = torch.randn(n, generator=gen).to(DEVICE)
    n_valid = torch.tensor(live, device=DEVICE)
    got, ref = TRITON.topk(scores, k, n_valid), TORCH.topk(scores, k, n_valid)
    assert torch.equal(got, ref)
    if live >= k:
        assert got.max() < live
    else:
        assert torch.equal(got, torch.cat([torch.arange(live), torch.arange(live, k)]).to(DEVICE))
        assert torch.equal(ref[:live], got[:live])
    poisoned = scores.clone()
    poisoned[live:] = float("inf")  # not read
    assert torch.equal(TRITON.topk(poisoned, k, n_valid), got)
    slots = torch.randperm(2 * n, generator=gen)[:n].to(DEVICE)
    assert torch.equal(TRITON.topk(scores, k, n_valid, slots), slots[got])


@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
def test_topk_writes_to_out(kern):
    """With ``out`` the picks (or the values at them) land in that tensor, which comes back; a wrong one is refused."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(5000, generator=gen).to(DEVICE)
    slots = torch.randperm(9000, generator=gen)[:5000].to(DEVICE)
    frame = torch.full((1500,), -1, dtype=torch.int64, device=DEVICE)
    out = frame[100:1400]  # a slice of a longer list, as a graph's attended list
    got = kern.topk(scores, 1300, torch.tensor(4000, device=DEVICE), slots, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, TORCH.topk(scores, 1300, torch.tensor(4000, device=DEVICE), slots))
    assert (frame[:100] == -1).all() and (frame[1400:] == -1).all()
    for bad in (frame[:1299], frame[:2600:2], frame[:1300].int()):
        with pytest.raises(ValueError, match="out must be"):
            kern.topk(scores, 1300, out=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter compiles nothing")
def test_topk_compiles_no_new_variant_when_the_block_count_reaches_a_multiple_of_16(monkeypatch):
    """A longer prompt runs the top-k's kernels already compiled for a shorter one: 15 blocks of scores, then 16
    (Triton specializes an integer argument divisible by 16; the count and write kernels take the block count)."""
    from triton import knobs

    topk_module = importlib.import_module("tokenselect.kernels.topk")  # the package exports its function by that name
    for kernel in (topk_module._count_kernel, topk_module._write_kernel):
        kernel.device_caches.clear()  # variants other tests compiled (the 16-block one among them) are met again
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *, fn, **_: compiled.append(fn.name) and False)
    for n in (14 * 2048 + 7, 15 * 2048 + 7):  # odd lengths both: only the block count's divisibility changes
        scores = torch.randn(n, device=DEVICE)
        compiled.clear()
        assert torch.equal(TRITON.topk(scores, 1001, torch.tensor(n, device=DEVICE)),
                           TORCH.topk(scores, 1001, torch.tensor(n, device=DEVICE)))
    assert compiled == []


def test_topk_of_nothing_live():
    """A decode graph's Selection Cache hit: no score is read (NaNs there change nothing), and the first k
    positions come back, or the first k values."""
    scores = torch.randn(3000, device=DEVICE)
    none = torch.tensor(0, device=DEVICE)
    assert torch.equal(TRITON.topk(scores, 2048, none).cpu(), torch.arange(2048))
    poisoned = torch.full_like(scores, float("nan"))
    slots = torch.randperm(5000)[:3000].to(DEVICE)
    assert torch.equal(TRITON.topk(poisoned, 2048, none, slots), slots[:2048])
    assert torch.equal(TRITON.topk(torch.full_like(scores, float("-inf")), 2048).cpu(), torch.arange(2048))
    assert TRITON.topk(scores[:0], 5).numel() == 0


def positions(n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct key positions up to 2.1M, unsorted (causality follows the list order, not the
    positions): angles of up to ~2M rad, which the kernels' sin/cos must reduce exactly."""
    return (torch.randperm(100_000, generator=gen)[:n] * 21).to(DEVICE)


def rope_inputs(c: int, n: int, d: int, gen: torch.Generator):
    """Key positions as :func:`positions` gives them; the chunk's own queries sit at the positions of the
    last c keys."""
    key_pos = positions(n, gen)
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
    assert_attention_close(got, TORCH.sparse_attention(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("c,live,n,one_split", [(1, 1, 64, False), (1, 700, 1000, False), (1, 1000, 1000, False),
                                                (7, 7, 300, False), (7, 555, 1000, False), (100, 250, 300, False),
                                                (7, 555, 1000, True), (100, 250, 300, True)])
def test_sparse_attention_over_a_live_prefix(monkeypatch, c, live, n, one_split, group, dtype):
    """A graph's fixed-length list: only its first n_valid entries (the chunk's own tokens last among them)
    are attended, as the plain call over that prefix. The entries after it point at rows of NaN keys and
    values: one read of them, masked or not, would turn the output to NaN. Split-K (a decode step on the
    GPU) and one program per row block (a prefill chunk on the GPU: TARGET_PROGRAMS 1 forces it here)."""
    if one_split:
        monkeypatch.setattr(sys.modules["tokenselect.kernels.sparse_attention"], "TARGET_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(c * 10_000 + live + group)
    d = 128
    q = query((c, N_KV * group, d), dtype, gen)
    k_pool, v_pool = pool(n + 300, d, dtype, gen), pool(n + 300, d, dtype, gen)
    slots = slot_list(n, n + 300, gen)
    k_pool[slots[live:]] = float("nan")
    v_pool[slots[live:]] = float("nan")
    key_pos = positions(n, gen)
    q_pos = key_pos[live - c:live]
    _, _, inv_freq, scale = rope_inputs(c, n, d, gen)
    n_valid = torch.tensor(live, device=DEVICE)
    got = TRITON.sparse_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale, n_valid=n_valid)
    want = TORCH.sparse_attention(q, k_pool, v_pool, slots[:live], key_pos[:live], q_pos, inv_freq, scale)
    assert not got.isnan().any()
    assert_attention_close(got, want, dtype)
    masked = TORCH.sparse_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale, n_valid=n_valid)
    assert_attention_close(masked, want, dtype)  # the reference masks (no host read) to the same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("live", [None, 1200])
def test_decode_merges_more_splits_than_a_merge_block(dtype, group, live):
    """A decode query over 5,000 keys: 79 splits of one 64-key block in bf16 (2 kv heads: up to 198; 198 of 16-key
    blocks in fp32), which the merge walks MERGE_SPLITS (64) at a time, its running max rescaling what it summed. With
    a live prefix of 1,200 keys only the first splits see any (19 in bf16, 75 in fp32); the others, a whole merge block
    of them and more, carry m = -inf and must weigh nothing (past the prefix the keys and values are NaN)."""
    kernel = sys.modules["tokenselect.kernels.sparse_attention"]
    n, d = 5000, 128
    gen = torch.Generator().manual_seed(group * 10 + (live or 0))
    q = query((1, N_KV * group, d), dtype, gen)
    k_pool, v_pool = pool(n + 100, d, dtype, gen), pool(n + 100, d, dtype, gen)
    slots = slot_list(n, n + 100, gen)
    used = live or n
    k_pool[slots[used:]] = float("nan")
    v_pool[slots[used:]] = float("nan")
    key_pos = positions(n, gen)
    _, _, inv_freq, scale = rope_inputs(1, n, d, gen)
    tile = kernel.FP32_DECODE_TILE if dtype == torch.float32 else kernel.DECODE_TILE
    splits, _ = kernel.key_splits(n, tile[1], kernel.TARGET_PROGRAMS // N_KV)
    assert splits > kernel.MERGE_SPLITS  # the merge's loop runs more than one block
    n_valid = None if live is None else torch.tensor(live, device=DEVICE)
    got = TRITON.sparse_attention(q, k_pool, v_pool, slots, key_pos, key_pos[used - 1:used], inv_freq, scale,
                                  n_valid=n_valid)
    want = TORCH.sparse_attention(q, k_pool, v_pool, slots[:used], key_pos[:used], key_pos[used - 1:used], inv_freq,
                                  scale)
    assert not got.isnan().any()
    assert_attention_close(got, want, dtype)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("c,n,one_split", [(1, 300, False), (1, 300, True), (5, 120, False)])
@pytest.mark.parametrize("shared", [False, True])
def test_sparse_attention_of_a_batch_is_each_sequence_alone(monkeypatch, c, n, one_split, group, dtype, shared):
    """Three sequences in one launch (a whole-step graph's batch), as each alone: their slot lists rows of one
    table (a strided view, no copy), live prefixes of their own (one the whole list; past them NaN keys and
    values), key positions and frequencies per sequence or shared by all (stride 0). Split-K over the batch
    (decode), one split, and chunks of 5 queries (the keys rotated once per sequence first)."""
    if one_split:
        monkeypatch.setattr(sys.modules["tokenselect.kernels.sparse_attention"], "TARGET_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(n * 10 + c + group)
    d, batch, slots_n = 64, 3, 3 * n + 50
    q = query((batch, c, N_KV * group, d), dtype, gen)
    k_pool, v_pool = pool(slots_n, d, dtype, gen), pool(slots_n, d, dtype, gen)
    table = torch.randperm(slots_n, generator=gen)[:batch * (n + 7)].view(batch, n + 7).to(DEVICE)
    slots = table[:, 2:n + 2]  # rows of the table at a stride of n + 7
    lives = [n, n // 2, c + 3]
    for b, live in enumerate(lives[1:], 1):
        k_pool[slots[b, live:]] = float("nan")
        v_pool[slots[b, live:]] = float("nan")
    k_pool[slots[0]] = k_pool[slots[0]].nan_to_num()  # the first sequence reads rows the others poisoned
    v_pool[slots[0]] = v_pool[slots[0]].nan_to_num()
    if shared:
        key_pos, _, inv_freq, scale = rope_inputs(c, n, d, gen)
        q_pos = torch.stack([key_pos[live - c:live] for live in lives])
    else:
        ropes = [rope_inputs(c, n, d, gen) for _ in range(batch)]
        key_pos = torch.stack([r[0] for r in ropes])
        q_pos = torch.stack([r[0][live - c:live] for r, live in zip(ropes, lives)])
        inv_freq = torch.stack([r[2] * (1 + 0.1 * b) for b, r in enumerate(ropes)])
        scale = ropes[0][3]
    n_valid = torch.tensor(lives, device=DEVICE)
    # the queries as the model hands them: a view of one q, k, v product (a token stride past n_heads * d)
    product = torch.randn(batch * c, (N_KV * group + 2 * N_KV) * d, generator=gen).to(DEVICE, dtype)
    product[:, :N_KV * group * d] = q.reshape(batch * c, -1)
    q_view = product[:, :N_KV * group * d].view(batch, c, N_KV * group, d)  # (with c = 1: stride(1) is n_heads * d)
    assert not q_view.is_contiguous() and torch.equal(q_view, q)
    got = TRITON.sparse_attention(q_view, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale, n_valid=n_valid)
    assert got.shape == q.shape and not got.isnan().any()
    for b, live in enumerate(lives):
        pos = key_pos if shared else key_pos[b]
        alone = TORCH.sparse_attention(q[b], k_pool, v_pool, slots[b, :live], pos[:live], q_pos[b],
                                       inv_freq if shared else inv_freq[b], scale)
        assert_attention_close(got[b], alone, dtype)
    batched_ref = TORCH.sparse_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale, n_valid=n_valid)
    assert_attention_close(got, batched_ref, dtype)


def fp8_pools_call(c: int, seed: int, v_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple:
    """``sparse_attention``'s arguments for a bf16 chunk of c queries over fp8 pools (800 of 900 slots listed), rope
    scale 1 and an explicit softmax scale of 0.05."""
    gen = torch.Generator().manual_seed(seed)
    q = query((c, 8, 128), torch.bfloat16, gen)
    k_pool = pool(900, 128, torch.float32, gen).to(torch.float8_e4m3fn)
    v_pool = pool(900, 128, torch.float32, gen).to(v_dtype)
    slots = slot_list(800, 900, gen)
    key_pos, q_pos, inv_freq, _ = rope_inputs(c, 800, 128, gen)
    return q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, 1.0, 0.05


def test_sparse_attention_explicit_softmax_scale_and_fp8_pool():
    args = fp8_pools_call(5, 7)
    assert_attention_close(TRITON.sparse_attention(*args), TORCH.sparse_attention(*args), torch.bfloat16)


# the cuDNN path against the fp64 reference, a fraction of the largest output: measured (the interpreter, cuDNN's
# reference in its place; tests below) at most 2.8e-2 in bf16 (the Triton kernel 2.6e-2 on the same inputs, the bf16
# reference itself 1.4e-2) and 9.2e-4 in fp16; the keys are rounded to 16 bits after RoPE at positions up to 2.1M
CUDNN_PATH_ATOL_OF_MAX = {torch.bfloat16: 3.5e-2, torch.float16: 1.5e-3}


def assert_close_to_exact(got: torch.Tensor, q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, rope_scale=1.0,
                          sm_scale=None) -> None:
    """One sequence's sparse attention ``got`` [c, H, d] against the reference computed in fp64."""
    exact = TORCH.sparse_attention(q.double(), k_pool.double(), v_pool.double(), slots, key_pos, q_pos, inv_freq,
                                   rope_scale, sm_scale)
    bound = CUDNN_PATH_ATOL_OF_MAX[got.dtype] * exact.abs().max().item()
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=bound)


@pytest.fixture
def cudnn_or_its_reference(monkeypatch):
    """The cuDNN path's attention calls: cuDNN itself on CUDA; on a CPU, where cuDNN cannot run, its plain-PyTorch
    reference in their place (so that everything around them, the rotation and gather, the split and the merge
    kernel, runs in the interpreter). Yields the number of chunks that took the cuDNN path (a list of one int)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(cudnn_module, "cudnn_attention", cudnn_module.cudnn_attention_ref)
    taken = [0]
    chunk = attention_module._chunk_by_cudnn

    def counted(*args):
        taken[0] += 1
        return chunk(*args)
    monkeypatch.setattr(attention_module, "_chunk_by_cudnn", counted)
    yield taken


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("batch,c,n", [(1, 64, 64), (1, 64, 1000), (3, 128, 300), (2, 192, 700)])
def test_sparse_attention_by_cudnn_matches_reference(cudnn_or_its_reference, batch, c, n, group, dtype):
    """With a cuDNN budget: chunks of a multiple of 64 queries over whole lists (a chunk alone, c == n; after
    a context; a batch of groups, each its own list) against the fp64 reference, per sequence, at key positions up
    to 2.1M; the path was taken for every call."""
    gen = torch.Generator().manual_seed(batch * 1000 + c + n + group)
    d = 128
    q = query((batch, c, N_KV * group, d), dtype, gen)
    k_pool, v_pool = pool(n + 300, d, dtype, gen), pool(n + 300, d, dtype, gen)
    slots = torch.stack([slot_list(n, n + 300, gen) for _ in range(batch)])
    key_pos, _, inv_freq, scale = rope_inputs(c, n, d, gen)
    q_pos = key_pos[-c:].expand(batch, c)
    got = TRITON.sparse_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale, cudnn=PlanBudget())
    assert cudnn_or_its_reference == [1] and got.shape == q.shape and got.dtype == dtype
    for b in range(batch):
        assert_close_to_exact(got[b], q[b], k_pool, v_pool, slots[b], key_pos, q_pos[b], inv_freq, scale)


def test_sparse_attention_by_cudnn_reads_fp8_pools_and_a_softmax_scale(cudnn_or_its_reference):
    args = fp8_pools_call(64, 8, torch.float8_e5m2)
    got = TRITON.sparse_attention(*args, cudnn=PlanBudget())
    assert cudnn_or_its_reference == [1]
    assert_close_to_exact(got, *args)


@pytest.mark.parametrize("c,dtype,live,taken", [(64, torch.bfloat16, False, True), (63, torch.bfloat16, False, False),
                                                 (65, torch.bfloat16, False, False), (128, torch.float32, False, False),
                                                 (64, torch.bfloat16, True, False), (2, torch.bfloat16, False, False)])
def test_sparse_attention_takes_cudnn_only_for_whole_lists_of_64_query_multiples(cudnn_or_its_reference, c, dtype,
                                                                                 live, taken):
    """The cuDNN path's boundary: c == CUDNN_GRAIN takes it; 63 and 65 queries (a prompt's ragged end: a plan for one
    use), fp32, a graph's live prefix (n_valid) and a decode-sized chunk take the Triton kernel.
    Either way the result is the reference's."""
    gen = torch.Generator().manual_seed(c + live)
    n = 400
    q = query((c, 8, 128), dtype, gen)
    k_pool, v_pool = pool(n + 100, 128, dtype, gen), pool(n + 100, 128, dtype, gen)
    slots = slot_list(n, n + 100, gen)
    key_pos, q_pos, inv_freq, scale = rope_inputs(c, n, 128, gen)
    n_valid = torch.tensor(n, device=DEVICE) if live else None
    args = (q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale)
    got = TRITON.sparse_attention(*args, n_valid=n_valid, cudnn=PlanBudget())
    assert cudnn_or_its_reference == [int(taken)]
    if taken:
        assert_close_to_exact(got, *args)
    else:
        assert_attention_close(got, TORCH.sparse_attention(*args), dtype)


def test_sparse_attention_by_cudnn_admits_a_bounded_set_of_shapes(cudnn_or_its_reference):
    """A budget of 2 shapes: a first and a second shape run by cuDNN, a third by the Triton kernel (PyTorch keeps a
    plan for every shape cuDNN runs), a first shape again by cuDNN; each result the reference's."""
    gen = torch.Generator().manual_seed(3)
    budget = PlanBudget(limit=2)
    k_pool, v_pool = pool(1200, 128, torch.bfloat16, gen), pool(1200, 128, torch.bfloat16, gen)
    taken = []
    for c, n in ((64, 300), (128, 300), (64, 500), (64, 300)):
        q = query((c, 8, 128), torch.bfloat16, gen)
        slots = slot_list(n, 1200, gen)
        key_pos, q_pos, inv_freq, scale = rope_inputs(c, n, 128, gen)
        args = (q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale)
        before = cudnn_or_its_reference[0]
        got = TRITON.sparse_attention(*args, cudnn=budget)
        taken.append(cudnn_or_its_reference[0] - before)
        assert_close_to_exact(got, *args)
    assert taken == [1, 1, 0, 1] and len(budget.shapes) == 2 and budget.calls == 3  # the calls it took


def test_chunk_attention_backend_resolves_and_refuses():
    """auto: cuDNN only where it is the faster (never on a CPU, never for fp32: decided without asking a GPU);
    cudnn named where it cannot run, an unknown name, or cudnn with the torch kernels: a ValueError that says why."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert chunk_attention_backend("auto", "triton", cpu, torch.bfloat16) == "triton"
    assert chunk_attention_backend("auto", "triton", cuda, torch.float32) == "triton"
    assert chunk_attention_backend("auto", "torch", cuda, torch.bfloat16) == "triton"
    assert chunk_attention_backend("triton", "triton", cuda, torch.bfloat16) == "triton"
    assert chunk_attention_backend("cudnn", "triton", cuda, torch.float16) == "cudnn"
    for kernels, device, dtype in (("triton", cpu, torch.bfloat16), ("torch", cuda, torch.bfloat16),
                                   ("triton", cuda, torch.float32)):
        with pytest.raises(ValueError, match="chunk_attention=cudnn runs with the triton kernels on CUDA in bf16"):
            chunk_attention_backend("cudnn", kernels, device, dtype)
    with pytest.raises(ValueError, match="chunk_attention='flash': one of auto, triton, cudnn"):
        chunk_attention_backend("flash", "triton", cuda, torch.bfloat16)
    first, second = (get_kernels("triton", "cudnn").sparse_attention.keywords["cudnn"] for _ in range(2))
    assert isinstance(first, PlanBudget) and first is not second  # a budget for each engine
    assert get_kernels("triton", "triton") is TRITON
    with pytest.raises(ValueError, match="chunk_attention='cudnn' with torch kernels"):
        get_kernels("torch", "cudnn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,c,d", [(1, 1, 1, 64), (2, 8, 100, 128), (3, 4, 33, 80)])
def test_merge_by_lse_matches_reference(batch, heads, c, d, dtype):
    """The merge kernel against its reference: parts at cuDNN's [B, H, c, d] strides (a transpose of token-major
    rows), written into the engine's [B, c, H, d] rows; some rows' second part without keys (lse -inf: weight 0),
    lse with cuDNN's trailing size-1 dimension; d not a power of two (80)."""
    gen = torch.Generator().manual_seed(batch * 100 + c + d)
    a, b = (torch.randn(batch, c, heads, d, generator=gen).to(DEVICE, dtype).transpose(1, 2) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(batch, heads, c, 1, generator=gen).to(DEVICE) for _ in range(2))
    lse_b[:, :, ::3] = float("-inf")
    out = torch.empty(batch, c, heads, d, dtype=dtype, device=DEVICE)
    got = merge_by_lse(a, lse_a, b, lse_b, out=out.transpose(1, 2))
    want = merge_by_lse_ref(a, lse_a, b, lse_b)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.transpose(1, 2), want, **({} if dtype == torch.bfloat16 else dict(atol=1e-6,
                                                                                                      rtol=1e-6)))
    torch.testing.assert_close(out.transpose(1, 2)[:, :, ::3], a[:, :, ::3])  # weight 0: the first part, as it is


@pytest.mark.skipif(DEVICE == "cpu", reason="cuDNN runs on CUDA")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("c,L", [(64, 64), (100, 1000), (512, 2688)])
def test_cudnn_attention_matches_its_reference(c, L, group, causal):
    """cuDNN's attention and log-sum-exp (natural log, [B, H, c, 1]) against the plain-PyTorch reference that stands in
    for it on a CPU, GQA 1/4/8, top-left causal or none, on strided [B, H, *, d] views of token-major rows."""
    gen = torch.Generator().manual_seed(c + L + group)
    q = torch.randn(2, c, 2 * group, 128, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, L, 2, 128, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2) for _ in range(2))
    if causal and c != L:
        k, v = k[:, :, :c], v[:, :, :c]
    got, got_lse = cudnn_module.cudnn_attention(q, k, v, causal)
    want, want_lse = cudnn_module.cudnn_attention_ref(q, k, v, causal)
    assert got_lse.shape == want_lse.shape == (2, 2 * group, c, 1)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-2, rtol=0)  # scores from bf16 q and k in fp32
    assert_attention_close(got.transpose(1, 2), want.transpose(1, 2), torch.bfloat16)


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


# (chunk c, list length n, n_local, window columns w): one query alone, a window shorter than the chunk,
# the whole list, the longest window (n_local + c - 1), one wider than that, ragged everywhere
WINDOW_SHAPES = [(1, 1, 1, 1), (1, 45, 8, 8), (1, 60, 8, 20), (7, 37, 64, 37), (33, 150, 7, 20), (40, 300, 50, 89),
                 (24, 200, 9, 120)]


def window_inputs(c: int, n: int, d: int, group: int, dtype: torch.dtype, k_dtype: torch.dtype, gen: torch.Generator):
    """q [c, N_KV * group, d], an unsorted list of n slots into a larger pool."""
    k_pool = pool(n + 100, d, torch.float32, gen).to(k_dtype)
    return query((c, N_KV * group, d), dtype, gen), k_pool, slot_list(n, n + 100, gen)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("c,n,n_local,w", WINDOW_SHAPES)
def test_window_mass_matches_reference(c, n, n_local, w, group, dtype, d):
    gen = torch.Generator().manual_seed(c * 1000 + n + group + d)
    q, k_pool, slots = window_inputs(c, n, d, group, dtype, dtype, gen)
    t0 = 5000
    args = (q, k_pool, slots, c, t0, t0 + c - w, n_local, d ** -0.5)
    got = TRITON.window_mass(*args)
    assert got.shape == (w, N_KV * group) and got.dtype == torch.float32
    torch.testing.assert_close(got, TORCH.window_mass(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("q_dtype,k_dtype,d,group", [(torch.bfloat16, torch.float8_e4m3fn, 64, 4),
                                                     (torch.float32, torch.bfloat16, 80, 3),
                                                     (torch.bfloat16, torch.float32, 16, 2)])
@pytest.mark.parametrize("c", [1, 19])
def test_window_mass_mixed_dtypes_and_odd_shapes(q_dtype, k_dtype, d, group, c):
    """An fp8 pool (keys upcast, the query kept as it is), keys and queries of different precisions,
    a head_dim that is no power of two, a GQA group of 3; a chunk and a decode step's single query."""
    gen = torch.Generator().manual_seed(d + group)
    q, k_pool, slots = window_inputs(c, 230, d, group, q_dtype, k_dtype, gen)
    args = (q, k_pool, slots, c, 700, 640, 60, 0.1)
    torch.testing.assert_close(TRITON.window_mass(*args), TORCH.window_mass(*args), atol=1e-5, rtol=1e-4)


def test_window_mass_reference_is_the_definition():
    """Query i (token t0 + i) sees the context and the chunk up to itself; key j' (token lo + j', the list's
    column n - w + j') gets the query's softmax weight when 0 <= (t0 + i) - (lo + j') < n_local."""
    gen = torch.Generator().manual_seed(12)
    c, n, n_local, t0, lo, group, d = 4, 11, 3, 20, 17, 2, 16
    q, k_pool = torch.randn(c, 2 * group, d, generator=gen), torch.randn(30, 2, d, generator=gen)
    slots = torch.randperm(30, generator=gen)[:n]
    w = t0 + c - lo
    want = torch.zeros(w, 2 * group, dtype=torch.float64)
    for h in range(2 * group):
        for i in range(c):
            seen = slots[:n - c + i + 1]
            p = torch.softmax(k_pool[seen, h // group].double() @ q[i, h].double() * 0.3, dim=0)
            for jw in range(w):
                if 0 <= (t0 + i) - (lo + jw) < n_local:
                    want[jw, h] += p[n - w + jw]
    got = TORCH.window_mass(q, k_pool, slots, c, t0, lo, n_local, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_infllm_counts_the_same_with_either_kernel_set():
    """InfLLM's local scores, hence its block representatives and choices, agree between the kernel sets."""
    from tokenselect.policies.infllm import InfLLM

    gen = torch.Generator().manual_seed(13)
    t, n_heads, d = 150, 8, 16
    cache = KVCache(1, 30 + t, N_KV, d, torch.float32, torch.device(DEVICE))
    own = cache.allocate(30)  # slots 0..29: a step's own tokens (``step`` puts them there), apart from the context's
    slots = cache.allocate(t)[torch.randperm(t, generator=gen).to(DEVICE)]
    cache.write(0, torch.cat([own, slots]), *torch.randn(2, 30 + t, N_KV, d, generator=gen).to(DEVICE))
    policies = [InfLLM(cache, kern, window=1000, k=16, n_init=4, n_local=16, block_size=8, repr_keys=2)
                for kern in (TRITON, TORCH)]
    for t0 in range(0, t, 30):
        q = query((30, n_heads, d), torch.float32, gen)
        plans = [step(p, slots[:t0], q, decode=False) for p in policies]
        assert torch.equal(plans[0].slots, plans[1].slots)
    for p in policies:
        step(p, slots, q[:1], decode=True)  # counts the last chunk (and the decode token's own attention)
    ours, ref = (p._memory[0].layers[0] for p in policies)
    assert ours.closed == ref.closed > 0 and ours.tracked == ref.tracked == t + 1  # the decode token's entry too
    torch.testing.assert_close(ours.ring, ref.ring, atol=1e-5, rtol=1e-4)  # the local scores, as the ring holds them
    torch.testing.assert_close(*(p.representatives(0, 0) for p in policies), atol=1e-5, rtol=1e-4)


def test_triton_policy_equals_torch_policy(tiny_llama):
    """The whole TokenSelect path (selection and attention, prefill chunks and decode with the
    Selection Cache) gives the same logits and tokens with either kernel set."""
    ids = torch.randint(2, 300, (160,), generator=torch.Generator().manual_seed(4)).tolist()
    settings = dict(chunk_size=32, k=24, n_init=4, n_local=16, theta=0.8, dense_until=0, device=DEVICE,
                    dtype=torch.float32)
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


def live_scores(q, k_pool, slots, n_valid) -> torch.Tensor:
    """fp32 scores [R, N] of head-major rows against their kv head's keys, -inf past n_valid (the test's own)."""
    n_kv = k_pool.shape[1]
    per_kv = q.shape[0] // n_kv
    keys = k_pool[slots].float()
    scores = torch.stack([q[r].float() @ keys[:, r // per_kv].T for r in range(q.shape[0])])
    if n_valid is not None:
        scores[:, int(n_valid):] = float("-inf")
    return scores


@pytest.mark.parametrize("d", [64, 80])  # 80: padded to 128 lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv,group,chunk", [(4, 1, 5), (2, 4, 9), (1, 8, 9)])  # GQA 1/4/8; 5, 36, 72 rows a kv head
@pytest.mark.parametrize("n,n_valid", [(1, None), (37, 20), (300, None), (300, 0)])
def test_paged_argmax_matches_reference(n, n_valid, n_kv, group, chunk, dtype, d):
    """Random ragged inputs: every row's pick is its best live key's index, the reference's wherever the two best
    scores are further apart than rounding (fp32 products: 1e-4; bf16 keys exact in the tf32 products: 1e-3), and
    scores within that of the best elsewhere; with no live slot, 0."""
    gen = torch.Generator().manual_seed(n * 100 + n_kv * 10 + group + d)
    q = query((n_kv * group * chunk, d), dtype, gen)
    k_pool = torch.randn(n + 50, n_kv, d, generator=gen).to(DEVICE, dtype)
    slots = slot_list(n, n + 50, gen)
    live = None if n_valid is None else torch.tensor(n_valid, device=DEVICE)
    got, want = TRITON.paged_argmax(q, k_pool, slots, live), TORCH.paged_argmax(q, k_pool, slots, live)
    assert got.shape == want.shape == (q.shape[0],) and got.dtype == want.dtype == torch.int64
    if n_valid == 0:
        assert not got.any() and not want.any()
        return
    scores = live_scores(q.cpu(), k_pool.cpu(), slots.cpu(), n_valid)
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    top2 = scores.topk(min(2, scores.shape[1]), dim=1).values
    clear = top2[:, 0] - top2[:, -1] > tol if scores.shape[1] > 1 else torch.ones(len(scores), dtype=torch.bool)
    best = top2[:, 0]
    for picks in (got.cpu(), want.cpu()):
        assert (picks < (n if n_valid is None else n_valid)).all()
        assert (scores.gather(1, picks[:, None])[:, 0] >= best - tol).all()
        assert torch.equal(picks[clear], scores[clear].argmax(dim=1))
    assert clear.float().mean() > 0.9  # the comparison is not vacuous


@pytest.mark.parametrize("rows_per_block", [1, 3, 7])
def test_paged_argmax_reference_scores_in_blocks_of_rows_as_in_one(monkeypatch, rows_per_block):
    """The reference scores REF_SCORES floats at a time, a block of each kv head's rows (of 1, of 3 and 7 with a
    partial last block): the picks are those of one block of all rows."""
    module = importlib.import_module("tokenselect.kernels.paged_argmax")  # (the package's name is the function)
    gen = torch.Generator().manual_seed(rows_per_block)
    q, k_pool = query((2 * 4 * 5, 16), torch.float32, gen), pool(90, 16, torch.float32, gen)
    slots, live = slot_list(60, 90, gen), torch.tensor(45, device=DEVICE)
    whole = module.paged_argmax_ref(q, k_pool, slots, live)
    monkeypatch.setattr(module, "REF_SCORES", N_KV * 60 * rows_per_block)
    assert torch.equal(module.paged_argmax_ref(q, k_pool, slots, live), whole)
    assert (whole < 45).all() and whole.unique().numel() > 5


@pytest.mark.parametrize("kernels", [TRITON, TORCH], ids=lambda k: k.name)
def test_paged_argmax_takes_the_first_of_equal_maxima(kernels):
    """A slot listed twice scores the same twice: the earlier listing is the pick, as ``torch.argmax`` does, also
    where the equal maxima fall in different blocks of the kernel (entries 3 and 200). Small integer keys and
    queries: every dot product is exact, so the maxima are equal however a kernel sums."""
    gen = torch.Generator().manual_seed(5)
    k_pool = torch.randint(-3, 4, (400, 1, 16), generator=gen).float().to(DEVICE)
    slots = torch.randperm(400, generator=gen)[:300].to(DEVICE)
    q = torch.zeros(3, 16, device=DEVICE)
    q[0] = k_pool[slots[3], 0]  # its own key scores highest (|k|^2)
    q[1], q[2] = q[0], -q[0]
    slots[200] = slots[3]
    picks = kernels.paged_argmax(q, k_pool, slots)
    assert picks[0] == picks[1] == 3
    assert picks[2] == (-(k_pool[slots, 0] @ q[0])).argmax()


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("n_valid", [None, 250, 130, 5])  # 5 and 130: splits past the live keys see none
def test_paged_argmax_over_split_keys_keeps_the_first_of_equal_maxima(splits, n_valid):
    """The keys split among programs (as on a GPU, where a decode step's few rows would leave SMs idle): each row's
    pick equals the reference's, and a slot listed twice, in different splits (entries 3 and 200, blocks of 16), is
    picked at its first listing. Small integer keys and queries make every score exact."""
    gen = torch.Generator().manual_seed(splits * 1000 + (n_valid or 0))
    k_pool = torch.randint(-3, 4, (400, 2, 16), generator=gen).float().to(DEVICE)
    slots = torch.randperm(400, generator=gen)[:300].to(DEVICE)
    slots[200] = slots[3]
    q = torch.randint(-2, 3, (2 * 6, 16), generator=gen).float().to(DEVICE)
    q[0], q[6] = k_pool[slots[3], 0], k_pool[slots[3], 1]  # each kv head's first row: its own key scores highest
    live = None if n_valid is None else torch.tensor(n_valid, device=DEVICE)
    got = TRITON.paged_argmax(q, k_pool, slots, live, tile=(16, 16, 4, 2), splits=splits)
    assert torch.equal(got, TORCH.paged_argmax(q, k_pool, slots, live))
    if n_valid is None or n_valid > 3:
        assert got[0] == got[6] == 3


def raw_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp8 has no equality kernel in every build)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("row", [(8, 128), (2, 16), (3, 5), (1, 1)])  # word rows, and rows of odd byte counts
@pytest.mark.parametrize("n", [1, 17, 300])
def test_gather_and_scatter_rows_match_reference(n, row, dtype):
    """Fresh random rows and slots (gathers repeat slots; scatters never do), ragged n, every KV dtype."""
    gen = torch.Generator().manual_seed(n * 31 + row[1])
    pool = torch.randn(n + 40, *row, generator=gen).to(DEVICE, dtype)
    index = torch.randint(0, n + 40, (n,), generator=gen).to(DEVICE)
    assert raw_equal(gather_rows(pool, index), gather_rows_ref(pool, index))
    index = torch.randperm(n + 40, generator=gen)[:n].to(DEVICE)
    rows = torch.randn(n, *row, generator=gen).to(DEVICE, dtype)
    got, want = pool.clone(), pool.clone()
    scatter_rows([(rows, got)], index)
    scatter_rows_ref([(rows, want)], index)
    assert raw_equal(got, want) and raw_equal(got[index], rows)


@pytest.mark.parametrize("n_kv,d", [(8, 128), (2, 16), (1, 3)])  # word rows, and rows of odd byte counts
@pytest.mark.parametrize("n", [1, 19, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_scatter_rows_writes_kv_pools_in_one_launch(n, n_kv, d, dtype):
    """The KV cache's write: keys and values are slices of one q/k/v product's rows (strided rows), written to a
    layer of the K and V pools and, cast, to the selection keys' fp8 copy; fresh random rows and slots, ragged n.
    Every pool equals the reference's, bit for bit, and nothing outside the written slots changes."""
    gen = torch.Generator().manual_seed(n * 7 + n_kv * d)
    n_heads, slots = 4 * n_kv, n + 23
    qkv = torch.randn(n, (n_heads + 2 * n_kv) * d, generator=gen).to(DEVICE, dtype)
    k = qkv[:, n_heads * d:(n_heads + n_kv) * d].view(n, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].view(n, n_kv, d)
    index = torch.randperm(slots, generator=gen)[:n].to(DEVICE)
    pools = [torch.randn(3, slots, n_kv, d, generator=gen).to(DEVICE, t) for t in (dtype, dtype, torch.float8_e4m3fn)]
    for count in (1, 2, 3):
        pairs = [(k, 1), (v, 1), (k.to(torch.float8_e4m3fn), 1)][:count]
        got, want = [p.clone() for p in pools], [p.clone() for p in pools]
        scatter_rows([(rows, got[i][layer]) for i, (rows, layer) in enumerate(pairs)], index)
        scatter_rows_ref([(rows, want[i][layer]) for i, (rows, layer) in enumerate(pairs)], index)
        for i, (rows, layer) in enumerate(pairs):
            assert raw_equal(got[i], want[i])
            assert raw_equal(got[i][layer][index], rows.contiguous())
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[index.cpu()] = False
            assert raw_equal(got[i][layer][untouched.to(DEVICE)], pools[i][layer][untouched.to(DEVICE)])
            assert raw_equal(got[i][[0, 2]], pools[i][[0, 2]])  # the other layers
        for i in range(count, 3):
            assert raw_equal(got[i], pools[i])


@pytest.mark.parametrize("n, k", [(1, 1), (300, 7), (5000, 2048), (2000, 2000)])  # ragged, and every entry
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_gather_into_matches_reference(n, k, dtype):
    """The chosen entries of a strided 1-D source (the table's middle is a slice; a column is strided) land in a
    slice of a longer list and nowhere else; repeats and any order of the index are allowed."""
    gen = torch.Generator().manual_seed(n + k)
    table = torch.randint(-2 ** 31, 2 ** 31 - 1, (n + 90, 2), generator=gen).to(DEVICE, dtype)
    index = torch.randint(0, n, (k,), generator=gen).to(DEVICE)
    for src in (table[30:n + 30, 0], table[30:n + 30].flatten()[:n]):  # stride 2, and contiguous
        frame = torch.full((k + 9,), -7, device=DEVICE).to(dtype)
        out = frame[4:4 + k]
        assert TRITON.gather_into(src, index, out).data_ptr() == out.data_ptr()
        assert torch.equal(out, src[index]) and (frame[:4] == -7).all() and (frame[4 + k:] == -7).all()
        ref_out = torch.zeros_like(out)
        assert TORCH.gather_into(src, index, ref_out).data_ptr() == ref_out.data_ptr()
        assert torch.equal(ref_out, out)
    with pytest.raises(ValueError, match="int64"):
        TRITON.gather_into(src, index.int(), out)
    strided = torch.full((2 * k,), -7, device=DEVICE).to(dtype)  # an out read at its stride: every other entry
    TRITON.gather_into(src, index, strided[::2])
    assert torch.equal(strided[::2], src[index]) and (strided[1::2] == -7).all()
    for bad in (frame[:k - 1], frame[:k].double()):
        with pytest.raises(ValueError, match="gather_into needs"):
            TRITON.gather_into(src, index, bad)
    for bad_src, bad_index in ((table[:n], index), (src, index[:, None])):  # a 2-D source, a 2-D index
        with pytest.raises(ValueError, match="gather_into needs"):
            TRITON.gather_into(bad_src, bad_index, out)


def test_row_copy_of_a_layer_of_a_pool_and_bad_input():
    """A layer of a [layers, slots, *row] pool starts at an offset (odd in words for rows of 6 bytes); rows of
    another dtype or shape, and a pool whose rows are not adjacent, are refused instead of copied wrongly."""
    for row, dtype in (((2, 8), torch.bfloat16), ((3, 1), torch.bfloat16), ((1, 3), torch.float8_e4m3fn)):
        pools = torch.randn(3, 40, *row).to(DEVICE, dtype)
        index = torch.tensor([5, 0, 39, 5], device=DEVICE)
        assert raw_equal(gather_rows(pools[1], index), gather_rows_ref(pools[1], index))
        rows = torch.randn(3, *row).to(DEVICE, dtype)
        got, want = pools.clone(), pools.clone()
        scatter_rows([(rows, got[2])], index[:3])
        scatter_rows_ref([(rows, want[2])], index[:3])
        assert raw_equal(got, want)
    pool = torch.zeros(10, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        scatter_rows([(torch.zeros(2, 2, 8, device=DEVICE), pool)], slots)
    with pytest.raises(ValueError, match="1 to 3 pools"):
        scatter_rows([(torch.zeros(2, 2, 8, dtype=torch.bfloat16, device=DEVICE), pool)] * 4, slots)
    with pytest.raises(ValueError, match="int64"):
        scatter_rows([(torch.zeros(2, 2, 8, dtype=torch.bfloat16, device=DEVICE), pool)], slots.int())
    with pytest.raises(ValueError, match="3 rows"):  # one row more than slots: would be dropped
        scatter_rows([(torch.zeros(3, 2, 8, dtype=torch.bfloat16, device=DEVICE), pool)], slots)
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(torch.zeros(10, 2, 8, device=DEVICE)[:, 0], torch.tensor([1], device=DEVICE))


def test_row_copy_reference_is_the_definition():
    pool = torch.randn(10, 2, 3)
    index = torch.tensor([4, 0, 4, 9])
    torch.testing.assert_close(gather_rows_ref(pool, index), pool[index], atol=0, rtol=0)
    other = torch.zeros(8, 2, 3, dtype=torch.bfloat16)
    scatter_rows_ref([(torch.ones(2, 2, 3), pool), (torch.full((2, 2, 3), 2.0, dtype=torch.bfloat16), other)],
                     torch.tensor([1, 7]))
    assert (pool[[1, 7]] == 1).all() and (other[[1, 7]] == 2).all() and (other[[0, 2, 3, 4, 5, 6]] == 0).all()
    assert gather_rows(pool, torch.empty(0, dtype=torch.int64)).shape == (0, 2, 3)


# ---- selection kernels over a batch of sequences (a whole-step decode graph: one launch a layer for the batch) ----

def table_rows(batch: int, width: int, values: torch.Tensor, gen: torch.Generator, pad: int = 5) -> torch.Tensor:
    """[batch, width] as rows of a wider table (row stride width + pad, as a graph's slot table), drawn from
    values (a 1-D tensor)."""
    table = values[torch.randint(0, values.numel(), (batch, width + pad), generator=gen)]
    return table.to(DEVICE)[:, 2:2 + width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_selection_check_of_a_batch_is_each_sequence_alone(batch, dtype):
    """Each sequence's decision, candidates and count, from queries that are rows of the batch's q, k, v product and
    rows, live counts and candidates that are strided views (a graph's metadata), as it alone gets them."""
    from tokenselect.kernels.selection_check import selection_check, selection_check_ref

    gen = torch.Generator().manual_seed(batch)
    n, rows, layers, layer = 96, 10, 2, 1
    unit = torch.nn.functional.normalize(torch.randn(rows, layers, n, generator=gen), dim=-1).to(DEVICE)
    valid = (torch.rand(rows, layers, generator=gen) < 0.8).to(DEVICE)
    seq_rows = torch.randperm(rows, generator=gen)[:batch]
    near = unit[seq_rows.to(DEVICE), layer].cpu() + 0.6 * torch.randn(batch, n, generator=gen) / n ** 0.5
    product = torch.randn(batch, 3 * n, generator=gen)
    product[:, :n] = near
    q = product.to(DEVICE, dtype)[:, :n]  # rows 3n apart
    meta = torch.zeros(3, 2 * batch, dtype=torch.int64, device=DEVICE)
    meta[0, ::2] = seq_rows.to(DEVICE)
    meta[1, ::2] = torch.randint(1, 500, (batch,), generator=gen).to(DEVICE)
    row, live, candidates = meta[0, ::2], meta[1, ::2], meta[2, ::2]  # stride 2
    theta = 0.8
    counts = {name: torch.zeros(2, dtype=torch.int64, device=DEVICE) for name in ("batch", "alone", "ref")}
    got = selection_check(q, unit, valid, row, layer, theta, counts["batch"], live, candidates)
    alone = [selection_check(q[b], unit, valid, row[b], layer, theta, counts["alone"]) for b in range(batch)]
    want = selection_check_ref(q, unit, valid, row, layer, theta, counts["ref"])
    assert got.shape == (batch,) and got.dtype == torch.bool
    assert got.tolist() == [bool(m) for m in alone] == want.tolist()
    assert torch.equal(candidates, torch.where(got, live, 0)) and (meta[:, 1::2] == 0).all()
    assert counts["batch"].tolist() == counts["alone"].tolist() == counts["ref"].tolist() == \
        [batch - int(got.sum()), int(got.sum())]
    if batch == 8:
        assert 0 < int(got.sum()) < batch  # hits and misses in one launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_selection_update_of_a_batch_is_each_sequence_alone(batch, dtype):
    """Store-or-reuse for a batch of rows at once, misses and hits mixed: the tables and each entry (written into
    rows of a wider frame, as a graph's attended lists) as the reference's, sequence by sequence; the other rows,
    layers and the frame's other entries untouched."""
    from tokenselect.kernels.selection_update import selection_update, selection_update_ref

    gen = torch.Generator().manual_seed(10 + batch)
    n, width, rows, layers, layer = 80, 1100, 9, 2, 0
    unit = torch.nn.functional.normalize(torch.randn(rows, layers, n, generator=gen), dim=-1).to(DEVICE)
    selection = torch.randint(0, 1 << 40, (rows, layers, width), generator=gen).to(DEVICE)
    valid = (torch.rand(rows, layers, generator=gen) < 0.5).to(DEVICE)
    tables = {name: (unit.clone(), selection.clone(), valid.clone()) for name in ("triton", "torch")}
    row = torch.randperm(rows, generator=gen)[:batch].to(DEVICE)
    q = (torch.randn(batch, 2 * n, generator=gen) * 3).to(DEVICE, dtype)[:, n:]
    new = torch.randint(0, 1 << 40, (batch, width), generator=gen).to(DEVICE)
    miss = (torch.arange(batch) % 3 != 1).to(DEVICE)
    frames = {name: torch.full((batch, width + 7), -1, dtype=torch.int64, device=DEVICE) for name in tables}
    got = selection_update(q, *tables["triton"], row, layer, new, miss, frames["triton"][:, 3:3 + width])
    want = selection_update_ref(q, *tables["torch"], row, layer, new, miss, frames["torch"][:, 3:3 + width])
    assert got.data_ptr() == frames["triton"][0, 3:].data_ptr() and torch.equal(got, want)
    assert torch.equal(frames["triton"], frames["torch"]) and (frames["torch"][:, :3] == -1).all()
    for b in range(batch):
        r = int(row[b])
        assert torch.equal(want[b], new[b] if bool(miss[b]) else selection[r, layer])
    torch.testing.assert_close(tables["triton"][0], tables["torch"][0], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(tables["triton"][1:], tables["torch"][1:]))
    untouched = torch.ones(rows, layers, dtype=torch.bool)
    untouched[row[miss].cpu(), layer] = False
    for t, before in zip(tables["torch"], (unit, selection, valid)):
        assert torch.equal(t[untouched.to(DEVICE)], before[untouched.to(DEVICE)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_head_soft_vote_of_a_batch_is_each_sequence_alone(batch, group, dtype):
    """Queries [B, H, d] over slot lists that are rows of a wider table, each with its own live prefix (ragged,
    none and all among them): every sequence's vote is the one it gets alone (the same kernels: bit for bit) and
    the reference's; one shared list (``[N]``) votes as the rows would (folded into one tile: to rounding)."""
    gen = torch.Generator().manual_seed(batch * 10 + group)
    n, n_slots = 700, 2000
    q, k_pool = query((batch, N_KV * group, 128), dtype, gen), pool(n_slots, 128, dtype, gen)
    slots = table_rows(batch, n, torch.arange(n_slots), gen)
    live = torch.tensor([n, 0, 311, 129][:batch], device=DEVICE)
    got = TRITON.head_soft_vote(q, k_pool, slots, 0.125, live)
    assert got.shape == (batch, n)
    for b in range(batch):
        alone = TRITON.head_soft_vote(q[b], k_pool, slots[b], 0.125, live[b])
        assert torch.equal(got[b], alone)
        torch.testing.assert_close(got[b], TORCH.head_soft_vote(q[b], k_pool, slots[b], 0.125, live[b]),
                                   atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(TORCH.head_soft_vote(q, k_pool, slots, 0.125, live), got, atol=1e-5, rtol=1e-4)
    shared = TRITON.head_soft_vote(q, k_pool, slots[0], 0.125)
    for b in range(batch):
        alone = TRITON.head_soft_vote(q[b], k_pool, slots[0], 0.125)
        torch.testing.assert_close(shared[b], alone, atol=1e-6, rtol=1e-5)  # measured 2e-7 (votes up to 0.3)


@pytest.mark.parametrize("live", [None, 700, 641])
def test_the_vote_ignores_what_the_scores_padding_holds(monkeypatch, live):
    """The scores' rows are padded to whole blocks and the padding is never written (writing it cost the kernel
    registers and a program an SM): buffers that start as NaN give the same votes as the reference, for a list that
    ends inside a block, all live or up to a live count inside the last block."""
    class NaNFilled:  # torch, whose empty tensors hold NaN
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, dtype=None, device=None):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

        @staticmethod
        def empty_like(t):
            return torch.full_like(t, float("nan"))

    monkeypatch.setattr(paged_dot_module, "torch", NaNFilled())
    gen = torch.Generator().manual_seed(7)
    n = 700  # not a multiple of any block size
    q, k_pool = query((N_KV * 4, 128), torch.bfloat16, gen), pool(n + 50, 128, torch.bfloat16, gen)
    slots = slot_list(n, n + 50, gen)
    n_valid = None if live is None else torch.tensor(live, device=DEVICE)
    got = TRITON.head_soft_vote(q, k_pool, slots, 0.125, n_valid)
    scores, _, _ = scores_with_stats(q, k_pool, slots, 0.125, stats=True)
    assert scores.as_strided((scores.shape[0], scores.stride(0)), scores.stride())[:, n:].isnan().all()  # padding
    want = TORCH.head_soft_vote(q, k_pool, slots, 0.125, n_valid)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 4 to 64 folded rows: tiles of one, two (28 rows: Qwen2.5's 7 heads a kv head in 4 groups) and four warps
@pytest.mark.parametrize("n_kv, group, batch", [(4, 1, 4), (2, 4, 4), (2, 4, 3), (1, 8, 4), (2, 7, 4), (2, 16, 4)])
def test_scores_of_a_batch_over_one_slot_list_read_it_once(monkeypatch, dtype, n_kv, group, batch):
    """A batch of queries over one slot list (stride-0 rows: a prefill chunk's groups of queries) runs as one program
    row whose tile holds every sequence's query group; its scores and vote equal each sequence's alone, each with
    its own live count (0, a partial block, every slot)."""
    torch.manual_seed(0)
    n_heads, d, n = n_kv * group, 32, 333
    pool = torch.randn(600, n_kv, d).to(DEVICE, dtype)
    slots = torch.randperm(600)[:n].to(DEVICE)
    q = torch.randn(batch, n_heads, d).to(DEVICE, dtype)
    live = torch.tensor([100, n, 0, 257][:batch], device=DEVICE)
    launches = []  # (grid, folded, the count folded: a runtime argument, so no count compiles a kernel of its own)
    kernel = paged_dot_module._scores_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["FOLDED"], args[kernel.arg_names.index("fold")]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(paged_dot_module, "_scores_kernel", Recording())
    shared = slots.as_strided((batch, n), (0, 1))
    vote = get_kernels("triton").head_soft_vote(q, pool, shared, 0.3, live)
    assert launches[-1][1:] == (True, batch) and launches[-1][0][1] == 1
    want = head_soft_vote_ref(q, pool, slots, 0.3, live)
    assert torch.equal(torch.isfinite(vote), torch.isfinite(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(vote[finite], want[finite], rtol=0, atol=1e-5)  # measured 1.5e-7
    scores, m, l = scores_with_stats(q, pool, shared, 1.0, stats=True)
    assert scores.shape[-1] == n and scores.stride(-2) == m.shape[-1] * scores_block(q[0], pool)  # padded rows
    for b in range(batch):
        torch.testing.assert_close(scores[b], paged_dot_ref(q[b], pool, slots), rtol=0, atol=2e-5)  # measured 5e-6
        full = scores[b].view(n_heads, -1)
        block = scores_block(q[b], pool)
        first = full[:, :block]
        torch.testing.assert_close(m[b, :, 0], first.max(dim=1).values)
        torch.testing.assert_close(l[b, :, 0], (first - m[b, :, 0, None]).exp().sum(dim=1), rtol=1e-5, atol=1e-5)
    # distinct lists, or more rows than a tile holds, run a program row a sequence
    scores_with_stats(q, pool, torch.stack([slots.flip(0)] + [slots] * (batch - 1)), 1.0, stats=False)
    assert launches[-1][1:] == (False, 1) and launches[-1][0][1] == batch
    many = torch.randn(MAX_GROUP_ROWS // group + 1, n_heads, d).to(DEVICE, dtype)
    scores_with_stats(many, pool, slots, 1.0, stats=False)
    assert launches[-1][1:] == (False, 1) and launches[-1][0][1] == many.shape[0]


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_topk_of_a_batch_is_each_sequence_alone(batch):
    """Rows of scores (ties among them: repeated values), each with its own live prefix (none, fewer than k, all),
    their picks gathered from rows of a slot table into rows of a wider frame: each row's picks are the
    reference's for that row alone; nothing is written outside the rows' picks."""
    gen = torch.Generator().manual_seed(batch)
    n, k = 3000, 700
    scores = (torch.randint(0, 900, (batch, n + 11), generator=gen).float() / 7).to(DEVICE)[:, 5:5 + n]
    slots = table_rows(batch, n, torch.randperm(10 ** 6, generator=gen), gen)
    live = torch.tensor([2900, 0, 500, 3000, 701, 1][:batch], device=DEVICE)
    for values in (None, slots):
        frame = torch.full((batch, k + 9), -1, dtype=torch.int64, device=DEVICE)
        got = TRITON.topk(scores, k, live, values, frame[:, 4:4 + k])
        want = TORCH.topk(scores, k, live, values)
        assert got.shape == want.shape == (batch, k) and torch.equal(got, want)
        assert (frame[:, :4] == -1).all() and (frame[:, 4 + k:] == -1).all()
        for b in range(batch):
            assert torch.equal(want[b], TORCH.topk(scores[b], k, live[b], None if values is None else values[b]))
    plain = TRITON.topk(scores, k)
    for b in range(batch):
        assert torch.equal(plain[b], TRITON.topk(scores[b], k))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("batch", [1, 5])
def test_gather_into_of_a_batch_gathers_each_row_from_its_own(batch, dtype):
    """out[b] = src[b][index[b]], src and out rows of wider tables (a graph's slot table and attended lists)."""
    gen = torch.Generator().manual_seed(batch)
    n, k = 900, 300
    src = table_rows(batch, n, torch.randint(-2 ** 31, 2 ** 31 - 1, (5000,), generator=gen), gen).to(dtype)
    index = torch.randint(0, n, (batch, k), generator=gen).to(DEVICE)
    frame = torch.full((batch, k + 10), -7, dtype=dtype, device=DEVICE)
    out = frame[:, 6:6 + k]
    assert TRITON.gather_into(src, index, out).data_ptr() == out.data_ptr()
    assert (frame[:, :6] == -7).all() and (frame[:, 6 + k:] == -7).all()
    want = torch.zeros(batch, k, dtype=dtype, device=DEVICE)
    TORCH.gather_into(src, index, want)
    assert torch.equal(out, want)
    for b in range(batch):
        assert torch.equal(out[b], src[b][index[b]])
