"""Value offload (``kv_offload="values"``): the V pool in host memory, only K on the device.

On a machine without a GPU the "offloaded" pool is a second CPU tensor, but every step of the
offload path runs: new values are written to that pool, and attention reads K and V rows staged
for its slot list (``KVCache.stage``) instead of the pools. On a GPU the host pool is mapped for the
GPU, whose kernels write and gather its rows.
"""

from __future__ import annotations

import argparse
import json
import re
from types import SimpleNamespace

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect import cuda_graphs, engine, kv_cache
from tokenselect.bench import e2e
from tokenselect.kernels.row_copy import (Kept, gather_rows_ref, scatter_rows, scatter_rows_ref, stage_rows,
                                         stage_rows_ref)
from tokenselect.kv_cache import HostMemoryError, KVCache
from tokenselect.policies import add_policy_args, policy_kwargs

from checkpoints import distinct_tokens, small_sizes

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CPU = torch.device("cpu")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def count_stages(monkeypatch, cache: KVCache) -> list[int]:
    """Wrap ``cache.stage``; the returned list gets the slot count of every call."""
    calls, stage = [], cache.stage

    def counted(layer, slots):
        calls.append(slots.numel())
        return stage(layer, slots)

    monkeypatch.setattr(cache, "stage", counted)
    return calls


@pytest.mark.parametrize("attention", ["full", "tokenselect", "streaming", "infllm"])
def test_offloaded_values_give_the_same_tokens_and_logits(tiny_llama, monkeypatch, attention):
    """400 tokens are past the point where every sparse policy of this window-256 model selects. Every step runs
    eagerly (a replayed whole-step graph stages without calling ``stage``; the test below covers the graphs). The
    plain engine scores the pool's keys, as an offloading one does by default (``selection_keys_dtype``)."""
    ids = prompt(400, 1)
    plain = LLM(tiny_llama, attention, chunk_size=32, select_dtype="kv")
    offload = LLM(tiny_llama, attention, chunk_size=32, kv_offload="values", cuda_graphs=False)
    staged = count_stages(monkeypatch, offload.cache)
    assert offload.generate([ids], GREEDY)[0].token_ids == plain.generate([ids], GREEDY)[0].token_ids
    assert len(staged) == 2 * (400 // 32 + 1 + 11)  # 2 layers x (13 prefill chunks + 11 decode steps)
    torch.testing.assert_close(offload.prompt_logits(ids), plain.prompt_logits(ids), atol=0, rtol=0)


def test_offload_with_fp8_pools_matches_fp8_on_the_device(tiny_llama):
    ids = prompt(300, 2)
    plain = LLM(tiny_llama, "tokenselect", chunk_size=32, kv_dtype="fp8")
    offload = LLM(tiny_llama, "tokenselect", chunk_size=32, kv_dtype="fp8", kv_offload="values")
    assert offload.cache.v.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(offload.prompt_logits(ids), plain.prompt_logits(ids), atol=0, rtol=0)


def test_value_pool_lives_where_the_setting_says(tiny_llama):
    plain, offload = LLM(tiny_llama, kv_cache_tokens=512), LLM(tiny_llama, kv_cache_tokens=512, kv_offload="values")
    assert plain.cache.offload == "none" and plain.cache.v.device == plain.cache.k.device == plain.device
    assert offload.cache.offload == "values" and offload.cache.k.device == offload.device
    assert offload.cache.v.device == CPU and offload.cache.v.shape == plain.cache.v.shape
    assert offload.cache.v.data_ptr() != offload.cache.k.data_ptr()
    if offload.device.type == "cuda":
        assert offload.cache.v.is_pinned()


def test_a_bad_setting_is_a_clear_value_error(tiny_llama):
    with pytest.raises(ValueError, match="kv_offload must be one of none, values, not 'keys'"):
        LLM(tiny_llama, kv_offload="keys")
    # the pool's own check (the engine's settings refuse it first), for code that builds a pool itself
    with pytest.raises(ValueError, match="^kv_offload must be one of none, values, not 'keys'$"):
        KVCache(1, 8, 1, 4, torch.float32, CPU, offload="keys")


def test_freeing_and_aborting_return_every_slot(tiny_llama):
    ids = prompt(300, 3)
    expected = LLM(tiny_llama, "tokenselect", chunk_size=32, select_dtype="kv").generate([ids], GREEDY)[0].token_ids
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, kv_offload="values")
    seq = llm.add_request(prompt(250, 4), GREEDY)
    for _ in range(3):
        llm.step()
    assert llm.scheduler.available == llm.cache.n_slots - 96
    llm.abort(seq)
    assert seq.finish_reason == "abort" and llm.scheduler.available == llm.cache.n_slots and not llm.scheduler.has_work()
    # the aborted sequence's slots are handed out again: their host values are overwritten, not reused
    assert llm.generate([ids], GREEDY)[0].token_ids == expected
    assert llm.scheduler.available == llm.cache.n_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_stage_gathers_the_key_and_value_rows_of_a_slot_list(dtype):
    cache = KVCache(2, 16, 2, 8, dtype, CPU, offload="values")
    slots = cache.allocate(10)
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cache.write(1, slots, k, v)
    order = torch.tensor([7, 2, 2, 9])
    k_rows, v_rows = cache.stage(1, slots[order])
    assert k_rows.dtype == v_rows.dtype == dtype and k_rows.shape == v_rows.shape == (4, 2, 8)
    torch.testing.assert_close(k_rows.float(), k[order].to(dtype).float(), atol=0, rtol=0)
    torch.testing.assert_close(v_rows.float(), v[order].to(dtype).float(), atol=0, rtol=0)
    k_pool, v_pool, at = cache.attention_pools(1, slots[order])
    assert torch.equal(at, torch.arange(4)) and torch.equal(v_pool.float(), v_rows.float())
    assert cache.attention_pools(1, slots)[1].shape == (10, 2, 8)


def test_written_values_are_in_the_host_pool_at_once():
    cache = KVCache(2, 16, 2, 8, torch.float32, CPU, offload="values")
    slots = cache.allocate(4)
    v0, v1 = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    cache.write(0, slots, torch.randn(4, 2, 8), v0)
    cache.write(1, slots, torch.randn(4, 2, 8), v1)
    torch.testing.assert_close(cache.v[0, slots], v0, atol=0, rtol=0)
    torch.testing.assert_close(cache.v[1, slots], v1, atol=0, rtol=0)


def host_pool(rows: torch.Tensor) -> torch.Tensor:
    """rows as a V pool in host memory: on a GPU, page-locked and mapped for it (as ``KVCache`` makes it)."""
    if DEVICE == "cpu":
        return rows
    pool = kv_cache.pinned_empty(rows.shape, rows.dtype)
    pool.copy_(rows)
    return pool


@pytest.mark.parametrize("stage", [stage_rows, stage_rows_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype,row", [(torch.float32, (2, 8)), (torch.bfloat16, (8, 16)),
                                       (torch.float8_e4m3fn, (3, 5))])
def test_staged_rows_are_kept_on_the_device_and_copied_from_there(stage, dtype, row):
    """Three stagings of one layer (a repeated slot, more rows than are kept, slots in and out of the kept ones): each
    returns pool[index]; the rows kept are the first R staged, found again by slot (counted), and read from the
    device, not the pool: a pool row changed behind the kept copy comes back as kept until its slot is forgotten
    (``row_of`` set to -1, as ``KVCache.write`` has it done)."""
    gen = torch.Generator().manual_seed(3)
    host = host_pool(torch.randn(40, *row, generator=gen).to(dtype))
    state = Kept.empty(6, host, DEVICE)
    first = torch.tensor([5, 9, 9, 30, 2, 17, 11, 3], device=DEVICE)  # 8 rows, 6 kept; 9 twice
    assert torch.equal(stage(host, first, state).view(torch.uint8).cpu(), host[first.cpu()].view(torch.uint8))
    assert state.slot.tolist() == first[:6].tolist() and state.counts.tolist() == [8, 0]
    assert all(first[state.row_of[s]].item() == s for s in first[:6].tolist())
    assert (state.row_of[[11, 3, 0]] == -1).all()
    second = torch.tensor([17, 11, 30, 0, 5, 9], device=DEVICE)  # 17, 30, 5, 9 kept; 11 past the kept rows; 0 new
    assert torch.equal(stage(host, second, state).view(torch.uint8).cpu(), host[second.cpu()].view(torch.uint8))
    assert state.counts.tolist() == [14, 4] and state.slot.tolist() == second.tolist()
    before = host.clone()
    host[[17, 0, 40 - 1]] = torch.randn(3, *row, generator=gen).to(dtype)  # behind the kept rows of 17 and 0
    state.row_of[0] = -1  # 0 written (``scatter_rows`` forgets it): its new row must be fetched
    third = torch.tensor([0, 17, 39], device=DEVICE)
    got = stage(host, third, state).view(torch.uint8).cpu()
    assert torch.equal(got[0], host[0].view(torch.uint8)) and torch.equal(got[2], host[39].view(torch.uint8))
    assert torch.equal(got[1], before[17].view(torch.uint8))  # found kept: the pool was not read
    assert state.counts.tolist() == [17, 5] and state.slot.tolist()[:3] == [0, 17, 39]


@pytest.mark.parametrize("stage", [stage_rows, stage_rows_ref], ids=["triton", "torch"])
def test_staging_with_no_rows_to_keep_fetches_every_row(stage):
    host = host_pool(torch.randn(30, 2, 4, generator=torch.Generator().manual_seed(1)))
    state = Kept.empty(0, host, DEVICE)
    index = torch.tensor([3, 7, 3], device=DEVICE)
    for _ in range(2):
        assert torch.equal(stage(host, index, state).cpu(), host[index.cpu()])
    assert state.counts.tolist() == [6, 0] and (state.row_of == -1).all()


def test_the_kept_rows_kernels_keep_what_the_reference_keeps():
    """Random stagings of random slot lists (lengths past the rows kept): the Triton kernels' outputs and kept state
    equal the reference's after every call."""
    gen = torch.Generator().manual_seed(4)
    host = host_pool(torch.randn(300, 2, 8, generator=gen).to(torch.bfloat16))
    states = Kept.empty(64, host, DEVICE), Kept.empty(64, host, DEVICE)
    written = 0  # kept rows written so far (the others are uninitialised memory)
    for n in (50, 30, 64, 90, 1, 77):
        index = torch.randperm(120, generator=gen)[:n].to(DEVICE)  # distinct (a repeat's row_of is either row)
        outs = [stage(host, index, state) for stage, state in zip((stage_rows, stage_rows_ref), states)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0].cpu(), host[index.cpu()])
        written = max(written, min(n, 64))
        assert torch.equal(states[0].rows[:written], states[1].rows[:written])
        assert torch.equal(states[0].slot, states[1].slot) and torch.equal(states[0].counts, states[1].counts)
        assert kept_at(states[0]) == kept_at(states[1])
    assert states[0].counts[1] > 0


def kept_at(state: Kept) -> dict[int, int]:
    """{slot: the kept row its row_of entry names} for the entries that name a row holding that slot."""
    rows = state.row_of.tolist()
    slots = state.slot.tolist()
    return {s: j for s, j in enumerate(rows) if j >= 0 and slots[j] == s}


def test_a_written_slot_is_not_found_kept():
    """A staged slot freed, staged again while free (a graph's padded list may name it), handed out again and written:
    the next staging returns its new values; the write forgot it in the layer it wrote, not in the other."""
    cache = KVCache(2, 16, 2, 8, torch.float32, CPU, offload="values", kept_rows=8)
    slots = cache.allocate(6)
    for layer in (0, 1):
        cache.write(layer, slots, torch.randn(6, 2, 8), torch.randn(6, 2, 8))
        cache.stage(layer, slots)
    assert cache.kept_counts() == (12, 0)
    cache.stage(1, slots[:3])
    assert cache.kept_counts() == (15, 3)
    cache.free(slots[3:])
    cache.stage(1, slots)  # the freed ones too, kept again
    assert cache.kept_counts() == (21, 9)
    again = cache.allocate(3)
    assert set(again.tolist()) == set(slots[3:].tolist())
    new_values = torch.randn(3, 2, 8)
    cache.write(1, again, torch.randn(3, 2, 8), new_values)
    assert (cache.kept[1].row_of[again] == -1).all() and (cache.kept[0].row_of[again] >= 0).all()
    _, v = cache.stage(1, again)
    torch.testing.assert_close(v, new_values, atol=0, rtol=0)
    assert cache.kept_counts() == (24, 9)


@pytest.mark.parametrize("select_dtype", [None, torch.bfloat16])
def test_rows_put_back_are_staged_as_put_back_not_as_kept_since(select_dtype):
    """A step's writes undone (a whole-step graph that failed its check wrote other values for the step's slots, and
    its staging kept copies of them): ``put_rows`` restores every pool's bytes in every layer, the selection keys'
    copy too, and the next staging returns the restored values, not the copies kept after the writes it undid (one
    of them kept at row 1: no row, not any other, may be left for it)."""
    cache = KVCache(2, 16, 2, 8, torch.float32, CPU, offload="values", select_dtype=select_dtype, kept_rows=8)
    slots = cache.allocate(5)
    old = [(torch.randn(5, 2, 8), torch.randn(5, 2, 8)) for _ in (0, 1)]
    for layer, (k, v) in enumerate(old):
        cache.write(layer, slots, k, v)
    back = slots[[1, 3, 4]]
    saved = cache.rows(back)
    assert len(saved) == (3 if select_dtype else 2) and saved[0].shape == (2, 3, 2, 8 * 4)
    for layer in (0, 1):  # the undone step: other values at those slots, staged (and kept) after
        cache.write(layer, back, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
        cache.stage(layer, slots)
    assert (cache.kept[1].row_of[slots] == torch.arange(5, dtype=torch.int32)).all()
    cache.put_rows(back, saved)
    for layer, (k, v) in enumerate(old):
        got_k, got_v = cache.stage(layer, slots)
        torch.testing.assert_close(got_k, k, atol=0, rtol=0)
        torch.testing.assert_close(got_v, v, atol=0, rtol=0)
        if select_dtype:
            torch.testing.assert_close(cache.k_select[layer, slots], k.to(select_dtype), atol=0, rtol=0)
    assert cache.kept_counts() == (20, 4)  # the two slots not put back were found kept, in both layers


@pytest.mark.parametrize("scatter", [scatter_rows, scatter_rows_ref], ids=["triton", "torch"])
def test_writing_rows_forgets_their_slots_kept_rows(scatter):
    """``scatter_rows`` with ``forget`` sets it to -1 at the written slots, and only there (one launch: every pair
    written too)."""
    pools = [torch.zeros(12, 2, 4, device=DEVICE), torch.zeros(12, 2, 4, device=DEVICE)]
    rows = [torch.randn(3, 2, 4, device=DEVICE) for _ in pools]
    forget = torch.arange(12, dtype=torch.int32, device=DEVICE)
    index = torch.tensor([7, 2, 10], device=DEVICE)
    scatter(list(zip(rows, pools)), index, forget)
    assert forget.tolist() == [-1 if i in (7, 2, 10) else i for i in range(12)]
    assert all(torch.equal(pool[index], r) for pool, r in zip(pools, rows))


def test_decode_steps_find_most_of_their_values_kept(tiny_llama):
    """A TokenSelect decode over offloaded values: most rows a step stages were kept from the step before (its sinks
    and window at least), and the tokens are the plain path's."""
    ids = prompt(300, 5)
    plain = LLM(tiny_llama, "tokenselect", chunk_size=32, select_dtype="kv").generate([ids], GREEDY)[0].token_ids
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, kv_offload="values")
    prefill = llm.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while llm.scheduler.has_work():
        llm.step()
    staged_prefill, found_prefill = llm.cache.kept_counts()
    assert prefill.finish_reason is not None
    assert llm.generate([ids], GREEDY)[0].token_ids == plain
    staged, found = llm.cache.kept_counts()
    assert found - found_prefill > 0.5 * (staged - staged_prefill)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs host memory mapped for a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_gpu_writes_and_gathers_the_host_value_pool_in_place(dtype):
    """The V pool is page-locked host memory that the GPU's kernels write and read over the bus."""
    cuda = torch.device("cuda")
    cache = KVCache(2, 4096, 8, 128, dtype, cuda, offload="values")
    assert cache.v.device == CPU and cache.v.is_pinned()
    slots = cache.allocate(300)[torch.randperm(300, device=cuda)]
    v = torch.randn(300, 8, 128, device=cuda)
    cache.write(1, slots, torch.randn(300, 8, 128, device=cuda), v)
    torch.cuda.synchronize()
    torch.testing.assert_close(gather_rows_ref(cache.v[1], slots.cpu()).float(), v.to(dtype).float().cpu(), atol=0,
                               rtol=0)
    order = torch.randint(0, 300, (1000,), device=cuda)
    k_rows, v_rows = cache.stage(1, slots[order])
    assert v_rows.device.type == "cuda"
    torch.testing.assert_close(v_rows.float(), v[order].to(dtype).float(), atol=0, rtol=0)


@pytest.mark.parametrize("attention", ["tokenselect", "streaming"])
def test_offloaded_steps_run_as_whole_graphs_with_the_plain_paths_tokens(tiny_llama, monkeypatch, attention):
    """With the values on the host, a long prompt's chunks and the decode steps still run whole (on a GPU
    as CUDA graphs that gather the values themselves), with the tokens and logits of the plain path."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    ids = distinct_tokens(300, 5)  # the graph's padded span must not break ties another way
    sizes = small_sizes(attention)
    plain = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=False, select_dtype="kv", **sizes)  # offload's keys
    graphed = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=True, kv_offload="values", **sizes)
    assert graphed.generate([ids], GREEDY)[0].token_ids == plain.generate([ids], GREEDY)[0].token_ids
    assert graphed.runner.graphs.failure is None
    assert {key[0] for key in graphed.runner.graphs.whole_keys()} == {"prefill", "decode"}  # prefill and decode graphs
    torch.testing.assert_close(graphed.prompt_logits(ids), plain.prompt_logits(ids), atol=1e-4, rtol=1e-4)


def test_an_offloaded_batch_decodes_through_one_graph_with_the_plain_paths_tokens(tiny_llama):
    """Three sequences decoding together with their values on the host: one attention launch for the batch
    (``attention.attend_batch``) reads the rows staged for all three lists at once, in their order."""
    sizes = small_sizes("tokenselect")
    prompts = [distinct_tokens(120 + 10 * i, 20 + i) for i in range(3)]
    plain = LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=False, select_dtype="kv", **sizes)
    graphed = LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=True, kv_offload="values", **sizes)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in graphed.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert graphed.runner.graphs.failure is None
    assert 3 in [key[1] for key in graphed.runner.graphs.whole_keys() if key[0] == "decode"]


def test_full_attention_with_offloaded_values_runs_eagerly(tiny_llama, monkeypatch):
    """A full-attention graph would stage its table's whole capacity from the host every step: with the
    values offloaded, full attention's steps run eagerly (and give the plain path's tokens); on the device
    they run whole."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    ids = distinct_tokens(200, 6)
    on_device = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True)
    offloaded = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True, kv_offload="values")
    assert offloaded.generate([ids], GREEDY)[0].token_ids == on_device.generate([ids], GREEDY)[0].token_ids
    assert offloaded.runner.graphs.whole_steps == 0 and on_device.runner.graphs.whole_steps > 0


def test_a_value_pool_larger_than_host_memory_is_refused_up_front(tiny_llama, monkeypatch):
    monkeypatch.setattr(kv_cache, "host_memory_available", lambda: 100 << 20)
    with pytest.raises(HostMemoryError, match="needs 1.0 GiB of host memory for 1048576 tokens, but 0.1 GiB "
                                              "is available: lower kv_cache_tokens"):
        KVCache(1, 1 << 20, 4, 128, torch.bfloat16, CPU, offload="values")
    with pytest.raises(ValueError, match="offloaded V pool needs"):  # what the CLI prints as one line
        LLM(tiny_llama, kv_cache_tokens=1 << 20, kv_offload="values")
    KVCache(1, 1 << 20, 4, 128, torch.bfloat16, CPU)  # nothing to check without offload


@pytest.mark.product_pool
def test_default_pool_counts_only_keys_against_gpu_memory_with_offload(monkeypatch):
    """Llama-3-8B shape, fp8: 32 KiB of K (and as much V) per token; an fp8 pool is its own selection keys."""
    gpu = SimpleNamespace(config=SimpleNamespace(n_layers=32, n_kv_heads=8, head_dim=128),
                          kv_dtype=torch.float8_e4m3fn, select_dtype=torch.float8_e4m3fn, device=torch.device("cuda"))
    per_pool = 32 * 8 * 128
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 << 30, 80 << 30))
    monkeypatch.setattr(engine, "host_memory_available", lambda: 1 << 40)
    on_gpu = int((40 << 30) * engine.GPU_MEMORY_FRACTION)
    assert LLM._default_pool_tokens(gpu, "none") == on_gpu // (2 * per_pool)
    kept_index = 32 * 4  # where each layer last kept the token's values on the device (int32)
    assert LLM._default_pool_tokens(gpu, "values") == on_gpu // (per_pool + kept_index)
    monkeypatch.setattr(engine, "host_memory_available", lambda: 16 << 30)  # now the host is the limit
    assert LLM._default_pool_tokens(gpu, "values") == int((16 << 30) * engine.HOST_MEMORY_FRACTION) // per_pool


@pytest.mark.product_pool
def test_default_pool_counts_the_fp8_selection_keys_on_the_gpu(monkeypatch):
    """bf16 K and V (64 KiB a token each) and an fp8 copy of the keys (32 KiB) on the GPU; with value offload the
    host holds V alone."""
    gpu = SimpleNamespace(config=SimpleNamespace(n_layers=32, n_kv_heads=8, head_dim=128),
                          kv_dtype=torch.bfloat16, select_dtype=torch.float8_e4m3fn, device=torch.device("cuda"))
    per_pool, copy = 2 * 32 * 8 * 128, 32 * 8 * 128
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 << 30, 80 << 30))
    monkeypatch.setattr(engine, "host_memory_available", lambda: 1 << 40)
    on_gpu = int((40 << 30) * engine.GPU_MEMORY_FRACTION)
    assert LLM._default_pool_tokens(gpu, "none") == on_gpu // (2 * per_pool + copy)
    assert LLM._default_pool_tokens(gpu, "values") == on_gpu // (per_pool + copy + 32 * 4)


def test_kv_offload_flag_reaches_the_engine_settings():
    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    assert policy_kwargs(parser.parse_args(["--kv-offload", "values"]))["kv_offload"] == "values"
    assert "kv_offload" not in policy_kwargs(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offload", "keys"])


def test_bench_e2e_with_offload_measures_sparse_policies_and_skips_full(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "FULL_OFFLOAD_BYTES", 0)  # full attention's host copies always count as too many
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--lengths", "1k", "--policies", "full,tokenselect",
                              "--decode-steps", "2", "--kv-offload", "values", "--profile-steps", "1",
                              "--kernels", "torch", "--device", "cpu", "--output", str(tmp_path), "--tag", "t"])
    assert args.func(args) == 0
    result = json.loads((tmp_path / "e2e_t.json").read_text())
    full, sparse = result["rows"]
    assert result["kv_offload"] == "values" and full["error"].startswith("skipped: would copy")
    assert sparse["policy"] == "tokenselect" and sparse["prefill_s"] > 0 and sparse["decode_ms"] > 0
    assert 0 < sparse["values_kept"] <= 1 and "values_kept" not in full
    report = (tmp_path / "e2e_t.md").read_text()
    assert "KV offload values" in report
    assert f"1K tokenselect: {sparse['values_kept']:.0%} of the values its decode steps staged were found" in report
    assert re.search(r"\bkv_cache\.stage\b", (tmp_path / "e2e_t_profile.txt").read_text())  # the label, whole
