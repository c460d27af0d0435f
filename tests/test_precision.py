"""References that cannot agree by accident.

A fresh KV pool hands out slots 0, 1, 2, ... in order, so slot == position for the first prompt, and an
attention that rotated keys by their slot instead of their position would still match transformers. Here the
pool is scrambled first (slots taken at random, some held by nobody), so slot != position everywhere. And an
fp8 pool is compared with the exact thing it should equal (fp32 attention over keys and values rounded to fp8),
not with a loose bound around fp32.
"""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kv_cache import KVCache


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scramble(llm: LLM, held: int = 37, seed: int = 0) -> None:
    """Free slots in a random order, and ``held`` of them taken for good: no sequence gets slot == position."""
    cache = llm.cache
    top = cache.num_free
    order = torch.randperm(top, generator=torch.Generator().manual_seed(seed))
    cache._stack[:top] = cache._stack[:top][order.to(cache._stack.device)]
    cache.allocate(held)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_match_transformers_when_slots_are_not_positions(checkpoint_factory, family):
    path = checkpoint_factory(family)
    ids = prompt(100, 1)
    llm = LLM(path, chunk_size=32, device="cpu", kv_cache_tokens=512)
    scramble(llm)
    top = llm.cache.num_free  # the slots the prompt will get: the top of the free stack
    taken = llm.cache._stack[top - len(ids):top].flip(0).cpu()
    assert (taken != torch.arange(len(ids))).float().mean() > 0.9  # the point of the test
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    # measured max |ours - ref| 1.7e-6 (llama) and 1.5e-6 (qwen3), logits up to 3.0 (fp32, CPU)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


def test_greedy_decoding_matches_transformers_when_slots_are_not_positions(checkpoint_factory):
    """Prefill chunks and then decode steps, each token's slot taken from a scrambled pool."""
    path = checkpoint_factory("llama")
    ids = prompt(70, 3)
    llm = LLM(path, chunk_size=32, device="cpu", kv_cache_tokens=512)
    scramble(llm, seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
    ref = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    assert out == ref and len(ref) == 24


def test_an_fp8_pool_is_fp32_attention_over_fp8_rounded_keys_and_values(tiny_llama, monkeypatch):
    """The fp8 pool stores e4m3 and attention reads it back in the model's dtype: the logits are exactly those of
    an fp32 pool whose writes are rounded through e4m3 (measured difference 0.0 on a CPU)."""
    ids = prompt(120, 6)
    cpu = dict(kv_cache_tokens=512, dtype="float32", device="cpu")  # one kernel set, one summation order
    fp8 = LLM(tiny_llama, kv_dtype="fp8", **cpu).prompt_logits(ids)
    exact = LLM(tiny_llama, **cpu).prompt_logits(ids)
    write = KVCache.write
    e4m3 = torch.float8_e4m3fn
    monkeypatch.setattr(KVCache, "write", lambda self, layer, slots, k, v: write(
        self, layer, slots, k.to(e4m3).to(k.dtype), v.to(e4m3).to(v.dtype)))
    rounded = LLM(tiny_llama, **cpu).prompt_logits(ids)
    torch.testing.assert_close(fp8, rounded, atol=1e-6, rtol=0)
    assert (fp8 - exact).abs().max() > 1e-3  # the rounding is there to see: fp8 is not the fp32 pool
