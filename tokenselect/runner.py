"""The model runner: the one place a step's forward pass runs, eagerly or through CUDA graphs.

A step (decode tokens and prefill chunks of several sequences, flattened) runs one of three ways, chosen here:
as one whole-step graph, through the piecewise graphs around attention (both kept by ``cuda_graphs.GraphCache``),
or eagerly, layer by layer (no CUDA graphs, or a step larger than the largest piecewise size). The dense
baseline (``bench/dense.py``) runs its prefill through ``hidden`` too, with its own attention context, so that
its ratios against the engine measure attention alone.
"""

from __future__ import annotations

import torch

from .attention import BatchAttention, RopeFrequencies
from .cuda_graphs import GraphCache
from .kernels import Kernels
from .kv_cache import KVCache
from .models.llama import AttentionContext, CausalLM
from .transfer import to_device


class ModelRunner:
    """``logits(chunks, ids, new_slots, logit_rows)``: one engine step's forward pass."""

    def __init__(self, model: CausalLM, cache: KVCache, kernels: Kernels, rope: RopeFrequencies,
                 device: torch.device, chunk_size: int, cuda_graphs: bool):
        """cuda_graphs: run steps through the graphs (recorded on a GPU; on a CPU the same step functions run
        eagerly over the same buffers, which is how the tests exercise them)."""
        self.model, self.cache, self.kernels, self.rope, self.device = model, cache, kernels, rope, device
        self.graphs = GraphCache(model, cache, kernels, rope, device, chunk_size) if cuda_graphs else None
        self.passes = 0  # forward passes queued so far (a profile's steps: some may not have been read yet)

    def logits(self, chunks, ids: list[int] | torch.Tensor, new_slots: torch.Tensor,
               logit_rows: torch.Tensor) -> torch.Tensor:
        """chunks: the step's ``attention.Chunk``s over the flat batch ids (a host list, or int64 [n] on the device:
        a step launched before this one has not been read), whose tokens are cached at new_slots -> logits
        [len(logit_rows), vocab] (fp32) of the rows asked for."""
        ids = ids if isinstance(ids, torch.Tensor) else to_device(ids, self.device)
        self.passes += 1
        if self.graphs is not None and self.graphs.whole(chunks):
            return self.model.logits(self.graphs.run_whole(chunks, ids, new_slots)[logit_rows])
        cfg = self.model.config
        ctx = BatchAttention(self.cache, self.kernels, self.rope, chunks, new_slots, (cfg.n_heads, cfg.head_dim),
                             self.model.model.embed_tokens.weight.dtype)
        return self.model.logits(self.hidden(ids, ctx, logit_rows))

    def hidden(self, ids: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor) -> torch.Tensor:
        """The last layer's output at ``rows`` of the tokens ``ids: [n]``, attention through ``ctx``: through the
        piecewise graphs where a size holds the step, else eagerly."""
        if self.graphs is not None and self.graphs.bucket(ids.numel()) is not None:
            return self.graphs.run_layers(ids, ctx)[rows]
        return self.model.hidden(ids, ctx)[rows]

    def clear(self) -> None:
        """Drop the whole-step graphs (the policies they were recorded for are being replaced)."""
        if self.graphs is not None:
            self.graphs.clear()

    def release(self) -> None:
        """Drop every CUDA graph (``GraphCache.release``); later steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
