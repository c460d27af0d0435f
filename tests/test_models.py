"""Our model file against transformers' own implementation, family by family (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams

CASES = {
    "llama-gqa2-hd16": ("llama", {}),
    "llama-mha-hd32-tied": ("llama", dict(hidden_size=128, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-gqa4-hd64": ("llama", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=64)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "llama-rope-yarn": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
}


def hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(checkpoint_factory, case):
    family, overrides = CASES[case]
    path = checkpoint_factory(family, **overrides)
    ids = torch.randint(2, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(path, chunk_size=32, device="cpu")  # 100 tokens = 4 prefill chunks
    ours = llm.prompt_logits(ids)
    ref = hf_logits(path, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_dynamic_ntk_beyond_window_matches_transformers(checkpoint_factory):
    """Dynamic NTK grows the RoPE base with the attended length (window 64, prompt 100). HF computes
    one base for its single forward pass, so we compare one prefill chunk of the whole prompt."""
    path = checkpoint_factory("llama", max_position_embeddings=64,
                              rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ids = torch.randint(2, 300, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = LLM(path, chunk_size=128, device="cpu").prompt_logits(ids)
    torch.testing.assert_close(ours, hf_logits(path, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generation_matches_transformers(checkpoint_factory, family):
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(family)
    ids = torch.randint(2, 300, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    out = LLM(path, chunk_size=32, device="cpu").generate([ids], SamplingParams(max_tokens=32, temperature=0,
                                                                                 ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert out[0].token_ids == ref
    assert len(ref) == 32


def test_bfloat16_close_to_fp32(tiny_llama):
    ids = list(range(2, 90))
    fp32 = LLM(tiny_llama, chunk_size=32, device="cpu").prompt_logits(ids)
    bf16 = LLM(tiny_llama, chunk_size=32, dtype="bfloat16", device="cpu").prompt_logits(ids)
    assert bf16.dtype == torch.float32  # logits always come back in fp32
    # measured: max |bf16 - fp32| 0.0246 of max |fp32| 2.49 (0.0099 of it); the bound was 0.15 of it
    assert (bf16 - fp32).abs().max() < 0.02 * fp32.abs().max()


@pytest.mark.parametrize("name", [None, "cpu", "cuda"])
def test_engines_report_the_device_their_tensors_report(tiny_llama, name):
    """An engine's device is the one its tensors say: cuda:0 for "cuda" (a tensor on "cuda" reports cuda:0, and a
    device compared with it must too), for a checkpoint's engine and a random-weights one alike; None picks CUDA
    where there is one."""
    from tokenselect.bench import e2e

    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    want = torch.empty(0, device=name or ("cuda" if torch.cuda.is_available() else "cpu")).device
    for llm in (LLM(tiny_llama, "full", device=name, kv_cache_tokens=64),
                LLM.random(e2e.TINY, "full", device=name, kv_cache_tokens=64)):
        assert llm.device == want and llm.model.model.embed_tokens.weight.device == want
