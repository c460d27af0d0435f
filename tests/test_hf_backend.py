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
    kwargs = {} if cache is None else {"cache": cache}
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


def test_a_plain_cache_after_a_selection_cache_is_ordinary_attention():
    """The attention function acts only on keys its SelectionCache returned: a later generate with transformers'
    own cache is ordinary attention, however the earlier run ended."""
    model = tiny("llama")
    ids = distinct_tokens(PROMPT, 6)
    want = generate(model, ids, 4, "sdpa")
    generate(model, ids, 4, "tokenselect", tshf.SelectionCache(k=8, n_init=4, n_local=8, dense_until=0))
    assert generate(model, ids, 4, "tokenselect") == want


def test_readme_example_runs(tiny_llama, tmp_path, monkeypatch, capsys):
    """The README's example, on the tiny Llama and a book past the default budget (2,688 tokens): it selects."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Any Hugging Face model: `tokenselect.hf`")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "book.txt").write_text("The quick brown fox jumps over the lazy dog. " * 110)  # ~2,860 tokens
    scope = {"PATH": str(tiny_llama)}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["ids"].shape[1] > 2688 and scope["cache"].selected  # past the budget, and selecting
    hits, misses = scope["cache"].hits_misses()
    assert hits + misses == 2 * 63


def test_eval_backend_transformers_writes_a_table_for_gemma3(tmp_path, capsys):
    """`tokenselect eval --backend transformers` on a Gemma 3 checkpoint (an architecture our engine does not
    load), on the CPU: a table of full and tokenselect, tokenselect selecting past its small budget."""
    import json

    from checkpoints import save_tokenizer

    from tokenselect.cli import build_parser

    path = tmp_path / "gemma3"
    tiny("gemma3").save_pretrained(path)
    save_tokenizer(path)
    out = tmp_path / "run"
    args = build_parser().parse_args([
        "eval", "--backend", "transformers", "--model", str(path), "--task", "passkey", "--lengths", "512",
        "--samples", "2", "--attention", "full,tokenselect", "--k", "16", "--n-init", "4", "--n-local", "16",
        "--dense-until", "0", "--chat", "off", "--prompt-cache", "none", "--workers", "1", "--output", str(out)])
    assert args.func(args) == 0
    table = (out / "table.md").read_text()
    assert "transformers, tokenselect.hf" in table and "| full" in table and "| tokenselect" in table
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["policy"] for r in records} == {"full", "tokenselect"}
    assert all(r["prompt_tokens"] > 4 + 16 + 16 for r in records)  # past the budget: tokenselect selected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["selection_cache"]["tokenselect"]["misses"] >= 2  # one layer selects (the other slides)
    assert "| tokenselect" in capsys.readouterr().out
