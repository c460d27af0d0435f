"""TokenSelect inside Hugging Face transformers: an attention function and a cache, through transformers' own
extension points (``AttentionInterface.register``, ``AttentionMaskInterface.register``, a ``DynamicCache``
subclass); no model file is patched.

    import tokenselect.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tokenselect")
    cache = tokenselect.hf.SelectionCache(k=2048, n_init=128, n_local=512, theta=0.9)
    out = model.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)  # past_key_values= before v5

How it fits together. transformers calls ``cache.update(keys, values, layer_idx)`` and then the registered
attention function ``attention(module, query [B, H, c, d], key [B, H_kv, T, d], value, mask, scaling, ...)``
with the whole cache (T = t past tokens + the c new ones). ``SelectionCache.update`` records which layer is
running, so the attention function finds its cache and its per-layer state there.

Inside the budget (t <= n_init + k + n_local, or t + c <= dense_until) and on sliding-window layers, the
attention is transformers' own SDPA attention with transformers' mask: exactly ordinary attention. Past it
(batch 1 only), the step attends ``[n_init sinks | k chosen middle tokens in order | n_local recent | its own
c tokens]``, chosen as the engine's TokenSelect does (``policies/tokenselect.py``): soft vote over heads of
un-rotated q.k (the chunk's mean query), top k, and on decode steps the Selection Cache (reuse while
cos(q, q_cached) >= theta).

Post-RoPE keys. transformers caches keys after RoPE, at position = their index in the cache. The engine scores
un-rotated keys and places the list at positions 0..n-1. So the cache keeps a second copy of the keys,
un-rotated (rotated by -p with the model's inverse frequencies; computed once per token, when first seen), and
the attention runs the engine's kernels on it: scores on the un-rotated keys, and ``sparse_attention`` rotates
each listed key to its index j in the list -- the relative rotation by (j - p) of the cached key, done as
un-rotate then rotate. This needs standard RoPE whose frequencies do not depend on the length and whose cos/sin
are not scaled: rope types default, linear and llama3, over the whole head (no partial rotary). Other models
raise ``UnsupportedModel`` when they first select (inside the budget any model works: nothing is re-placed).
The un-rotation rounds (fp32: ~1e-7 relative), so logits past the budget match the engine's to rounding.

Kernels: the PyTorch references on the CPU, the Triton kernels on CUDA (``kernels.get_kernels``).
Without a ``SelectionCache`` (a plain ``DynamicCache``) the attention function cannot see the cache and uses
ordinary SDPA attention everywhere.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import get_kernels
from .policies.selection_cache import SelectionCache as _QueryCache
from .rope import RopeSpec, rotate

NAME = "tokenselect"
SUPPORTED_ROPE = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The model's positions cannot be re-assigned (non-standard or partial RoPE)."""


class SelectionCache(DynamicCache):
    """A ``DynamicCache`` (post-RoPE keys/values per layer, [B, H_kv, T, d]) that also holds TokenSelect's
    settings and state: the un-rotated keys per layer ([T, H_kv, d]), the Selection Cache of decode queries, and
    ``selected[layer]``: the token indices [n_init + k + n_local] the layer's last selective step attended
    before its own tokens (for inspection and tests).

    k: middle tokens chosen; n_init: sinks; n_local: recent window; theta: Selection Cache threshold (None: off);
    dense_until: steps ending at or below this length attend everything (default None: the model's window,
    ``config.max_position_embeddings``, as our engine's default; 0 for the paper's behaviour);
    kernels: "torch" | "triton" | None (Triton on CUDA, PyTorch on the CPU)."""

    def __init__(self, k: int = 2048, n_init: int = 128, n_local: int = 512, theta: float | None = 0.9,
                 dense_until: int | None = None, kernels: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if min(k, n_init, n_local, dense_until or 0) < 0:
            raise ValueError("k, n_init, n_local and dense_until must be >= 0")
        self.k, self.n_init, self.n_local, self.theta = k, n_init, n_local, theta
        self.dense_until = dense_until  # None: the model's window, read when attending
        self.kernels_name = kernels
        self.raw_keys: dict[int, torch.Tensor] = {}  # layer -> [T, H_kv, d] un-rotated keys
        self.selected: dict[int, torch.Tensor] = {}
        self.queries: _QueryCache | None = None
        self.active_layer: int | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.active_layer = layer_idx
        _ACTIVE[0] = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attends_all(self, t: int, c: int, window: int = 0) -> bool:
        """As the engine's ``SelectivePolicy.attends_all``: t past tokens, c new ones; window: the model's, the
        default of ``dense_until``."""
        dense_until = window if self.dense_until is None else self.dense_until
        return t <= self.n_init + self.k + self.n_local or t + c <= dense_until

    def kernels(self, device: torch.device):
        name = self.kernels_name or ("triton" if device.type == "cuda" else "torch")
        return get_kernels(name)

    def hits_misses(self) -> tuple[int, int]:
        return (0, 0) if self.queries is None else self.queries.counts()


_ACTIVE: list[SelectionCache | None] = [None]  # the cache whose update ran last (the layer about to attend)


def rope_frequencies(module: torch.nn.Module, head_dim: int) -> torch.Tensor:
    """inv_freq [head_dim // 2] fp32 of the module's layer, or ``UnsupportedModel``."""
    config = module.config
    cfg = config.to_dict()
    params = cfg.get("rope_parameters") or {}
    layer_types = cfg.get("layer_types")
    if isinstance(params, dict) and layer_types and layer_types[module.layer_idx] in params:
        cfg = {**cfg, "rope_parameters": params[layer_types[module.layer_idx]]}  # per layer type (Gemma 3)
        params = cfg["rope_parameters"]
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"{config.model_type}: partial rotary ({partial}) is not supported by "
                               "tokenselect.hf (positions can be re-assigned only for RoPE over the whole head)")
    try:
        spec = RopeSpec.from_hf(cfg, head_dim)
    except ValueError as e:
        raise UnsupportedModel(f"{config.model_type}: {e}") from None
    if spec.kind not in SUPPORTED_ROPE:
        raise UnsupportedModel(f"{config.model_type}: rope type {spec.kind!r} is not supported by tokenselect.hf "
                               f"(supported: {', '.join(SUPPORTED_ROPE)}; others scale cos/sin or change with "
                               "the length)")
    inv_freq, scale = spec.inv_freq()
    if scale != 1.0:
        raise UnsupportedModel(f"{config.model_type}: RoPE with an attention scaling is not supported")
    return inv_freq


def _sliding(module: torch.nn.Module) -> bool:
    types = getattr(module.config, "layer_types", None)
    if types is not None:
        return types[module.layer_idx] == "sliding_attention"
    return bool(getattr(module, "sliding_window", None) or getattr(module.config, "sliding_window", None))


def tokenselect_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function. query: [B, H, c, d] post-RoPE at positions t..t+c-1; key, value:
    [B, H_kv, T, d] (the whole cache after this step's update, T = t + c). Returns ([B, c, H, d], None), as
    transformers' attention functions do."""
    cache = _ACTIVE[0]
    layer = getattr(module, "layer_idx", None)
    c, total = query.shape[2], key.shape[2]
    t = total - c
    if cache is not None and (cache.active_layer != layer or layer >= len(cache.layers)
                              or key is not cache.layers[layer].keys):
        cache = None  # the keys are not this cache's (e.g. a later run with a plain DynamicCache)
    if (cache is None or kwargs.get("softcap") is not None
            or cache.attends_all(t, c, getattr(module.config, "max_position_embeddings", 0) or 0)
            or _sliding(module)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise NotImplementedError("tokenselect.hf selects for a batch of one sequence (batch > 1 past the budget)")
    if getattr(module.config, "attn_logit_softcapping", None):
        raise UnsupportedModel(f"{module.config.model_type}: attention logit soft-capping is not supported")
    d = query.shape[-1]
    inv_freq = rope_frequencies(module, d).to(query.device)
    kern = cache.kernels(query.device)
    # the un-rotated keys, [T, H_kv, d]: extended by the tokens not seen yet
    raw = cache.raw_keys.get(layer)
    seen = 0 if raw is None else raw.shape[0]
    if seen > total:
        raise RuntimeError("the cache shrank under tokenselect.hf (cropping is not supported)")
    if seen < total:
        new = key[0, :, seen:].transpose(0, 1)  # [T - seen, H_kv, d]
        pos = torch.arange(seen, total, device=key.device)
        new = rotate(new, -pos, inv_freq)
        raw = new if raw is None else torch.cat([raw, new])
        cache.raw_keys[layer] = raw
    q_pos = torch.arange(t, total, device=query.device)
    q_raw = rotate(query[0].transpose(0, 1), -q_pos, inv_freq)  # [c, H, d]
    n_init, n_local, k = cache.n_init, cache.n_local, cache.k
    middle = torch.arange(n_init, t - n_local, device=key.device)
    query_sel = q_raw.mean(dim=0, dtype=torch.float32)  # [H, d], the engine's selection_query
    chosen = None
    if c == 1 and cache.theta is not None:
        if cache.queries is None:
            cache.queries = _QueryCache(cache.theta, module.config.num_hidden_layers, k, kern.selection_check,
                                        kern.selection_update)
        chosen = cache.queries.lookup(0, layer, query_sel)
    if chosen is None:
        vote = kern.head_soft_vote(query_sel.to(q_raw.dtype), raw, middle, 1.0)  # raw scores, as the engine
        chosen = kern.topk(vote, k, None, middle)  # token indices, ascending
        if c == 1 and cache.queries is not None:
            cache.queries.store(cache.queries.row(0, query_sel.numel(), query_sel.device), layer, query_sel, chosen)
    order = torch.cat([torch.arange(n_init, device=key.device), chosen,
                       torch.arange(t - n_local, total, device=key.device)])  # [n + c]: the list, own last
    cache.selected[layer] = order[:order.numel() - c]
    positions = torch.arange(order.numel(), device=key.device)  # by index in the list
    sm_scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    values = value[0].transpose(0, 1)  # [T, H_kv, d]
    if kern.name == "triton":
        values = values.contiguous()  # the kernels read pools of contiguous rows (a copy: O(T) a step)
    out = kern.sparse_attention(q_raw, raw, values, order, positions, positions[-c:], inv_freq, 1.0,
                                sm_scale)  # [c, H, d]
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, tokenselect_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
