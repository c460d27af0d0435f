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


@pytest.fixture(autouse=True)
def modest_kv_pools(request, monkeypatch):
    """An engine's default KV pool takes 85% of the GPU memory it finds free. ``benchmarks/gpu_tests.sh`` runs
    several pytest processes side by side on one GPU, and there one test's engines (a tiny model's pool of 200M
    tokens, 56 GB) left too little for the others: two tests failed out of memory, in a process that was not
    theirs. In the tests an engine takes 5% (7 GB of an H200's free memory: millions of a tiny model's tokens, and
    300K of SmolLM2's). On a CPU the pool has its own fixed limit, so this changes nothing there. Tests of the
    default itself are marked ``product_pool``."""
    from tokenselect import engine

    if request.node.get_closest_marker("product_pool") is None:
        monkeypatch.setattr(engine, "GPU_MEMORY_FRACTION", 0.05)


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
