"""Decoder models read from Hugging Face checkpoint folders and GGUF files (``loader.Checkpoint``)."""

from .llama import CausalLM
from .loader import load_tokenizer

__all__ = ["CausalLM", "load_tokenizer"]
