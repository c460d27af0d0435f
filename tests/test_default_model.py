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
    assert cfg["num_attention_heads"] == 8 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 8192
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for name in shards:
        assert (MODEL / name).stat().st_size < 16 * 2**20
    assert sum((MODEL / n).stat().st_size for n in shards) < 60_000_000
    assert (MODEL / "MODEL_CARD.md").is_file()


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
    torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


def test_model_has_learned_its_text(tok, hf):
    # trained (largely memorised) Shakespeare; unseen modern prose is far worse, see MODEL_CARD.md
    text = prose_text()
    start = text.index("To be, or not to be") - 1500
    ids = tok(text[start:start + 3000], return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        loss = hf(input_ids=ids, labels=ids).loss.item()
    assert loss < 2.0  # uniform over 8192 tokens is 9.0 nats


def test_model_retrieves_a_passkey_within_its_window(tok, llm):
    sys.path.insert(0, str(ROOT / "training"))
    import drills
    rng = random.Random(11)
    count = lambda s: len(tok(s)["input_ids"])
    for depth in (0.1, 0.5, 0.9):
        d = drills.passkey(700, depth, rng, count)
        out = llm.generate([d.input], SamplingParams(max_tokens=8, temperature=0))
        assert out[0].text.strip().startswith(d.answers[0].strip()), (depth, out[0].text)
