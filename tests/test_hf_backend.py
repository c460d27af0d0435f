"""tokenselect.hf: TokenSelect as a transformers attention backend, on tiny random models of transformers' own
families (Gemma 3, Phi-3, Mistral with a sliding window) and Llama (which our engine runs too)."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from checkpoints import VOCAB, distinct_tokens

import tokenselect.hf as tshf

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
             tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=32)),
}
PROMPT = 80  # tokens: past n_init + k + n_local of the small settings below


def tiny(family: str, **overrides) -> torch.nn.Module:
    """A 2-layer random model of ``family`` (head_dim 16, GQA 2), weights N(0, 0.08) as tests/checkpoints.py."""
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**SIZES, **extra, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def generate(model, ids: list[int], n: int, attention: str, cache=None) -> list[int]:
    model.set_attn_implementation(attention)
    kwargs = {} if cache is None else {"past_key_values": cache}
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_k_covering_the_context_equals_sdpa(family):
    """Inside the budget the backend is transformers' SDPA attention: the same tokens, for every family."""
    model = tiny(family)
    ids = distinct_tokens(PROMPT, 1)
    want = generate(model, ids, 8, "sdpa")
    cache = tshf.SelectionCache(k=256, n_init=4, n_local=16, config=model.config)
    assert generate(model, ids, 8, "tokenselect", cache) == want
    assert cache.selected == {}  # nothing was selected


def test_dense_until_defaults_to_the_models_window():
    """As our engine: without dense_until, contexts inside the model's window (256) attend everything."""
    model = tiny("phi3")
    ids = distinct_tokens(PROMPT, 7)
    want = generate(model, ids, 4, "sdpa")
    cache = tshf.SelectionCache(k=8, n_init=4, n_local=8)
    assert generate(model, ids, 4, "tokenselect", cache) == want and cache.selected == {}


@pytest.mark.parametrize("theta,kernels", [(None, "torch"), (0.9, "torch"), (-1.0, "torch"), (0.9, "triton")])
def test_llama_past_the_budget_equals_the_engine(checkpoint_factory, theta, kernels):
    """Past the budget, greedy tokens equal our engine's TokenSelect with the same settings (prefill in one chunk,
    as transformers does; dense_until 0). theta -1 reuses every decode step's selection after the first."""
    from tokenselect import LLM, SamplingParams

    path = checkpoint_factory("llama")
    ids = distinct_tokens(120, 0)
    settings = dict(k=16, n_init=4, n_local=16, theta=theta, dense_until=0)
    n = 4 if kernels == "triton" else 12  # the Triton kernels run in the (slow) interpreter on the CPU
    engine = LLM(str(path), "tokenselect", chunk_size=128, **settings)
    want = engine.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cache = tshf.SelectionCache(**settings, kernels=kernels)  # the engine: PyTorch references
    assert generate(model, ids, n, "tokenselect", cache) == list(want)
    assert cache.selected[0].numel() == 4 + 16 + 16
    if theta == -1.0:
        assert cache.hits_misses() == (2 * 10, 2)  # 11 decode steps x 2 layers, the first of each a miss


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_transformers_only_families_select(family):
    """Gemma 3 and Phi-3 select past the budget (Gemma 3's sliding layer stays dense); the tokens differ from
    full attention's, and the lists hold sinks + k + window."""
    model = tiny(family)
    ids = distinct_tokens(PROMPT, 2)
    cache = tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0, theta=None, config=model.config)
    out = generate(model, ids, 6, "tokenselect", cache)
    assert len(out) == 6
    layers = [1] if family == "gemma3" else [0, 1]
    assert sorted(cache.selected) == layers
    for layer in layers:
        listed = cache.selected[layer].tolist()
        assert len(listed) == 20 and listed[:4] == [0, 1, 2, 3] and listed == sorted(listed)


def test_mistral_sliding_window_stays_dense():
    """Sliding-window layers attend their window as transformers does (no selection), past any budget."""
    model = tiny("mistral_sliding")
    ids = distinct_tokens(PROMPT, 3)
    want = generate(model, ids, 6, "sdpa")
    cache = tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0, config=model.config)
    assert generate(model, ids, 6, "tokenselect", cache) == want
    assert cache.selected == {}


def test_partial_rotary_raises_a_clear_error():
    model = tiny("phi3", partial_rotary_factor=0.5)
    ids = distinct_tokens(PROMPT, 4)
    with pytest.raises(tshf.UnsupportedModel, match="partial rotary"):
        generate(model, ids, 3, "tokenselect", tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0))


def rope(model, layer, x, positions):
    """x: [1, heads, n, d] rotated at positions [n] by the model's own rotary embedding and apply_rotary_pos_emb."""
    family = importlib.import_module(type(model).__module__)
    rotary = model.model.rotary_emb
    layer_type = getattr(model.config, "layer_types", None)
    kwargs = {"layer_type": layer_type[layer]} if layer_type and "layer_type" in rotary.forward.__code__.co_varnames \
        else {}
    cos, sin = rotary(x, positions[None], **kwargs)
    return family.apply_rotary_pos_emb(x, x, cos, sin)[0]


@pytest.mark.parametrize("family,layer,kernels", [("llama", 0, "torch"), ("gemma3", 1, "torch"), ("phi3", 1, "torch"),
                                                  ("llama", 0, "triton")])
def test_positions_reassigned_as_the_models_rope(family, layer, kernels):
    """One decode step past the budget, against a reference built with the model's own RoPE: the selected keys
    rotated at their index in the list, the query at the list's end. A key planted along every head's query wins
    the vote and is attended."""
    model = tiny(family)
    module = model.model.layers[layer].self_attn
    d, h, h_kv, t = 16, 4, 2, 60
    g = torch.Generator().manual_seed(5)
    q_raw = torch.randn(1, h, 1, d, generator=g)
    k_raw = torch.randn(1, h_kv, t + 1, d, generator=g) * 0.3
    v = torch.randn(1, h_kv, t + 1, d, generator=g)
    planted = 30
    k_raw[0, :, planted] = 4 * q_raw[0, ::2, 0] + 4 * q_raw[0, 1::2, 0]  # along both query heads of each kv head
    positions = torch.arange(t + 1)
    k_post = rope(model, layer, k_raw, positions)
    q_post = rope(model, layer, q_raw, positions[t:])
    # Triton: interpreted on the CPU
    cache = tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0, theta=None, kernels=kernels)
    k_cached, v_cached = cache.update(k_post, v, layer)  # as a model's attention layer calls it
    out, _ = tshf.tokenselect_attention(module, q_post, k_cached, v_cached, None, scaling=module.scaling)
    listed = cache.selected[layer]
    assert planted in listed.tolist() and listed.numel() == 20
    order = torch.cat([listed, torch.tensor([t])])
    index = torch.arange(order.numel())
    k_ref = rope(model, layer, k_raw[:, :, order], index)
    q_ref = rope(model, layer, q_raw, index[-1:])
    ref = torch.nn.functional.scaled_dot_product_attention(q_ref, k_ref, v[:, :, order], scale=module.scaling,
                                                           enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_a_plain_cache_after_a_selection_cache_is_ordinary_attention_inside_the_window():
    """A later generate with transformers' own cache runs the policy's defaults, which attend densely inside the
    model's window (dense_until): the same tokens as SDPA, however the earlier run ended."""
    model = tiny("llama")
    ids = distinct_tokens(PROMPT, 6)
    want = generate(model, ids, 4, "sdpa")
    generate(model, ids, 4, "tokenselect", tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0))
    assert generate(model, ids, 4, "tokenselect") == want
    assert tshf.default_state(model).selected == {}


# the policies' small settings: past n_init + budget + n_local after ~40 tokens of the tiny model (window 256)
BASELINES = {
    "tokenselect": dict(k=16, n_init=4, n_local=16, dense_until=0),
    "streaming": dict(n_init=4, n_local=16, dense_until=0),
    "quest": dict(k=16, page_size=4, n_init=4, n_local=16, dense_until=0),
    "infllm": dict(k=16, block_size=4, repr_keys=2, n_init=4, n_local=16, dense_until=0),
    "reattention": dict(n_init=4, n_local=16, span=4, n_spans=4, dense_until=0),
}
CHUNK = 32  # the engine's prefill chunk; generate prefills in the same chunks (prefill_chunk_size)


def engine_tokens(path, policy: str, ids: list[int], n: int, **settings) -> list[int]:
    from tokenselect import LLM, SamplingParams

    engine = LLM(str(path), policy, chunk_size=CHUNK, **settings)
    return list(engine.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0].token_ids)


@pytest.mark.parametrize("policy,kernels", [(p, "torch") for p in BASELINES]
                         + [(p, "triton") for p in ("quest", "infllm", "reattention")])
def test_baselines_equal_the_engine(checkpoint_factory, policy, kernels):
    """Every policy through the backend (the engine's own policy object, asked per layer and step) gives our
    engine's greedy tokens, prefilled in the same chunks; the last decode step attended a proper subset. The
    Triton kernels (interpreted on the CPU: the GPU's path) against the engine's PyTorch references."""
    path = checkpoint_factory("llama")
    ids = distinct_tokens(120, 11)
    n = 10 if kernels == "torch" else 3
    want = engine_tokens(path, policy, ids, n, **BASELINES[policy])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.set_attn_implementation("tokenselect")
    cache = tshf.PolicyCache(policy, chunk=CHUNK, kernels=kernels, **BASELINES[policy])
    out = model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         prefill_chunk_size=CHUNK)
    assert out[0, len(ids):].tolist() == want
    assert cache.policy.name == policy and sorted(cache.selected) == [0, 1]
    listed = cache.selected[1].tolist()
    assert listed[:4] == [0, 1, 2, 3] and len(listed) < len(ids) + n - 1
    if policy == "infllm":  # InfLLM's default positions put the memory at one position (not re-indexed)
        return
    assert listed == sorted(listed)


@pytest.mark.parametrize("policy", list(BASELINES))
def test_budget_covering_the_context_equals_sdpa(policy):
    """Boundary: when the policy's budget covers the whole context every step is transformers' own SDPA (the same
    tokens, nothing selected), for every policy."""
    model = tiny("llama")
    ids = distinct_tokens(PROMPT, 12)
    want = generate(model, ids, 6, "sdpa")
    covering = {**BASELINES[policy], "n_local": 128}  # n_init + n_local >= 80 + 6 tokens
    cache = tshf.PolicyCache(policy, chunk=96, **covering)  # InfLLM: the prompt is one chunk
    assert generate(model, ids, 6, "tokenselect", cache) == want
    assert cache.selected == {}


def test_without_a_cache_the_policys_defaults_apply(checkpoint_factory):
    """attn_implementation="tokenselect" alone: TokenSelect with the engine's defaults fitted to the window (k 64,
    n_init 4, n_local 16, theta 0.9, dense until the 256-token window), the same tokens as the engine's default
    TokenSelect past the window, and as an explicit SelectionCache() (whose left-out settings are the same)."""
    path = checkpoint_factory("llama")
    ids = distinct_tokens(300, 13)  # past the window
    n = 6
    from tokenselect import LLM, SamplingParams

    engine = LLM(str(path), "tokenselect")  # its defaults: chunk 64 for this window
    want = list(engine.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0].token_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="tokenselect")
    run = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, prefill_chunk_size=64)
    out = model.generate(torch.tensor([ids]), **run)
    assert out[0, len(ids):].tolist() == want
    state = tshf.default_state(model)
    policy = state.policy
    assert (policy.k, policy.n_init, policy.n_local, policy.dense_until) == (64, 4, 16, 256)
    assert state.selected[0].numel() == 4 + 64 + 16
    assert sum(state.hits_misses()) == 2 * (n - 1)  # every decode step of both layers looked up
    cache = tshf.SelectionCache()
    assert model.generate(torch.tensor([ids]), past_key_values=cache, **run)[0, len(ids):].tolist() == want
    # a second run without a cache starts afresh (its own Selection Cache), as the first
    assert model.generate(torch.tensor([ids]), **run)[0, len(ids):].tolist() == want
    assert tshf.default_state(model) is not state and sum(tshf.default_state(model).hits_misses()) == 2 * (n - 1)


@pytest.mark.parametrize("name", ["tokenselect_streaming", "tokenselect_quest"])
def test_named_implementations_run_their_policy_without_a_cache(name):
    """attn_implementation="tokenselect_<policy>" runs that policy's defaults; past the window it selects."""
    model = tiny("llama")
    ids = distinct_tokens(300, 14)
    generate(model, ids, 2, name)
    state = tshf.default_state(model)
    assert state.policy.name == name.split("_")[1] and state.selected


def pad_left(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("policy,theta", [("tokenselect", 0.9), ("tokenselect", -1.0), ("quest", None),
                                          ("infllm", None), ("streaming", None)])
def test_batch_equals_one_at_a_time(batch_invariant_matmuls, policy, theta):
    """A left-padded batch of prompts of different lengths gives each row the tokens it gets alone (each row its
    own selection, Selection Cache entries and memory). The prompts are prefilled in one step (a batch's chunks
    are cut at the batch's columns, so a padded row's chunks would not be its chunks alone)."""
    model = tiny("llama")
    prompts = [distinct_tokens(n, 20 + n) for n in (120, 97, 64)]
    settings = BASELINES[policy] if theta is None else {**BASELINES[policy], "theta": theta}
    run = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1)
    model.set_attn_implementation("tokenselect")
    alone = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), past_key_values=tshf.PolicyCache(policy, chunk=128, **settings), **run)
        alone.append(out[0, len(p):].tolist())
    ids, mask = pad_left(prompts)
    cache = tshf.PolicyCache(policy, chunk=128, **settings)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, **run)
    assert out[:, ids.shape[1]:].tolist() == alone
    model.set_attn_implementation("sdpa")
    assert all(model.generate(torch.tensor([p]), **run)[0, len(p):].tolist() != a for p, a in zip(prompts, alone))
    rows = cache.selected[1]
    assert len(rows) == 3 and all(r is not None for r in rows)  # every row selected at the last step
    assert all(r[:4].tolist() == [0, 1, 2, 3] for r in rows)  # token indices within the row (padding skipped)


def test_batch_with_a_row_inside_the_budget(batch_invariant_matmuls):
    """A row short enough to attend densely (SDPA, as alone) beside rows that select."""
    model = tiny("llama")
    prompts = [distinct_tokens(110, 30), distinct_tokens(20, 31)]
    settings = dict(k=16, n_init=4, n_local=16, dense_until=0)
    run = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
    model.set_attn_implementation("tokenselect")
    alone = [model.generate(torch.tensor([p]), past_key_values=tshf.SelectionCache(**settings), **run)[0, len(p):].tolist()
             for p in prompts]
    ids, mask = pad_left(prompts)
    cache = tshf.SelectionCache(**settings)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, **run)
    assert out[:, ids.shape[1]:].tolist() == alone
    assert cache.selected[0][0] is not None and cache.selected[0][1] is None


def test_infllm_without_chunked_prefill_raises_a_clear_error():
    model = tiny("llama")
    with pytest.raises(ValueError, match="prefill_chunk_size=32"):
        generate(model, distinct_tokens(PROMPT, 15), 2, "tokenselect", tshf.PolicyCache("infllm", chunk=32))


def test_unknown_settings_and_policies_raise():
    with pytest.raises(ValueError, match="takes no setting page_size"):
        tshf.PolicyCache("streaming", page_size=4)
    with pytest.raises(ValueError, match="unknown policy"):
        tshf.PolicyCache("h2o")
    model = tiny("llama", max_position_embeddings=64)  # ReAttention's n_local + chunk exceed this window
    with pytest.raises(ValueError, match="exceed the model window"):
        generate(model, distinct_tokens(PROMPT, 16), 2, "tokenselect", tshf.PolicyCache("reattention", n_local=60))


def test_chunk_attention_is_checked_and_resolved_as_the_engines():
    """chunk_attention: an unknown name fails when the cache is made; cudnn where it cannot run (the CPU) fails at
    the first step with the reason; auto resolves to the kernels' own path there, and the state names it."""
    with pytest.raises(ValueError, match="chunk_attention='flash': one of auto, triton, cudnn"):
        tshf.SelectionCache(chunk_attention="flash")
    model = tiny("llama")
    ids = distinct_tokens(PROMPT, 17)
    with pytest.raises(ValueError, match="cudnn runs with the triton kernels on CUDA in bf16 or fp16, not with torch"):
        generate(model, ids, 2, "tokenselect", tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0,
                                                                    chunk_attention="cudnn"))
    cache = tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0)
    generate(model, ids, 2, "tokenselect", cache)
    assert cache.state.chunk_attention == "triton" and cache.state.kernels.name == "torch"


def chunked_logits(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """The logits of ``ids`` [1, n] prefilled through ``cache`` in chunks of ``chunk`` tokens, [1, n, vocab] fp32."""
    with torch.no_grad():
        return torch.cat([model(ids[:, i:i + chunk], past_key_values=cache).logits
                          for i in range(0, ids.shape[1], chunk)], dim=1).float()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_attention_by_cudnn_equals_the_triton_kernel(dtype):
    """A bf16/fp16 model on CUDA whose 128-token prefill chunks select (dense_until 0): its chunks' attention by
    cuDNN (the two chunks past the budget admitted by the cache's PlanBudget) gives the logits of the Triton
    kernel's, within the dtype's rounding. head_dim 64, GQA 2. Measured on an H200: 0.11 (bf16) and 0.014 (fp16) at
    most apart, of logits up to 5.6; the own keys unmasked (a planted bug) 6.4 (results/supporting/
    hf_chunk_attention_h200.md, by benchmarks/hf_chunk_attention_gpu.py)."""
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to("cuda", dtype)
    model.set_attn_implementation("tokenselect")
    ids = torch.tensor([distinct_tokens(3 * 128, 18)], device="cuda")
    logits = {}
    for path in ("triton", "cudnn"):
        cache = tshf.SelectionCache(k=32, n_init=4, n_local=32, dense_until=0, theta=None, chunk_attention=path)
        logits[path] = chunked_logits(model, ids, cache, 128)
        kernels = cache.state.kernels
        assert cache.state.chunk_attention == path and kernels.name == ("triton+cudnn" if path == "cudnn" else "triton")
        if path == "cudnn":  # the selecting chunks' one shape (128 queries over the list) ran by cuDNN
            assert [shape[1] for shape in kernels.sparse_attention.keywords["cudnn"].shapes] == [128]
        assert cache.selected[0].numel() == 4 + 32 + 32
    err = (logits["cudnn"] - logits["triton"]).abs().max().item()
    assert err < 0.05 * logits["triton"].abs().max().item(), err


def test_readme_example_runs(tiny_llama, tmp_path, monkeypatch, capsys):
    """The README's example as written (PATH the tiny Llama, a book past its 256-token window: 2,860 tokens): the
    run without a cache selects with TokenSelect's defaults, the one with a SelectionCache with its settings."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Any Hugging Face model: `tokenselect.hf`")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    (tmp_path / "book.txt").write_text("The quick brown fox jumps over the lazy dog. " * 110)  # ~2,860 tokens
    scope = {"PATH": str(tiny_llama)}
    exec(compile(code, "README.md", "exec"), scope)
    model, cache, ids = scope["model"], scope["cache"], scope["ids"]
    assert ids.shape[1] > 2688 and cache.selected  # past the budget, and selecting
    defaults = tshf.default_state(model)
    assert defaults.policy.k == 64 and defaults.selected[1].numel() == 4 + 64 + 16  # fitted to the window
    hits, misses = cache.hits_misses()
    assert hits + misses == 2 * 63 and sum(defaults.hits_misses()) == 2 * 63
    assert capsys.readouterr().out.strip()


def test_speed_script_on_a_tiny_model(tmp_path):
    """benchmarks/hf_backend_speed.py at a tiny size on the CPU: both systems timed at each length and policy, the
    same greedy tokens (same weights, same prefill chunks), a markdown table with the command."""
    from benchmark_scripts import load

    bench = load("hf_backend_speed")
    out = tmp_path / "speed.md"
    argv = ["--random", "tiny", "--lengths", "150,300", "--decode-steps", "3", "--prompt", "random",
            "--policies", "full,tokenselect:k=16;n_init=4;n_local=16;dense_until=0", "--out", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    assert "hf_backend_speed.py --random tiny" in text
    rows = [line for line in text.splitlines() if line.startswith("| 150 ") or line.startswith("| 300 ")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(cells[i]) > 0 for i in (2, 3, 4, 5, 6, 7))
    assert text.count("tokens agree on 8 of 8") == 2
    # a repeat runs the same prompt: the engine must prefill it again, not reuse it
    assert "fastest of 2 runs" in text and "reused from its prefix cache: 0 " in text


def test_eval_backend_transformers_writes_a_table_for_gemma3(tmp_path, capsys):
    """`tokenselect eval --backend transformers` on a Gemma 3 checkpoint (an architecture our engine does not
    load) written by benchmarks/hf_tiny_checkpoint.py (as for benchmarks/results/eval_hf_tiny_gemma3_cpu.md), on
    the CPU: a table of full, tokenselect and infllm, the policies selecting past their small budget."""
    import json

    from benchmark_scripts import load
    from tokenselect.cli import build_parser

    builder = load("hf_tiny_checkpoint")
    path = builder.write("gemma3", tmp_path / "gemma3")
    out = tmp_path / "run"
    args = build_parser().parse_args([
        "eval", "--backend", "transformers", "--model", str(path), "--task", "passkey", "--lengths", "512",
        "--samples", "2", "--attention", "full,tokenselect,infllm", "--k", "16", "--n-init", "4", "--n-local", "16",
        "--dense-until", "0", "--chat", "off", "--prompt-cache", "none", "--workers", "1", "--output", str(out)])
    assert args.func(args) == 0
    table = (out / "table.md").read_text()
    assert "transformers, tokenselect.hf" in table and "| full" in table and "| tokenselect" in table
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {r["policy"] for r in records} == {"full", "tokenselect", "infllm"}
    assert all(r["prediction"] != f["prediction"] for r, f in zip(records[2:4], records[:2]))  # it selected
    assert all(r["prompt_tokens"] > 4 + 16 + 16 for r in records)  # past the budget: tokenselect selected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["selection_cache"]["tokenselect"]["misses"] >= 2  # one layer selects (the other slides)
    assert "| tokenselect" in capsys.readouterr().out


def test_eval_backend_transformers_refuses_tensor_parallel(tmp_path, capsys):
    """The transformers backend runs on one device: asking it for two ranks is an error before anything loads
    (not a run on one GPU that the user believes split)."""
    from tokenselect.cli import main

    argv = ["eval", "--backend", "transformers", "--model", str(tmp_path), "--task", "passkey", "--lengths", "512",
            "--output", str(tmp_path / "run")]
    assert main(argv + ["--tensor-parallel-size", "2"]) == 2
    assert "--backend transformers runs on one device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
