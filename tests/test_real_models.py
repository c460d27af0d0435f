"""The real pretrained models of the registry, fetched once into the cache (``$TOKENSELECT_HOME``, default
~/.cache/tokenselect) and compared with transformers' own load of the same GGUF file, in fp32 on the CPU.

SmolLM2-135M-Instruct (98 MB) runs in every test run. Qwen2.5-Coder-0.5B-Instruct (491 MB in six wheels) is
marked slow: ``python -m pytest -m slow tests/test_real_models.py``."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.cli import main
from tokenselect.data import prose_text
from tokenselect.models import registry

PROMPT_TOKENS = 1000
pytestmark = pytest.mark.model_cache


def fetched(name: str):
    return registry.fetch(name, progress=False)


def english_prompt(llm: LLM, n: int = PROMPT_TOKENS) -> list[int]:
    """``n`` tokens of the shipped public-domain prose (Shakespeare), from the start of a text."""
    return llm.encode(prose_text()[:20_000])[:n]


def transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2():
    path = fetched("smollm2-135m-instruct")
    return path, LLM("smollm2-135m-instruct", device="cpu"), transformers_model(path)


def test_registry_name_resolves_to_the_fetched_file(smollm2):
    path, llm, _ = smollm2
    assert llm.path == path == registry.cached_path("smollm2-135m-instruct")
    assert path.stat().st_size == registry.MODELS["smollm2-135m-instruct"].size
    cfg = llm.config
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.window) == (30, 9, 3, 64, 8192)
    assert cfg.rope.theta == 1e5 and cfg.tie_embeddings and cfg.eos_token_ids == (2,)


def check_logits(llm: LLM, hf, ids: list[int], atol: float) -> None:
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() == 1.0


def test_smollm2_logits_match_transformers(smollm2):
    """1000 tokens of English prose; both dequantize the same Q4_1 file to fp32. Measured max |diff| 1.1e-4
    on logits of magnitude ~20 (fp32 rounding through 30 layers, summed in different orders)."""
    _, llm, hf = smollm2
    check_logits(llm, hf, english_prompt(llm), atol=5e-4)


def test_smollm2_greedy_tokens_match_transformers(smollm2):
    _, llm, hf = smollm2
    ids = english_prompt(llm, 200)
    ours = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert len(ours) == 64
    assert ours == ref


def test_tokenselect_with_the_whole_prompt_in_budget_equals_full(smollm2):
    """Budget n_init + k + n_local covers the prompt and the answer: every token is attended at its own
    position, so TokenSelect's tokens are full attention's."""
    _, llm, _ = smollm2
    ids = english_prompt(llm, 300)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate([ids], params)[0].token_ids
    llm.set_attention("tokenselect", k=300, n_init=16, n_local=64)
    try:
        assert (llm.attention, llm.policy.k, llm.policy.n_init, llm.policy.n_local) == ("tokenselect", 300, 16, 64)
        sparse = llm.generate([ids], params)[0].token_ids
    finally:
        llm.set_attention("full")
    assert sparse == full


def test_chat_answers_the_capital_of_france(smollm2, capsys):
    assert main(["generate", "--model", "smollm2-135m-instruct", "--chat", "--device", "cpu",
                 "--prompt", "What is the capital of France?", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.slow
def test_qwen25_coder_logits_and_tokens_match_transformers():
    """Measured on a 2-core CPU: fetch ~40 s, our load ~20 s, transformers' ~15 s, the comparisons ~40 s."""
    path = fetched("qwen2.5-coder-0.5b-instruct")
    llm, hf = LLM(path, device="cpu"), transformers_model(path)
    assert (llm.config.architecture, llm.config.n_layers, llm.config.n_kv_heads, llm.config.window) == (
        "Qwen2ForCausalLM", 24, 2, 32768)
    check_logits(llm, hf, english_prompt(llm), atol=5e-4)
    ids = llm.chat_prompt([{"role": "user", "content": "Write a Python function that returns the square of x."}])
    ours = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref
    assert "def " in llm.tokenizer.decode(ours)


def test_fetch_refuses_an_unknown_name():
    with pytest.raises(Exception, match="unknown model 'no-such-model'"):
        registry.fetch("no-such-model")


def test_a_name_not_yet_fetched_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENSELECT_HOME", str(tmp_path))
    assert main(["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi"]) == 2
    with pytest.raises(Exception, match="run `tokenselect fetch smollm2-135m-instruct` first"):
        LLM("smollm2-135m-instruct", device="cpu")


def test_a_failed_download_leaves_nothing_behind(tmp_path, monkeypatch):
    """A package the index does not have: a clear error, and no partial file in the cache."""
    bad = registry.RegistryModel("bad", "test", (registry.Part("tokenselect-no-such-package", "0.0.1", "x.gguf"),),
                                 "x.gguf", 1, "0" * 64)
    monkeypatch.setenv("TOKENSELECT_HOME", str(tmp_path))
    monkeypatch.setitem(registry.MODELS, "bad", bad)
    with pytest.raises(Exception, match="could not download tokenselect-no-such-package==0.0.1"):
        registry.fetch("bad", progress=False)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_the_demo_runs_a_cached_real_model_and_else_the_embedded_one(smollm2, tmp_path, monkeypatch):
    from tokenselect.cli import demo_model

    assert demo_model(None) == "smollm2-135m-instruct"  # fetched into this cache by the fixture
    assert demo_model("smollm2-135m-instruct") == "smollm2-135m-instruct"  # cached: nothing fetched
    monkeypatch.setenv("TOKENSELECT_HOME", str(tmp_path))
    assert demo_model(None) is None  # an empty cache: the embedded model, no download
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_fails_its_checksum_is_not_kept(tmp_path, monkeypatch):
    """``install`` (behind fetch and benchmarks/model_parts.sh) keeps a whole, verified file or nothing."""
    import io

    monkeypatch.setenv("TOKENSELECT_HOME", str(tmp_path))
    with pytest.raises(Exception, match="does not match its pinned checksum"):
        registry.install("smollm2-135m-instruct", [io.BytesIO(b"GGUF"), io.BytesIO(b"not the model")], progress=False)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
