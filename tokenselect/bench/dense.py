"""Dense attention as a conventional engine runs it: the end-to-end benchmark's baseline.

Keys are rotated once, when they are cached; each layer's cache is one contiguous tensor
``[n_kv_heads, max_tokens, head_dim]``; attention is PyTorch SDPA (the flash backend on CUDA) with a
bottom-right causal mask for a prefill chunk. The same model object and weights as the engine run
underneath, prefill chunks through the same model runner and its CUDA graphs (``runner.py``): only the
attention context differs, so the benchmark's dense-vs-policy ratios measure attention and selection, nothing else. One
sequence at a time.

On CUDA in bf16 or fp16 a decode step runs as one CUDA graph, as a serving engine runs it and as the
policies' whole steps run (``cuda_graphs.py``): the token's position is a device tensor, the cache is written at it,
and flash attention (``aten::_flash_attention_forward``, variable-length form) reads how many keys are live
from ``seqused_k`` on the device, so one graph serves every step. SDPA itself takes the key length from the
tensors' shapes, which a graph would fix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..cuda_graphs import capture, warm_up
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
        self.runner = llm.runner  # the engine's forward pass and CUDA graphs, as the policies run them
        # flash wherever it applies (bf16, fp16: what the benchmark runs); other dtypes on a GPU (fp32, in
        # the tests) fall back to the next kernel that takes them
        self.backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                         if llm.device.type == "cuda" else [SDPBackend.MATH])
        self.length = 0  # tokens cached
        self._positions = None
        # decode steps as one graph: flash attention with the key length on the device
        self.flash_decode = (self.device.type == "cuda" and self.runner.graphs is not None
                             and llm.dtype in (torch.bfloat16, torch.float16))
        self.decode_graph: torch.cuda.CUDAGraph | None = None
        if self.flash_decode:
            self._token = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._position = torch.zeros(1, dtype=torch.int64, device=self.device)
            # one query, one sequence of max_tokens slots, of which position + 1 are live (seqused_k)
            self._cu_q = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
            self._cu_k = torch.tensor([0, max_tokens], dtype=torch.int32, device=self.device)
            self._logits: torch.Tensor | None = None

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's attention context. q: [c, n_heads, d], k, v: [c, n_kv_heads, d] -> [c, n_heads, d]."""
        if self.flash_decode and q.shape[0] == 1:
            return self.decode_attention(layer, q, k, v)
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

    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One token at the device position ``self._position`` (nothing read on the host: a graph's step).
        q: [1, n_heads, d], k, v: [1, n_kv_heads, d] -> [1, n_heads, d]."""
        pos = self._position
        inv_freq, scale = self.rope(pos)
        self.k[layer].index_copy_(1, pos, rotate(k, pos, inv_freq, scale).transpose(0, 1))
        self.v[layer].index_copy_(1, pos, v.transpose(0, 1))
        slots = self.k.shape[2]  # [slots, n_kv_heads, d] views of the head-major cache
        return torch.ops.aten._flash_attention_forward(
            rotate(q, pos, inv_freq, scale), self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1),
            self._cu_q, self._cu_k, 1, slots, 0.0, False, False, seqused_k=(pos + 1).to(torch.int32))[0]

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """One decode step as a CUDA graph (recorded on the first: a run on a side stream, then the capture,
        whose cache writes repeat the run's) -> logits [vocab]."""
        self._token.copy_(token)
        self._position.fill_(self.length)
        if self.decode_graph is None:
            warm_up(lambda: self.model(self._token, self))
            self.decode_graph, self._logits = capture(lambda: self.model(self._token, self), None)
        self.decode_graph.replay()
        self.length += 1
        return self._logits[0]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the next tokens ``ids: [c]`` -> logits of the last one, ``[vocab]`` (fp32)."""
        c = ids.numel()
        if self.flash_decode and c == 1:
            return self.decode(ids)
        self._positions = torch.arange(self.length, self.length + c, device=self.device)
        logits = self.model.logits(self.runner.hidden(ids, self, torch.tensor([c - 1], device=self.device)))[0]
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
