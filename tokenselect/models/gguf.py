"""Read a GGUF file (llama.cpp's format): the model's config from its metadata, its weights dequantized
one tensor at a time with the ``gguf`` package, and its tokenizer and chat template through transformers.

llama.cpp names tensors its own way (``blk.3.attn_q.weight``) and stores each weight as ggml lays it out:
the shape reversed (``[in, out]``) and, for the ``llama`` architecture only, the rows of q and k permuted
so that each head's two rotary halves interleave (llama.cpp's rotary layout). ``hf_name`` and
``_unpermute`` undo both, so the tensors come out exactly as a Hugging Face checkpoint holds them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..errors import CheckpointError

MAGIC = b"GGUF"
# GGUF architecture -> the Hugging Face architecture our model file runs it as. Mistral checkpoints are
# converted with the ``llama`` architecture.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = {"llama"}  # architectures whose q/k rows llama.cpp's converter interleaves

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1-style per-frequency divisors, read into the config
LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face one (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for a name we do not know."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    match = LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        return None
    layer, part, leaf = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{leaf}"


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head its rows are stored as pairs (i, i + d/2)
    interleaved; Hugging Face keeps the first half of every head's rows, then the second.
    w: [n_heads * head_dim, ...] (a weight or a bias) -> the same shape."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: ``config`` (a Hugging Face-style config dict), ``tensors()`` and
    ``tokenizer()``. Nothing is dequantized until ``tensors()`` is iterated."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, IndexError, OSError) as e:  # the reader slices a memory map past its end
            raise CheckpointError(f"{self.path}: cannot read the GGUF file; truncated or corrupt ({e})") from None
        self._check_complete()
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: architecture {self.arch!r} is not supported; "
                                  f"supported: {', '.join(ARCHITECTURES)}")
        self.config = self._config()

    def _check_complete(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                      f"{t.data_offset + t.n_bytes:,} of a {size:,}-byte file")

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _config(self) -> dict:
        """The metadata as a Hugging Face config dict, which ``ModelConfig.from_dict`` reads."""
        arch = self.arch
        key = lambda name, default=None: self._field(f"{arch}.{name}", default)  # noqa: E731
        names = {t.name for t in self.reader.tensors}
        hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
        n_kv = key("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):
            if len(set(n_kv)) != 1:
                raise CheckpointError(f"{self.path}: layers with different KV head counts are not supported")
            n_kv = n_kv[0]
        head_dim = int(key("attention.key_length", hidden // n_heads))
        rotary = int(key("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise CheckpointError(f"{self.path}: partial rotary embeddings ({rotary} of {head_dim} dims) "
                                  "are not supported")
        n_vocab = key("vocab_size", 0) or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = [self._field(k, -1) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
        scaling = key("rope.scaling.type", "none")
        if scaling in ("linear", "yarn"):
            rope.update(rope_type=scaling, factor=float(key("rope.scaling.factor")))
            if scaling == "yarn":
                rope["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        elif scaling != "none":
            raise CheckpointError(f"{self.path}: rope scaling {scaling!r} is not supported")
        if ROPE_FACTORS in names:
            rope["freq_factors"] = self._dequantized(self._tensor(ROPE_FACTORS)).tolist()
        return {
            "architectures": [ARCHITECTURES[arch]],
            "vocab_size": int(n_vocab),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(n_kv),
            "head_dim": head_dim,
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_output.bias" in names or (arch == "llama" and "blk.0.attn_q.bias" in names),
            "mlp_bias": "blk.0.ffn_down.bias" in names,
            "rope_parameters": rope,
            "max_position_embeddings": int(key("context_length")),
            "eos_token_id": [int(e) for e in dict.fromkeys(eos) if e is not None and int(e) >= 0],
            # the compute dtype on a GPU (``resolve_dtype``): fp16 keeps 3 more mantissa bits than bf16, which
            # small quantized models need; the file's own types vary per tensor
            "dtype": "float16",
        }

    def _tensor(self, name: str):
        return next(t for t in self.reader.tensors if t.name == name)

    def _dequantized(self, t) -> np.ndarray:
        """One tensor in fp32 with the Hugging Face shape (GGUF lists the dimensions fastest first)."""
        from gguf import quants

        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which this "
                                  "version of the gguf package cannot dequantize") from None
        data = data.astype(np.float32, copy=False)
        if not data.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            data = data.copy()
        return data.reshape(tuple(int(d) for d in reversed(t.shape)))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 tensor) for every weight, in file order, dequantized a few ahead on
        worker threads (numpy releases the GIL), so only a handful of fp32 tensors exist at once."""
        jobs = []
        for t in self.reader.tensors:
            if t.name == ROPE_FACTORS:
                continue
            name = hf_name(t.name)
            if name is None:
                raise CheckpointError(f"{self.path}: unexpected tensor {t.name!r} for architecture {self.arch!r}")
            jobs.append((t, name))
        workers = max(1, min(4, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            window: deque = deque()
            for t, name in jobs:
                window.append((t, name, pool.submit(self._dequantized, t)))
                if len(window) > workers:
                    yield self._finish(*window.popleft())
            while window:
                yield self._finish(*window.popleft())

    def _finish(self, t, name: str, future) -> tuple[str, torch.Tensor]:
        tensor = torch.from_numpy(future.result())
        part = LAYER_NAME.fullmatch(t.name)
        if self.arch in PERMUTED and part is not None and part.group(2) in ("attn_q", "attn_k"):
            heads = self.config["num_attention_heads" if part.group(2) == "attn_q" else "num_key_value_heads"]
            tensor = _unpermute(tensor, heads)
        return name, tensor

    def tokenizer(self):
        """The file's tokenizer and chat template, built by transformers from the GGUF metadata.

        Building it takes seconds to half a minute for a large vocabulary (transformers reads the whole metadata
        again and converts it), so the result is saved once under ``tokenizer_folder`` and later calls, in this
        process or another, load that in under a second."""
        from transformers import AutoTokenizer

        saved = tokenizer_folder(self.path)
        if saved.is_dir():
            try:
                return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
            except Exception:  # noqa: BLE001  an unreadable saved copy: build it again, and save it anew
                shutil.rmtree(saved, ignore_errors=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                      local_files_only=True)
        except Exception as e:  # transformers raises many types for a tokenizer it cannot build
            raise CheckpointError(f"{self.path}: could not build the tokenizer from the GGUF metadata: {e}") from None
        save_tokenizer(tokenizer, saved)
        return tokenizer


def tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer built from the GGUF file ``path`` is kept: ``$TOKENSELECT_HOME/tokenizers/KEY``, KEY a
    hash of the file's resolved path, size and modification time and of transformers' version, so that a changed
    file or another transformers builds it afresh."""
    import transformers

    from .registry import home

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return home() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Save ``tokenizer`` into ``folder``, whole or not at all, and only a copy that loads back as the very same
    tokenizer. It is saved as the generic fast tokenizer of its ``tokenizer.json``: a model's own class (e.g.
    transformers 5's ``Qwen2Tokenizer``) would rebuild its normalizer and pre-tokenizer from the class's defaults
    on loading (NFC where the GGUF's has none), another tokenizer than the one built from the file. Written beside
    ``folder`` under a name of this process's own, then renamed (processes saving side by side never see each
    other's half-written files). A folder that cannot be written only means the next start builds it again."""
    from transformers import AutoTokenizer

    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    try:
        tokenizer.save_pretrained(str(partial))
        config_file = partial / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
        if same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(str(partial), local_files_only=True)):
            partial.replace(folder)
    except Exception:  # noqa: BLE001  a read-only cache, a full disk, another process's copy already in place, or
        pass  # a copy transformers cannot load back: the tokenizer built from the file serves all the same
    shutil.rmtree(partial, ignore_errors=True)


def same_tokenizer(built, loaded) -> bool:
    """Whether ``loaded`` is ``built``: the same tokenizers pipeline (normalizer, pre-tokenizer, model, post-processor,
    decoder, added tokens), special tokens, chat template and decoding's space clean-up."""
    return (built.backend_tokenizer.to_str() == loaded.backend_tokenizer.to_str()
            and built.all_special_tokens == loaded.all_special_tokens
            and all(getattr(built, name, None) == getattr(loaded, name, None)
                    for name in ("chat_template", "clean_up_tokenization_spaces")))
