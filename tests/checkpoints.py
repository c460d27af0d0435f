"""Tiny random-initialised Hugging Face checkpoints for tests, written with transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "The pass key is 71432. Remember it. What is the pass key? ",
    "def main():\n    return 42\n",
    "Grass is green, the sky is blue, the sun is yellow. Here we go. There and back again. ",
]

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def save_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer with <s>/</s>, trained on a few lines, saved HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def make_checkpoint(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny model of ``family`` (llama | mistral | qwen2 | qwen3) and a tokenizer into ``path``."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if family == "mistral":
        settings["sliding_window"] = None
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens differ clearly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    save_tokenizer(path)
    return Path(path)


def distinct_tokens(n: int, seed: int) -> list[int]:
    """n token ids of these checkpoints, none repeated (n <= VOCAB - 2; ids 0 and 1 are special). A repeated
    token has equal keys in the first layer, whose votes tie: where a test compares two paths' choices, the
    reference top-k may keep a different one of the tied on each."""
    return (torch.randperm(VOCAB - 2, generator=torch.Generator().manual_seed(seed))[:n] + 2).tolist()


def small_sizes(attention: str) -> dict:
    """Sinks, window (and TokenSelect's k) small enough that short prompts of the tiny model select (full
    attention has none), inside the model's window too (``dense_until`` 0)."""
    if attention == "full":
        return {}
    return {"n_init": 4, "n_local": 16, "dense_until": 0, **({"k": 16} if attention == "tokenselect" else {})}
