"""The model runner: the one place a step's forward pass runs, eagerly or through CUDA graphs.

A step (decode tokens and prefill chunks of several sequences, flattened) runs one of three ways, chosen here:

- as one whole-step graph (``whole_graphs.py``): decode steps of up to 8 sequences and a long prompt's full
  prefill chunks, once their policy's list keeps its length (attention and selection inside the graph);
- through the piecewise graphs (``step_graphs.py``), per token-count bucket: everything between two attention
  calls captured, attention run eagerly between the pieces (mixed batches, steps of policies that are not
  graph-ready, dynamic NTK);
- eagerly, layer by layer (no CUDA graphs, or a step larger than the largest bucket).

The dense baseline (``bench/dense.py``) runs its prefill through ``hidden`` too, with its own attention context,
so that its ratios against the engine measure attention alone. All graphs are recorded by ``cuda_graphs.py``.
"""

from __future__ import annotations

import torch

from .attention import BatchAttention, RopeFrequencies
from .kernels import Kernels
from .kv_cache import KVCache
from .models.llama import AttentionContext, CausalLM
from .step_graphs import StepGraphs
from .transfer import to_device
from .whole_graphs import WholeGraphs


class ModelRunner:
    """``logits(chunks, ids, new_slots, logit_rows)``: one engine step's forward pass."""

    def __init__(self, model: CausalLM, cache: KVCache, kernels: Kernels, rope: RopeFrequencies,
                 device: torch.device, chunk_size: int, cuda_graphs: bool):
        """cuda_graphs: run steps through the graphs (recorded on a GPU; on a CPU the same step functions run
        eagerly over the same buffers, which is how the tests exercise them)."""
        self.model, self.cache, self.kernels, self.rope, self.device = model, cache, kernels, rope, device
        self.pieces = StepGraphs(model, device, chunk_size) if cuda_graphs else None
        self.whole = WholeGraphs(model, cache, kernels, rope, device, chunk_size) if cuda_graphs else None

    def logits(self, chunks, ids: list[int], new_slots: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """chunks: the step's ``attention.Chunk``s over the flat batch ids (host list), whose tokens are cached at
        new_slots -> logits [len(logit_rows), vocab] (fp32) of the rows asked for."""
        if self.whole is not None and self.whole.usable(chunks):
            return self.model.logits(self.whole.run(chunks, ids, new_slots)[logit_rows])
        cfg = self.model.config
        ctx = BatchAttention(self.cache, self.kernels, self.rope, chunks, new_slots, (cfg.n_heads, cfg.head_dim),
                             self.model.model.embed_tokens.weight.dtype)
        return self.model.logits(self.hidden(to_device(ids, self.device), ctx, logit_rows))

    def hidden(self, ids: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor) -> torch.Tensor:
        """The last layer's output at ``rows`` of the tokens ``ids: [n]``, attention through ``ctx``: through the
        piecewise graphs where a bucket holds the step, else eagerly."""
        if self.pieces is not None and self.pieces.bucket(ids.numel()) is not None:
            return self.pieces.run(ids, ctx)[rows]
        return self.model.hidden(ids, ctx)[rows]

    def clear(self) -> None:
        """Drop the whole-step graphs (the policies they were recorded for are being replaced)."""
        if self.whole is not None:
            self.whole.clear()
