"""Model configuration read from a Hugging Face checkpoint folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .rope import RopeSpec

# HF architecture name -> the family switches our one model file understands.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),  # bias from config.attention_bias
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),  # q/k/v bias, o_proj without
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),  # RMSNorm over head_dim on q and k
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool  # bias on q, k, v projections
    o_bias: bool  # bias on the output projection (Llama's attention_bias)
    mlp_bias: bool
    qk_norm: bool
    rope: RopeSpec
    window: int  # the context the model was trained for (max_position_embeddings)
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"model folder not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias if family["qkv_bias"] is None else family["qkv_bias"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family["qk_norm"],
            rope=RopeSpec.from_hf(cfg, head_dim),
            window=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=eos,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )
