"""One decoder for the Llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm).

Module names match Hugging Face checkpoints so weights load by name, except two stacks that make one
matrix product of three and of two: ``qkv_proj`` holds q_proj, k_proj and v_proj, ``gate_up_proj`` holds
gate_proj and up_proj, stacked along their outputs (``FUSED``; the loader stacks them). The model never
computes attention itself: each layer hands its un-rotated q, k, v to ``ctx.attention`` (the engine's
forward context), which writes k/v into the paged cache and runs whatever policy is configured.

Tokens of several sequences are flattened into one batch: ``x: [n_tokens, hidden]``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from ..kernels.silu_mul import silu_mul, silu_mul_ref


class AttentionContext(Protocol):
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [n_tokens, n_heads, head_dim], k, v: [n_tokens, n_kv_heads, head_dim] (no RoPE yet)
        -> [n_tokens, n_heads, head_dim]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]. One Triton kernel on a GPU, the same function in PyTorch elsewhere."""
        return (rms_norm if x.is_cuda else rms_norm_ref)(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta: [..., dim] (a residual stream and a sublayer's output not yet added, or None) -> (x + delta,
        its norm): one Triton kernel on a GPU."""
        if delta is None:
            return x, self(x)
        return (add_rms_norm if x.is_cuda else add_rms_norm_ref)(x, delta, self.weight, self.eps)


# a stacked projection -> the checkpoint's projections it holds, in order (their output sizes: the module's
# ``sizes``)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sizes = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> un-rotated q: [n, n_heads, head_dim], k, v: [n, n_kv_heads, head_dim]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [n, sum(sizes)] product
        q = q.view(n, self.n_heads, self.head_dim)
        k, v = k.view(n, self.n_kv, self.head_dim), v.view(n, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out: [n, n_heads, head_dim] (the attention's result) -> [n, hidden]."""
        return self.o_proj(out.reshape(out.shape[0], self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.sizes = (cfg.intermediate_size, cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> [n, hidden]; the activation is one Triton kernel on a GPU, reading gate and up from
        the stacked product in place."""
        return self.down_proj((silu_mul if x.is_cuda else silu_mul_ref)(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) -> the next (x, delta): see ``attention_inputs``."""
        x, q, k, v = self.attention_inputs(x, delta)
        return self.finish(x, ctx.attention(self.self_attn.layer, q, k, v))

    # A layer is split around its attention call so that a step can run everything between two
    # attention calls as one CUDA graph (``cuda_graphs.py``). The residual stream travels as x and the last
    # sublayer's output not yet added (delta), so that each add runs in one kernel with the norm after it.
    def attention_inputs(self, x: torch.Tensor, delta: torch.Tensor | None):
        """x: [n, hidden], delta: [n, hidden] or None (the previous layer's MLP output) -> (x + delta, then the
        un-rotated q, k, v this layer's attention takes)."""
        x, h = self.input_layernorm.add(x, delta)
        return (x, *self.self_attn.qkv(h))

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden], out: [n, n_heads, head_dim] (attention's result) -> (x plus attention's output, the MLP's
        output [n, hidden]: the layer's output is their sum, which the next norm computes)."""
        x, h = self.post_attention_layernorm.add(x, self.self_attn.output(out))
        return x, self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [n_tokens] -> logits [len(logit_rows) or n_tokens, vocab] (fp32).

        ``logit_rows`` picks the rows that need logits (the last token of each sequence), so a
        512-token prefill chunk does not pay for 512 rows of the vocabulary projection."""
        x = self.hidden(input_ids, ctx)
        return self.logits(x if logit_rows is None else x[logit_rows])

    def hidden(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids: [n_tokens] -> the last layer's output [n_tokens, hidden]."""
        x, delta = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, delta = layer(x, delta, ctx)
        return x + delta

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden], the last layer's output -> logits [n, vocab] (fp32)."""
        return self.lm_head(self.model.norm(x)).float()
