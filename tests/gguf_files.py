"""Write tiny GGUF files from tiny Hugging Face checkpoints, as llama.cpp's converter does: its tensor names,
ggml's reversed shapes, q/k rows interleaved for the ``llama`` architecture, the tokenizer in the metadata.
The files are then read by our loader and, independently, by transformers' own GGUF loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{leaf}"


def interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``permute``: each head's rows (first half, second half) -> pairs interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, out: Path, arch: str = "llama", qtype: str = "F32", *, rope_factors=None,
               skip: tuple[str, ...] = (), extra_tensor=None) -> Path:
    """Convert the checkpoint in ``folder`` (config.json, model.safetensors, tokenizer.json) to ``out``.

    qtype: the type of every 2-D weight (F32, F16, BF16, Q8_0, Q4_0, Q5_1, ...); norms and biases stay F32.
    rope_factors: written as ``rope_freqs.weight``. skip: tensor names left out. extra_tensor: (name, raw
    bytes as uint8, ggml type) added raw."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([added.get(i, t) for t, i in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for hf, tensor in state.items():
        name = gguf_name(hf)
        if name in skip:
            continue
        data = tensor.to(torch.float32).numpy()
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if arch == "llama" and part in heads:
            data = interleave(data, heads[part])
        ggml = gguf.GGMLQuantizationType[qtype] if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(data, ggml), raw_dtype=ggml)
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    if extra_tensor is not None:
        name, raw, ggml = extra_tensor
        w.add_tensor(name, raw, raw_dtype=ggml)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
