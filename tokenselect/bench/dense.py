"""Dense attention as a conventional engine runs it: the end-to-end benchmark's baseline.

Keys are rotated once, when they are cached; each layer's cache is one contiguous tensor
``[n_kv_heads, max_tokens, head_dim]``; attention is PyTorch SDPA (the flash backend on CUDA) with a
bottom-right causal mask for a prefill chunk. The same model object and weights as the engine run
underneath, through the same CUDA graphs (``step_graphs.py``): only the
attention context differs, so the benchmark's dense-vs-policy ratios measure attention and
selection, nothing else. One sequence at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..rope import rotate


class DenseRunner:
    """Prefill and decode one sequence of ``llm``'s model with dense SDPA over a contiguous cache."""

    def __init__(self, llm, max_tokens: int):
        if llm.rope.spec.kind == "dynamic":
            raise ValueError("the dense baseline caches rotated keys: dynamic NTK, whose frequencies change "
                             "with the length, would rotate old and new keys differently")
        cfg = llm.config
        shape = (cfg.n_layers, cfg.n_kv_heads, max_tokens, cfg.head_dim)
        self.k = torch.empty(shape, dtype=llm.dtype, device=llm.device)
        self.v = torch.empty(shape, dtype=llm.dtype, device=llm.device)
        self.model, self.rope, self.device = llm.model, llm.rope, llm.device
        self.graphs = llm.graphs  # the engine's CUDA graphs, as the policies run them
        # flash wherever it applies (bf16, fp16: what the benchmark runs); other dtypes on a GPU (fp32, in
        # the tests) fall back to the next kernel that takes them
        self.backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                         if llm.device.type == "cuda" else [SDPBackend.MATH])
        self.length = 0  # tokens cached
        self._positions = None

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's attention context. q: [c, n_heads, d], k, v: [c, n_kv_heads, d] -> [c, n_heads, d]."""
        t, c = self.length, q.shape[0]
        inv_freq, scale = self.rope(self._positions)
        q = rotate(q, self._positions, inv_freq, scale)
        self.k[layer, :, t:t + c] = rotate(k, self._positions, inv_freq, scale).transpose(0, 1)
        self.v[layer, :, t:t + c] = v.transpose(0, 1)
        mask = causal_lower_right(c, t + c) if c > 1 else None
        with sdpa_kernel(self.backends):
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k[layer, :, :t + c][None],
                                                 self.v[layer, :, :t + c][None], attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the next tokens ``ids: [c]`` -> logits of the last one, ``[vocab]`` (fp32)."""
        c = ids.numel()
        self._positions = torch.arange(self.length, self.length + c, device=self.device)
        if self.graphs is not None and self.graphs.bucket(c) is not None:
            logits = self.model.logits(self.graphs.run(ids, self)[c - 1:])[0]
        else:
            logits = self.model(ids, self, torch.tensor([c - 1], device=self.device))[0]
        self.length += c
        return logits

    def prefill(self, ids: list[int], chunk_size: int) -> torch.Tensor:
        """The prompt in chunks of ``chunk_size`` -> logits of its last token."""
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for start in range(0, len(ids), chunk_size):
            logits = self.forward(t[start:start + chunk_size])
        return logits

    def generate(self, ids: list[int], chunk_size: int, max_tokens: int) -> list[int]:
        """Greedy: prefill ``ids``, then ``max_tokens`` new token ids."""
        out = [int(self.prefill(ids, chunk_size).argmax())]
        while len(out) < max_tokens:
            out.append(int(self.forward(torch.tensor(out[-1:], device=self.device)).argmax()))
        return out
