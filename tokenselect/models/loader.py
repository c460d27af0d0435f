"""Load a Hugging Face checkpoint folder: safetensors weights (single file or sharded) and tokenizer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import CheckpointError
from .llama import FUSED, CausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``/None: fp32 on CPU (bf16 matmuls are slow there), bf16 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def checkpoint_parts(model: CausalLM, param: str) -> list[tuple[str, slice]]:
    """The checkpoint tensors a parameter is made of, each with the rows of the parameter it fills: its own
    name (every row), or for a stacked projection (``FUSED``) its parts in stacking order
    (``...self_attn.qkv_proj.weight`` -> ``...q_proj.weight`` rows 0..4095, ``...k_proj.weight``, ...)."""
    module, _, leaf = param.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj not in FUSED:
        return [(param, slice(None))]
    sizes = model.get_submodule(parent).sizes
    starts = itertools.accumulate(sizes, initial=0)
    return [(f"{parent}.{part}.{leaf}", slice(start, start + size))
            for part, start, size in zip(FUSED[proj], starts, sizes)]


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model from config.json and fill it from the safetensors files by tensor name. A stacked
    projection is allocated once on the device and each of its parts copied into its rows as it is read
    (``checkpoint_parts``), so loading holds no second copy."""
    path = Path(path)
    cfg = ModelConfig.from_folder(path)
    files = _weight_files(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters())
    where = {name: (param, rows) for param in expected for name, rows in checkpoint_parts(model, param)}
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in where:
                    continue
                param, rows = where[name]
                tensor, shape = f.get_tensor(name), expected[param][rows].shape
                if tensor.shape != shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, config says {tuple(shape)}")
                if rows == slice(None):
                    state[param] = tensor.to(device=device, dtype=dtype)
                else:
                    if param not in state:
                        state[param] = torch.empty(expected[param].shape, dtype=dtype, device=device)
                    state[param][rows].copy_(tensor)
                seen.add(name)
    if cfg.tie_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        seen.add("lm_head.weight")
    missing = sorted(set(where) - seen)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{path}: weights missing from the checkpoint: {shown}")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """A model of ``cfg``'s shape with random weights (std 0.02, norms at 1), built on ``device``."""
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str | Path):
    """The checkpoint's own tokenizer (and chat template) through transformers, offline."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        raise CheckpointError(f"{path}: could not load the tokenizer: {e}") from None
    tokenizer.model_max_length = 1 << 62  # prompts past the trained window are the point: no length warning
    return tokenizer
