"""Shared fixtures: tiny random checkpoints of every supported family, saved with transformers.

Triton kernels run in the CPU interpreter when there is no GPU; TRITON_INTERPRET must be set
before anything imports triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make(family="llama", **config_overrides) -> path of a saved tiny checkpoint (cached per config)."""
    made = {}

    def make(family: str = "llama", **overrides):
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory):
    """A 2-layer Llama with GQA 2, head_dim 16, window 256."""
    return checkpoint_factory("llama")
