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


@pytest.fixture(autouse=True)
def empty_tokenselect_home(request, tmp_path, monkeypatch):
    """Every test sees an empty cache folder ($TOKENSELECT_HOME): no model fetched earlier changes what the demo
    picks, and no test writes into the user's cache. Tests marked ``model_cache`` use the real one, so that the
    registry models are downloaded once and reused by later runs."""
    if request.node.get_closest_marker("model_cache") is None:
        monkeypatch.setenv("TOKENSELECT_HOME", str(tmp_path / "tokenselect-home"))


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


@pytest.fixture
def batch_invariant_matmuls(monkeypatch):
    """Make every linear layer compute row by row, so a row's result does not depend on the batch.

    A CPU BLAS rounds a row of ``x @ W.T`` differently for different numbers of rows (1e-6 in fp32).
    Full attention shrugs that off, but a selection policy's discrete choice (top-k over close
    votes, a cosine threshold) can flip on it, so a sequence batched with others may then pick a
    different token than alone. Tests of the per-sequence batching logic pin the rounding with this.
    """
    linear = torch.nn.functional.linear

    def rowwise(x, weight, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < 2:
            return linear(x, weight, bias)
        out = torch.cat([linear(rows[i:i + 1], weight, bias) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(torch.nn.functional, "linear", rowwise)
