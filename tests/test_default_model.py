"""The default model and the prose corpus shipped inside the package (tokenselect/data)."""
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenselect import LLM, SamplingParams
from tokenselect.data import default_model_path, prose_text

ROOT = Path(__file__).resolve().parents[1]
MODEL = default_model_path()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, dtype="float32")


def test_prose_is_real_english():
    text = prose_text()
    assert len(text) > 5_000_000
    assert "To be, or not to be" in text
    assert "ROMEO" in text.upper() and "MACBETH" in text.upper()
    words = text.split()
    common = sum(w.lower() in {"the", "and", "of", "to", "i", "a"} for w in words[:200_000])
    assert common / 200_000 > 0.08  # English function words are everywhere in real prose
    assert (MODEL.parent / "prose" / "SOURCE.md").is_file()


def test_checkpoint_is_a_small_gqa_llama():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["max_position_embeddings"] == 1024
    assert cfg["num_hidden_layers"] == 8 and cfg["hidden_size"] == 384 and cfg["intermediate_size"] == 1024
    assert cfg["num_attention_heads"] == 6 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 64
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 8192
    assert cfg["eos_token_id"] == 1 and cfg["bos_token_id"] == 0
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in MODEL.glob("*.safetensors")) == shards  # no stale shards left behind
    for name in shards:
        assert (MODEL / name).stat().st_size < 16 * 2**20  # the device returns files of at most 16 MiB
    assert sum((MODEL / n).stat().st_size for n in shards) < 33_000_000  # ~16M bf16 weights
    assert (MODEL / "MODEL_CARD.md").is_file()


def test_checkpoint_weights(hf):
    n_params = sum(p.numel() for p in hf.parameters())  # tied: the LM head is the embedding
    assert 15_000_000 < n_params < 17_000_000, n_params
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * n_params  # bf16 on disk


def test_tokenizer_round_trips_text(tok):
    samples = [
        prose_text()[300_000:302_000],
        'def f(x: int) -> int:\n    """Double x."""\n\treturn x * 2  # ok\n',
        "Unicode: café, naïve, 東京, 🙂; tab\tand  two spaces. The pass key is 71432.",
    ]
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"


def test_our_loader_matches_transformers(tok, hf, llm):
    ids = tok(prose_text()[500_000:504_000])["input_ids"][:300]
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    # measured (fp32, CPU): max |ours - ref| 4.6e-5 with logits up to 35.9, the argmax the same at every position;
    # the bound was atol 2e-2 + rtol 2e-2 (up to 0.74 on the largest logit)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


def test_model_has_learned_its_text(tok, hf):
    # trained (largely memorised) Shakespeare; unseen modern prose is far worse, see MODEL_CARD.md
    text = prose_text()
    start = text.index("To be, or not to be") - 1500
    ids = tok(text[start:start + 3000], return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        loss = hf(input_ids=ids, labels=ids).loss.item()
    assert loss < 2.0  # uniform over 8192 tokens is 9.0 nats


def _eval_samples(task, tokens, n, tok):
    """Samples of the evaluation's own generator, seeds outside both the eval's and training's."""
    from tokenselect.eval.tasks import make_sample
    count = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    return [make_sample(task, tokens, depth, random.Random(f"test/{task}/{tokens}/{i}"), count)
            for i, depth in enumerate((0.1, 0.5, 0.9)[:n])]


def test_model_retrieves_a_passkey_within_its_window_and_stops(tok, llm):
    from tokenselect.eval.metrics import score
    for s in _eval_samples("passkey", 700, 3, tok):
        out = llm.generate([s.input], SamplingParams(max_tokens=12, temperature=0))[0]
        assert score("passkey", out.text, s.answers) == 1.0, (s.meta["depth"], out.text)
        # trained to write " 12345." then </s>: no extra digit, and it stops by itself
        assert out.text.strip() == s.answers[0] + "." and out.finish_reason == "stop", out.text


def test_model_answers_ruler_needle_prompts(tok, llm):
    from tokenselect.eval.metrics import score
    for s in _eval_samples("niah_single_2", 600, 2, tok):
        out = llm.generate([s.input], SamplingParams(max_tokens=32, temperature=0))[0]
        assert score("niah_single_2", out.text, s.answers) == 1.0, out.text
        assert out.finish_reason == "stop", out.text


def test_training_drills_come_from_the_eval_generators(tok):
    sys.path.insert(0, str(ROOT / "training"))
    import drills
    count = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    for n in range(6):
        d = drills.make_drill(n, count, 1024)
        assert d.prompt.endswith(("is", "is: ", "are", "they are: ")), d.prompt[-40:]
        assert d.meta["tokens"] <= 1024
        assert all(a in d.completion for a in d.answers)
        assert d == drills.make_drill(n, count, 1024)  # drill n is fixed by n
