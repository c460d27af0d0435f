"""Load a model from disk: a Hugging Face checkpoint folder (safetensors, single or sharded) or a GGUF file
(``gguf.py``), its weights and its tokenizer."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from .. import parallel
from ..config import ModelConfig
from ..errors import CheckpointError
from ..kernels.fp8_quant import FP8
from .fp8 import quantized_state, use_fp8_weights
from .gguf import GGUFCheckpoint, is_gguf
from .llama import FUSED, CausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device named (None: CUDA where there is one, else the CPU), as its tensors report it: cuda:0, not cuda."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """``auto``/None: fp32 on CPU (bf16 matmuls are slow there); elsewhere bf16, or fp16 where the checkpoint's
    own dtype (``stored``) is fp16. A GGUF file says fp16 (``gguf.py``): bf16 rounding of its dequantized
    weights and activations changes a small model's answers (SmolLM2-135M's logits move by up to 1.2 against
    fp32, 0.14 in fp16, and on the H100 it answers the capital of France with "L'Etoile, la Marseillaise").
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if stored in ("float16", "fp16") else torch.bfloat16
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


def _safetensors(path: Path):
    """(name, tensor) for every tensor of a checkpoint folder's safetensors files."""
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(cfg: ModelConfig, tensors, dtype: torch.dtype, device: torch.device, where: str,
                tp=None, fp8_weights: bool = False) -> CausalLM:
    """Build the model for ``cfg`` and fill it from ``tensors``, (Hugging Face name, tensor) pairs read one
    at a time. A stacked projection is allocated once on the device and each of its parts copied into its
    rows as it arrives (``checkpoint_parts``), so loading holds no second copy of the weights.
    ``where`` names the checkpoint in errors. tp: a ``parallel.TensorParallel``: the rank's shard of the model,
    each tensor cut to the rank's part as it is read (``parallel.shard_tensor``). fp8_weights: the projections
    as ``fp8.Fp8Linear``, each quantized as soon as its last part is read, so that a projection is held in ``dtype``
    only while its parts arrive: a model loads whose 16-bit weights would not fit the device."""
    if tp is not None:
        tensors = ((name, parallel.shard_tensor(name, t, tp.rank, tp.world)) for name, t in tensors)
    with torch.device("meta"):
        model = CausalLM(cfg if tp is None else parallel.local_config(cfg, tp.world))
        if tp is not None:
            parallel.parallelize(model, tp, cfg.vocab_size)
        if fp8_weights:
            use_fp8_weights(model)
    expected = dict(model.named_parameters())
    parts = {name: (param, rows) for param in expected for name, rows in checkpoint_parts(model, param)}
    unread = Counter(param for param, _ in parts.values())  # each parameter's parts not yet read
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in parts:
            continue
        param, rows = parts[name]
        shape = expected[param][rows].shape
        if tensor.shape != shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(tensor.shape)}, config says {tuple(shape)}")
        if rows == slice(None):
            state[param] = tensor.to(device=device, dtype=dtype)
        else:
            if param not in state:
                state[param] = torch.empty(expected[param].shape, dtype=dtype, device=device)
            state[param][rows].copy_(tensor)
        seen.add(name)
        unread[param] -= 1
        if not unread[param] and expected[param].dtype == FP8:
            state.update(quantized_state(param, state.pop(param)))
    if cfg.tie_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        seen.add("lm_head.weight")
    missing = sorted(set(parts) - seen)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{where}: weights missing from the checkpoint: {shown}")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


class Checkpoint:
    """A model on disk, a Hugging Face folder or a GGUF file: its ``config``, ``load(dtype, device)`` and
    ``tokenizer()``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.gguf = GGUFCheckpoint(self.path) if is_gguf(self.path) else None
        if self.gguf is None and self.path.is_file():
            raise CheckpointError(f"{self.path} is neither a Hugging Face checkpoint folder nor a GGUF file")
        self.config = (ModelConfig.from_dict(self.gguf.config) if self.gguf is not None
                       else ModelConfig.from_folder(self.path))

    def load(self, dtype: torch.dtype, device: torch.device, tp=None, fp8_weights: bool = False) -> CausalLM:
        """The model (with ``tp``, a ``parallel.TensorParallel``: this rank's shard of it; with ``fp8_weights``, its
        projections in fp8, ``build_model``)."""
        tensors = self.gguf.tensors() if self.gguf is not None else _safetensors(self.path)
        return build_model(self.config, tensors, dtype, device, str(self.path), tp, fp8_weights)

    def tokenizer(self):
        return self.gguf.tokenizer() if self.gguf is not None else load_tokenizer(self.path)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, tp=None) -> CausalLM:
    """A model of ``cfg``'s shape with random weights (std 0.02, norms at 1), built on ``device``. With ``tp``
    (``parallel.TensorParallel``) the rank's shard, drawn from a seed of its own (not a shard of the model one
    process would draw: the benchmarks time it, whatever its values)."""
    if tp is not None:
        vocab, cfg, seed = cfg.vocab_size, parallel.local_config(cfg, tp.world), seed + tp.rank
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    if tp is not None:
        parallel.parallelize(model, tp, vocab)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` (``[{"role", "content"}, ...]``) in the tokenizer's chat template, ending
    with the opening of the assistant's turn. The template writes its own special tokens (a BOS among them,
    where it has one), so the tokenizer adds none."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
