"""GGUF files: tiny ones written here from tiny Hugging Face checkpoints (every family, several tensor types,
errors), compared with the checkpoint folder they came from and with transformers' own GGUF loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_files import write_gguf
from tokenselect import LLM, CheckpointError
from tokenselect.models.gguf import hf_name

IDS = torch.randint(2, 300, (90,), generator=torch.Generator().manual_seed(5)).tolist()

# name -> (family, config overrides, GGUF architecture, type of the 2-D weights)
CASES = {
    "llama-f32": ("llama", {}, "llama", "F32"),
    "llama-gqa4-hd32-tied-f16": ("llama", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                               head_dim=32, tie_word_embeddings=True), "llama", "F16"),
    "llama-mha-q8_0": ("llama", dict(num_key_value_heads=4, hidden_size=128), "llama", "Q8_0"),
    "qwen2-bias-bf16": ("qwen2", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2), "qwen2", "BF16"),
    "qwen3-qknorm-q4_0": ("qwen3", {}, "qwen3", "Q4_0"),
    "qwen2-q5_1": ("qwen2", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2), "qwen2", "Q5_1"),
}
# compared with the folder they came from only: transformers' GGUF loader ignores ``qwen3.attention.key_length``
# (it assumes head_dim = hidden / heads), so it cannot read this one
FOLDER_CASES = {"qwen3-hd32-f32": ("qwen3", dict(head_dim=32), "qwen3", "F32")}


def transformers_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def gguf_case(checkpoint_factory, tmp_path_factory):
    made = {}

    def make(case: str):
        if case not in made:
            family, overrides, arch, qtype = {**CASES, **FOLDER_CASES}[case]
            folder = checkpoint_factory(family, **overrides)
            made[case] = (folder, write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{case}.gguf", arch, qtype))
        return made[case]

    return make


@pytest.mark.parametrize("case", ["llama-f32", "qwen3-hd32-f32"])
def test_f32_file_gives_the_folders_logits(gguf_case, case):
    """Same weights, bit for bit: the GGUF (q/k rows interleaved for llama, shapes reversed) must give the
    folder's logits to rounding. Measured: 0 (the same fp32 numbers reach the same kernels)."""
    folder, path = gguf_case(case)
    ours = LLM(path, chunk_size=32, device="cpu").prompt_logits(IDS)
    theirs = LLM(folder, chunk_size=32, device="cpu").prompt_logits(IDS)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_gguf_loader(gguf_case, case):
    """transformers dequantizes and un-permutes the same file on its own: logits agree to fp32 rounding
    (measured max |diff| 2e-6 on these 90 tokens)."""
    _, path = gguf_case(case)
    ours = LLM(path, chunk_size=32, device="cpu").prompt_logits(IDS)
    torch.testing.assert_close(ours, transformers_logits(path, IDS), atol=2e-5, rtol=0)


def test_quantized_file_differs_from_its_source(gguf_case):
    """A check that the comparison above can fail: a Q4_0 file's logits are not the fp32 folder's."""
    folder, path = gguf_case("qwen3-qknorm-q4_0")
    quant = LLM(path, chunk_size=32, device="cpu").prompt_logits(IDS)
    exact = LLM(folder, chunk_size=32, device="cpu").prompt_logits(IDS)
    assert (quant - exact).abs().max() > 1e-3


def test_config_and_tokenizer_come_from_the_metadata(gguf_case):
    folder, path = gguf_case("llama-gqa4-hd32-tied-f16")
    llm, ref = LLM(path, device="cpu"), LLM(folder, device="cpu")
    for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size",
                  "tie_embeddings", "window", "eos_token_ids"):
        assert getattr(llm.config, field) == getattr(ref.config, field), field
    assert llm.config.rope.theta == ref.config.rope.theta
    text = "The pass key is 71432. Remember it."
    assert llm.encode(text) == ref.encode(text)  # same BPE, BOS added as the metadata says
    assert llm.encode(text)[0] == 0
    assert llm.chat_prompt([{"role": "user", "content": "hi"}]) == llm.tokenizer(
        "<s>user: hi\nassistant:", add_special_tokens=False)["input_ids"]  # the template's BOS, no second one


def test_llama3_rope_factors_match_the_folder(checkpoint_factory, tmp_path):
    """A Llama 3.1-style file keeps the rope scaling as per-frequency divisors (``rope_freqs.weight``), as
    llama.cpp's converter writes them; they must reproduce the folder's llama3 rope."""
    from tokenselect.config import ModelConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    folder = checkpoint_factory("llama", rope_parameters=rope)
    spec = ModelConfig.from_folder(folder).rope
    plain = spec.__class__(head_dim=spec.head_dim, theta=spec.theta).inv_freq()[0]
    factors = (plain / spec.inv_freq()[0]).numpy()
    assert factors.max() > 7.9  # the test has frequencies that are scaled
    path = write_gguf(folder, tmp_path / "llama3.gguf", "llama", "F32", rope_factors=factors)
    ours = LLM(path, chunk_size=32, device="cpu").prompt_logits(IDS)
    torch.testing.assert_close(ours, LLM(folder, chunk_size=32, device="cpu").prompt_logits(IDS), atol=1e-5, rtol=0)


def test_hf_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.ssm_conv1d.weight") is None


# ---- errors a user gets ---------------------------------------------------------------------------


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="neither a Hugging Face checkpoint folder nor a GGUF file"):
        LLM(path, device="cpu")


def test_truncated_file(gguf_case, tmp_path):
    _, path = gguf_case("llama-f32")
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(cut, device="cpu")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(CheckpointError, match="truncated or corrupt|truncated"):
        LLM(header_only, device="cpu")


def test_unsupported_architecture(checkpoint_factory, tmp_path):
    path = write_gguf(checkpoint_factory("llama"), tmp_path / "g.gguf", "gemma2", "F32")
    with pytest.raises(CheckpointError, match="architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3"):
        LLM(path, device="cpu")


def test_unsupported_tensor_type_is_named(checkpoint_factory, tmp_path):
    """Q8_1 is a ggml type the gguf package cannot dequantize: the error names the tensor and the type."""
    folder = checkpoint_factory("llama")
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]  # (block size, bytes per block)
    raw = np.zeros((64, 64 // size[0] * size[1]), dtype=np.uint8)  # a [64, 64] weight's bytes
    path = write_gguf(folder, tmp_path / "q81.gguf", "llama", "F32", skip=("blk.1.ffn_up.weight",),
                      extra_tensor=("blk.1.ffn_up.weight", raw, gguf.GGMLQuantizationType.Q8_1))
    with pytest.raises(CheckpointError, match="blk.1.ffn_up.weight has type Q8_1"):
        LLM(path, device="cpu")


def test_missing_tensor_is_named(checkpoint_factory, tmp_path):
    path = write_gguf(checkpoint_factory("llama"), tmp_path / "m.gguf", "llama", "F32",
                      skip=("blk.1.attn_v.weight",))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.v_proj.weight"):
        LLM(path, device="cpu")


def tokenizer_calls(monkeypatch) -> list[dict]:
    """Record every ``AutoTokenizer.from_pretrained`` call's arguments (the calls still run)."""
    from transformers import AutoTokenizer

    calls, real = [], AutoTokenizer.from_pretrained

    def recorded(*args, **kwargs):
        calls.append({"args": args, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorded)
    return calls


def assert_tokenizes_alike(a, b) -> None:
    text = "<s>The pass key is 71432.</s> Remember it: wörld\t  x"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(messages, tokenize=False)
    assert (a.bos_token, a.eos_token, len(a)) == (b.bos_token, b.eos_token, len(b))


@pytest.mark.parametrize("case", ["llama-f32", "qwen2-bias-bf16"])
def test_the_tokenizer_is_built_from_the_file_once_then_loaded_as_saved(gguf_case, case, monkeypatch):
    from tokenselect.models.gguf import GGUFCheckpoint, tokenizer_folder

    _, path = gguf_case(case)
    calls = tokenizer_calls(monkeypatch)
    built = GGUFCheckpoint(path).tokenizer()
    assert calls[0]["gguf_file"] == path.name  # converted from the metadata, then the saved copy checked
    assert (tokenizer_folder(path) / "tokenizer_config.json").is_file()
    assert not list(tokenizer_folder(path).parent.glob("*.partial"))
    del calls[:]
    loaded = GGUFCheckpoint(path).tokenizer()  # a new checkpoint object, as another process would make
    assert calls == [{"args": (str(tokenizer_folder(path)),), "local_files_only": True}]
    assert loaded.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert_tokenizes_alike(built, loaded)


def test_a_changed_file_or_transformers_gets_its_own_saved_tokenizer(gguf_case, tmp_path, monkeypatch):
    import os

    import transformers

    from tokenselect.models.gguf import tokenizer_folder

    _, path = gguf_case("llama-f32")
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    first = tokenizer_folder(copy)
    assert tokenizer_folder(copy) == first
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert tokenizer_folder(copy) != first
    moved = tokenizer_folder(copy)
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert tokenizer_folder(copy) not in (first, moved)


def test_an_unreadable_saved_tokenizer_is_built_again(gguf_case, monkeypatch):
    from tokenselect.models.gguf import GGUFCheckpoint, tokenizer_folder

    _, path = gguf_case("llama-f32")
    good = GGUFCheckpoint(path).tokenizer()
    (tokenizer_folder(path) / "tokenizer_config.json").write_text("{ not json")
    calls = tokenizer_calls(monkeypatch)
    again = GGUFCheckpoint(path).tokenizer()
    assert [c.get("gguf_file") for c in calls][:2] == [None, path.name]  # the saved copy failed, the file served
    assert (tokenizer_folder(path) / "tokenizer_config.json").read_text().startswith("{\n")  # and it was saved anew
    assert_tokenizes_alike(good, again)


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(gguf_case, tmp_path, monkeypatch):
    from tokenselect.models.gguf import GGUFCheckpoint

    _, path = gguf_case("llama-f32")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TOKENSELECT_HOME", str(blocked))  # mkdir under a file fails
    tokenizer = GGUFCheckpoint(path).tokenizer()
    assert tokenizer("The pass key")["input_ids"][0] == 0
    assert list(tmp_path.iterdir()) == [blocked]


def test_a_saved_copy_that_loads_as_another_tokenizer_is_not_kept(gguf_case, monkeypatch):
    """transformers 5's model classes rebuild their normalizer on loading (Qwen2's: NFC, where the GGUF's has none).
    A saved copy that loads as anything but the built tokenizer is dropped: here one whose file gains NFC."""
    import json
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from tokenselect.models.gguf import GGUFCheckpoint, tokenizer_folder

    real = PreTrainedTokenizerBase.save_pretrained

    def save_with_nfc(self, folder, *args, **kwargs):
        out = real(self, folder, *args, **kwargs)
        file = Path(folder) / "tokenizer.json"
        spec = json.loads(file.read_text())
        file.write_text(json.dumps({**spec, "normalizer": {"type": "NFC"}}))
        return out

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save_with_nfc)
    _, path = gguf_case("llama-f32")
    tokenizer = GGUFCheckpoint(path).tokenizer()
    assert tokenizer("e\u0301")["input_ids"] != tokenizer("\u00e9")["input_ids"]  # the file's own: no NFC
    assert not tokenizer_folder(path).exists()
    assert not list(tokenizer_folder(path).parent.glob("*"))  # no partial copy left either


def test_a_saved_copy_that_fails_to_load_back_is_not_kept_and_the_tokenizer_still_comes(gguf_case, monkeypatch):
    from transformers import AutoTokenizer

    from tokenselect.models.gguf import GGUFCheckpoint, tokenizer_folder

    real = AutoTokenizer.from_pretrained

    def refuse_saved(name, *args, **kwargs):
        if str(name).endswith(".partial"):
            raise ValueError("cannot load this copy")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse_saved)
    _, path = gguf_case("llama-f32")
    tokenizer = GGUFCheckpoint(path).tokenizer()
    assert tokenizer("The pass key")["input_ids"][0] == 0
    assert not tokenizer_folder(path).parent.exists() or not list(tokenizer_folder(path).parent.iterdir())


def test_an_engine_takes_an_open_checkpoint_and_reads_its_file_once(gguf_case, monkeypatch):
    """``LLM(checkpoint)`` (what the eval does after building its prompts) gives the engine ``LLM(path)`` gives,
    without a second read of the GGUF's metadata (seconds for a large vocabulary)."""
    from tokenselect.models import gguf as gguf_module
    from tokenselect.models.loader import Checkpoint

    _, path = gguf_case("llama-gqa4-hd32-tied-f16")
    reads, real = [], gguf_module.GGUFCheckpoint.__init__

    def counted(self, *args, **kwargs):
        reads.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(gguf_module.GGUFCheckpoint, "__init__", counted)
    checkpoint = Checkpoint(path)
    llm = LLM(checkpoint, device="cpu")
    assert len(reads) == 1 and llm.path == path and llm.config == checkpoint.config
    ref = LLM(path, device="cpu")
    assert len(reads) == 2
    torch.testing.assert_close(llm.prompt_logits(IDS), ref.prompt_logits(IDS), rtol=0, atol=0)
