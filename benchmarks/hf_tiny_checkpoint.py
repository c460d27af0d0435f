"""Write a tiny random checkpoint of a transformers-only architecture (with the tests' small tokenizer) for
``tokenselect eval --backend transformers`` on the CPU: no real model of these families can be downloaded here,
so the tables it gives show that the harness runs them through tokenselect.hf, not what such a model scores.

    python benchmarks/hf_tiny_checkpoint.py gemma3 /tmp/tiny-gemma3

Families: gemma3 (a sliding-window layer, which stays dense, and a full-attention layer, which selects) and phi3;
2 layers, 4 query heads, 2 kv heads, head_dim 16, window 256, weights N(0, 0.08) (as tests/checkpoints.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoints import VOCAB, save_tokenizer  # noqa: E402  (the tests' tokenizer: one builder, not a copy)

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
             tie_word_embeddings=False)
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def write(family: str, path: Path, seed: int = 0) -> Path:
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**SIZES, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=list(FAMILIES), help="the architecture of the checkpoint")
    parser.add_argument("out", type=Path, metavar="OUT_FOLDER", help="folder the checkpoint is written to")
    args = parser.parse_args()
    print(write(args.family, args.out))
