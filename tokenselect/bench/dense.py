"""Dense attention as a conventional engine runs it: the benchmarks' baseline.

Keys are rotated once, when they are cached; the cache holds ``batch`` sequences, each in ``max_tokens``
contiguous rows, ``k, v: [n_layers, batch, max_tokens, n_kv_heads, head_dim]`` (token-major, flash attention's
own layout). A prefill chunk's attention is PyTorch SDPA, causal bottom-right (``causal_attention``), by the backend
named (``sdpa``: flash, or cuDNN, the faster on Hopper; ``auto`` picks cuDNN there). The same model object and
weights as the engine run underneath, prefill chunks through the same model runner and its CUDA graphs
(``runner.py``): only the attention context differs, so the benchmarks' dense-vs-policy ratios measure attention and
selection, nothing else.

A prompt is prefilled one sequence at a time (``prefill(ids, chunk_size, seq)``); a decode step
(``decode(tokens)``) runs one token of each of the first ``n`` sequences, as a serving engine batches them.
On CUDA in bf16 or fp16 a decode step runs as one CUDA graph per ``n``, as a serving engine runs it and as the
policies' whole steps run (``cuda_graphs.py``): the tokens' positions are a device tensor, the cache is written
at them, and flash attention (``aten::_flash_attention_forward``, variable-length form: query ``i`` is sequence
``i``, whose keys start at row ``i * max_tokens`` of the layer's cache seen as ``[batch * max_tokens, n_kv_heads,
head_dim]``) reads how many keys of each are live from ``seqused_k`` on the device, so one graph serves every
step. SDPA itself takes the key length from the tensors' shapes, which a graph would fix. Elsewhere (a CPU, fp32)
a decode step runs the same code eagerly, with ``varlen_decode_reference`` in place of the flash kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..cuda_graphs import capture, warm_up
from ..kernels.cudnn_attention import CUDNN_DTYPES, chunk_by_cudnn, cudnn_preferred
from ..rope import rotate


SDPA_CHOICES = ("auto", "flash", "cudnn")


def sdpa_backend(sdpa: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The SDPA backend a dense prefill of ``dtype`` runs (``causal_attention``): ``flash`` or ``cudnn`` as named;
    ``auto``: cuDNN where it is the faster (``kernels.cudnn_attention.cudnn_preferred``: a Hopper GPU, where it ran
    a 512-query chunk over 1M keys in 14.8 ms against flash's 30.2 and a 128K prompt's one pass 1.7x faster,
    results/supporting/dense_backends_h200.md), flash elsewhere and for a dtype cuDNN does not take (it takes bf16
    and fp16; flash's path falls back to the next backend that takes fp32)."""
    if sdpa not in SDPA_CHOICES:
        raise ValueError(f"sdpa={sdpa!r}: one of {', '.join(SDPA_CHOICES)}")
    if sdpa == "cudnn" and device.type != "cuda":
        raise ValueError(f"sdpa=cudnn runs on a CUDA device, not {device.type}")
    if sdpa == "cudnn" and dtype not in CUDNN_DTYPES:
        raise ValueError(f"sdpa=cudnn takes bf16 or fp16, not {dtype}")
    if sdpa != "auto":
        return sdpa
    return "cudnn" if cudnn_preferred(device, dtype) else "flash"


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sdpa: str = "flash") -> torch.Tensor:
    """Causal attention aligned bottom-right: q [B, H, c, d] over keys, values [B, KV, L, d] (c <= L, keys and
    queries rotated), query i sees keys j <= i + L - c (the queries are the last c tokens); query head h reads kv
    head h // (H // KV), no copy -> [B, H, c, d].

    ``sdpa="flash"``: SDPA's flash backend with the bottom-right mask (where flash cannot run, a CPU or fp32, the
    next backend that can). ``"cudnn"``: cuDNN's kernel, which takes a top-left causal flag and runs an explicit
    mask about 2x slower (33-34 ms against 14.8 for the split at 1M): a chunk after cached tokens runs as two
    calls merged by their log-sum-exps (``kernels.cudnn_attention.chunk_by_cudnn``)."""
    c, L = q.shape[2], keys.shape[2]
    if sdpa == "flash":
        backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if q.is_cuda
                    else [SDPBackend.MATH])
        with sdpa_kernel(backends):
            mask = causal_lower_right(c, L) if c > 1 else None
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    if sdpa != "cudnn":
        raise ValueError(f"sdpa={sdpa!r}: flash or cudnn")
    return chunk_by_cudnn(q, keys, values)


class DenseRunner:
    """Prefill and decode up to ``batch`` sequences of ``llm``'s model with dense attention over a contiguous cache
    of ``max_tokens`` tokens each. With ``batch`` 1 (the default) ``forward``, ``prefill`` and ``generate`` run the
    one sequence. ``sdpa``: a prefill chunk's attention backend (``sdpa_backend``; decode steps run flash's
    variable-length kernel in CUDA graphs, whatever it is)."""

    def __init__(self, llm, max_tokens: int, batch: int = 1, sdpa: str = "auto"):
        if llm.rope.spec.kind == "dynamic":
            raise ValueError("the dense baseline caches rotated keys: dynamic NTK, whose frequencies change "
                             "with the length, would rotate old and new keys differently")
        cfg = llm.config
        shape = (cfg.n_layers, batch, max_tokens, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=llm.dtype, device=llm.device)
        self.v = torch.empty(shape, dtype=llm.dtype, device=llm.device)
        self.batch, self.max_tokens = batch, max_tokens
        self.model, self.rope, self.device = llm.model, llm.rope, llm.device
        self.runner = llm.runner  # the engine's forward pass and CUDA graphs, as the policies run them
        self.sdpa = sdpa_backend(sdpa, llm.device, llm.dtype)
        self.lengths = [0] * batch  # tokens cached, per sequence
        # the eager pass's work: (sequence, first row of its tokens in the pass, how many, positions [c]);
        # None while a decode step runs (``decode_attention``: its positions are ``self._positions``, on the device)
        self._plan: list[tuple[int, int, int, torch.Tensor]] | None = []
        # decode steps as one graph each batch size: flash attention with the key lengths on the device
        self.flash_decode = (self.device.type == "cuda" and self.runner.graphs is not None
                             and llm.dtype in (torch.bfloat16, torch.float16))
        self.decode_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # n -> (graph, its logits)
        self.decode_graph: torch.cuda.CUDAGraph | None = None  # the last decode step's
        # a decode step's inputs on the device: tokens, positions (of which the first ``_positions_known`` equal
        # ``lengths``: a step advances them on the device, with no host copy to wait for)
        self._tokens = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._positions_known = 0
        # query i is sequence i; its keys are rows i * max_tokens ... of the layer's [batch * max_tokens, ...]
        self._cu_q = torch.arange(batch + 1, dtype=torch.int32, device=self.device)
        self._cu_k = self._cu_q * max_tokens
        self._first_row = self._cu_k[:-1].to(torch.int64)

    @property
    def length(self) -> int:
        """Tokens cached of the first sequence (the only one with ``batch`` 1)."""
        return self.lengths[0]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's attention context. q: [n, n_heads, d], k, v: [n, n_kv_heads, d] -> [n, n_heads, d]."""
        if self._plan is None:
            return self.decode_attention(layer, q, k, v)
        out = torch.empty_like(q)
        for seq, row, c, positions in self._plan:
            rows = slice(row, row + c)
            out[rows] = self.sequence_attention(layer, seq, positions, q[rows], k[rows], v[rows])
        return out

    def sequence_attention(self, layer: int, seq: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> torch.Tensor:
        """c tokens of sequence ``seq`` at ``positions: [c]`` (after its cached ones): cache their keys and values,
        attend causally. q: [c, n_heads, d], k, v: [c, n_kv_heads, d] -> [c, n_heads, d]."""
        c, t = q.shape[0], self.lengths[seq]
        inv_freq, scale = self.rope(positions)
        q = rotate(q, positions, inv_freq, scale)
        self.k[layer, seq, t:t + c] = rotate(k, positions, inv_freq, scale)
        self.v[layer, seq, t:t + c] = v
        keys, values = self.k[layer, seq, :t + c].transpose(0, 1), self.v[layer, seq, :t + c].transpose(0, 1)
        out = causal_attention(q.transpose(0, 1)[None], keys[None], values[None], self.sdpa)
        return out[0].transpose(0, 1)

    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One token of each of the first n sequences at the device positions ``self._positions[:n]`` (nothing read
        on the host: a graph's step). q: [n, n_heads, d], k, v: [n, n_kv_heads, d] -> [n, n_heads, d]."""
        n = q.shape[0]
        pos = self._positions[:n]
        inv_freq, scale = self.rope(pos)
        rows = self._first_row[:n] + pos
        keys = self.k[layer, :n].view(n * self.max_tokens, *self.k.shape[3:])  # [n * max_tokens, n_kv_heads, d]
        values = self.v[layer, :n].view(keys.shape)
        keys.index_copy_(0, rows, rotate(k, pos, inv_freq, scale))
        values.index_copy_(0, rows, v)
        q, used = rotate(q, pos, inv_freq, scale), (pos + 1).to(torch.int32)
        if not self.flash_decode:
            return varlen_decode_reference(q, keys, values, self._cu_k[:n + 1], used)
        return torch.ops.aten._flash_attention_forward(q, keys, values, self._cu_q[:n + 1], self._cu_k[:n + 1], 1,
                                                       self.max_tokens, 0.0, False, False, seqused_k=used)[0]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the first n sequences, ``tokens: [n]`` (int64, one each, on the device) -> logits
        [n, vocab] (fp32; with flash decode a static buffer, rewritten by the next step of n). With flash decode a
        graph for each n, recorded on its first step (a run on a side stream, then the capture, whose cache writes
        repeat the run's); otherwise the same step eagerly."""
        n = tokens.numel()
        if not 0 < n <= self.batch or max(self.lengths[:n]) >= self.max_tokens:
            raise ValueError(f"a decode step of {n} sequences of lengths {self.lengths[:n]}: the cache holds "
                             f"{self.batch} of {self.max_tokens} tokens")
        self._tokens[:n].copy_(tokens)
        if self._positions_known < n:
            self._positions[:n].copy_(torch.tensor(self.lengths[:n]))
            self._positions_known = n
        self._plan = None  # attention: ``decode_attention``
        try:
            if self.flash_decode:
                if n not in self.decode_graphs:
                    warm_up(lambda: self.model(self._tokens[:n], self))
                    self.decode_graphs[n] = capture(lambda: self.model(self._tokens[:n], self), None)
                self.decode_graph, logits = self.decode_graphs[n]
                self.decode_graph.replay()
            else:
                logits = self.model.logits(self.runner.hidden(self._tokens[:n], self,
                                                              torch.arange(n, device=self.device)))
        finally:
            self._plan = []
        self._positions[:n] += 1
        self.lengths[:n] = [t + 1 for t in self.lengths[:n]]
        return logits

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, seq: int = 0) -> torch.Tensor:
        """Run the next tokens ``ids: [c]`` of sequence ``seq`` -> logits of the last one, ``[vocab]`` (fp32). One
        token of the first sequence is a decode step of one (``decode``)."""
        c = ids.numel()
        if self.lengths[seq] + c > self.max_tokens:
            raise ValueError(f"sequence {seq} holds {self.lengths[seq]} of {self.max_tokens} tokens: {c} more do not fit")
        if self.flash_decode and c == 1 and seq == 0:
            return self.decode(ids.reshape(1))[0]
        t = self.lengths[seq]
        self._plan = [(seq, 0, c, torch.arange(t, t + c, device=self.device))]
        logits = self.model.logits(self.runner.hidden(ids, self, torch.tensor([c - 1], device=self.device)))[0]
        self.lengths[seq] += c
        self._positions_known = min(self._positions_known, seq)
        return logits

    def prefill(self, ids: list[int], chunk_size: int, seq: int = 0) -> torch.Tensor:
        """The prompt of sequence ``seq`` in chunks of ``chunk_size`` -> logits of its last token."""
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for start in range(0, len(ids), chunk_size):
            logits = self.forward(t[start:start + chunk_size], seq)
        return logits

    def build_plans(self, ids: list[int], chunk_size: int) -> bool:
        """With cuDNN: prefill ``ids`` in chunks of ``chunk_size`` untimed and forget them, so that cuDNN's execution
        plan for each of the prompt's chunk shapes is built (on the host, about 62 ms each on an H200 at 64K keys,
        against 1 ms of attention: ``results/supporting/dense_chunk_lengths_h200.md``) and cached, as a server in
        steady state has them (a chunk's context is a multiple of the chunk size). True if it ran; flash builds
        no plans (False)."""
        if self.sdpa != "cudnn":
            return False
        self.prefill(ids, chunk_size)
        self.reset()
        return True

    def reset(self) -> None:
        """Forget every sequence (the cache is reused from its start; the recorded graphs stay valid)."""
        self.lengths = [0] * self.batch
        self._positions_known = 0

    def generate(self, ids: list[int], chunk_size: int, max_tokens: int) -> list[int]:
        """Greedy, the first sequence: prefill ``ids``, then ``max_tokens`` new token ids."""
        out = [int(self.prefill(ids, chunk_size).argmax())]
        while len(out) < max_tokens:
            out.append(int(self.forward(torch.tensor(out[-1:], device=self.device)).argmax()))
        return out


def varlen_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_k: torch.Tensor,
                            used: torch.Tensor) -> torch.Tensor:
    """What the variable-length flash call of a decode step computes, in plain PyTorch (fp32 softmax): query ``i``
    attends to rows ``cu_k[i] .. cu_k[i] + used[i] - 1`` of ``keys``/``values``. q: [n, n_heads, d], keys, values:
    [rows, n_kv_heads, d], cu_k: [n + 1], used: [n] -> [n, n_heads, d]."""
    n, n_heads, d = q.shape
    n_kv = keys.shape[1]
    span = int((cu_k[1:] - cu_k[:-1]).max())  # a host read: not for a graph
    rows = cu_k[:-1, None].long() + torch.arange(span, device=q.device)  # [n, span]
    live = torch.arange(span, device=q.device) < used[:, None]  # [n, span]
    rows = torch.where(live, rows, 0)
    k, v = keys[rows].float(), values[rows].float()  # [n, span, n_kv, d]
    q = q.float().view(n, n_kv, n_heads // n_kv, d)  # a query head's key head: head // (n_heads // n_kv)
    scores = torch.einsum("nhgd,nshd->nhgs", q, k) * d ** -0.5
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("nhgs,nshd->nhgd", scores.softmax(-1), v)
    return out.reshape(n, n_heads, d).to(values.dtype)
