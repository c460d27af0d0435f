"""Decoder models that read Hugging Face checkpoint folders."""

from .llama import CausalLM
from .loader import load_model, load_tokenizer

__all__ = ["CausalLM", "load_model", "load_tokenizer"]
