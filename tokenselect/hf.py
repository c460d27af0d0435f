"""TokenSelect (and the engine's other policies) inside Hugging Face transformers: attention functions and a
cache, through transformers' own extension points (``AttentionInterface.register``,
``AttentionMaskInterface.register``, a ``DynamicCache`` subclass); no model file is patched. What is supported,
and why (standard RoPE over the whole head, prefill chunks, padded batches): docs/methods.md, "In transformers".

    import tokenselect.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tokenselect")
    out = model.generate(ids, max_new_tokens=64, do_sample=False)          # TokenSelect, its defaults
    cache = tokenselect.hf.SelectionCache(k=2048, n_init=128, n_local=512, theta=0.9)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)  # its own settings
    cache = tokenselect.hf.PolicyCache("quest", k=1024, page_size=16)      # a baseline, with a cache object
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False, prefill_chunk_size=512)

Without a cache object the implementation's policy runs with the engine's defaults fitted to
``config.max_position_embeddings``: ``"tokenselect"``, or ``"tokenselect_streaming"``, ``"tokenselect_quest"``,
``"tokenselect_infllm"``, ``"tokenselect_reattention"``; a cache object's policy wins over the name's.

How it fits together. transformers calls ``cache.update(keys, values, layer_idx)`` and then the registered
attention function ``attention(module, query [B, H, c, d], key [B, H_kv, T, d], value, mask, scaling, ...)``
with the whole cache (T = t past columns + the c new ones). ``PolicyCache.update`` records which layer is
running, so the attention function finds its cache there. With transformers' own ``DynamicCache`` (no cache
object given) the state lives with the model instead (``default_state(model)``), and a step that finds fewer
cached tokens than its state has seen (a new ``generate``) starts a fresh one. The state builds the engine's
policy object (``make_policy``) over a second, un-rotated copy of the keys (``KeyPools``: transformers caches
them after RoPE) and asks it, for each layer's step, the engine's one question (``AttentionPolicy.attend``); the
engine's ``sparse_attention`` then rotates each listed key to the position the policy gave it. A step that
attends every token at its own position, and a sliding-window layer, is transformers' own SDPA attention.
Kernels: the PyTorch references on the CPU, the Triton kernels on CUDA (``kernels.get_kernels``), a prefill chunk's
attention by cuDNN where the engine's would (``chunk_attention``, as the engine's setting: auto, triton, cudnn).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import check_chunk_attention, chunk_attention_backend, get_kernels, kernels_for
from .policies import POLICIES, default_chunk, make_policy, policy_settings
from .policies.base import SeqStep, start_step
from .rope import RopeSpec, rotate
from .transfer import Aranges

NAME = "tokenselect"
SUPPORTED_ROPE = ("default", "linear", "llama3")
# attention implementation name -> the policy it runs without a cache object (full attention is "sdpa")
IMPLEMENTATIONS = {NAME: "tokenselect", **{f"{NAME}_{p}": p for p in POLICIES if p not in ("full", "tokenselect")}}


class UnsupportedModel(ValueError):
    """The model's positions cannot be re-assigned (non-standard or partial RoPE, soft-capped logits)."""


class KeyPools:
    """What the engine's policies read of the engine's ``KVCache``, over the un-rotated keys: ``k[layer]`` and
    ``k_select[layer]`` -> [T * B, H_kv, d] (slot ``column * B + row``: a column's slots never move as the cache
    grows), ``shape`` (n_layers, -, H_kv, d), ``offload`` and ``arange``. Grown by doubling, so an append copies only the
    new columns."""

    offload = "none"

    def __init__(self, n_layers: int, batch: int, n_kv: int, d: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_layers, 0, n_kv, d)
        self.batch, self.dtype, self.device = batch, dtype, device
        self.arange = Aranges(device)
        self._store: dict[int, torch.Tensor] = {}  # layer -> [capacity, B, H_kv, d]
        self._length: dict[int, int] = {}
        self._zeros: torch.Tensor | None = None  # what layers never appended read (``__getitem__``)

    @property
    def k(self) -> KeyPools:
        return self

    k_select = k

    def length(self, layer: int) -> int:
        """Columns un-rotated so far in ``layer``."""
        return self._length.get(layer, 0)

    def append(self, layer: int, new: torch.Tensor) -> None:
        """new: [n, B, H_kv, d] un-rotated keys of the next n columns."""
        have, n = self.length(layer), new.shape[0]
        store = self._store.get(layer)
        if store is None or store.shape[0] < have + n:
            grown = torch.empty(max(2 * (have + n), 64), *new.shape[1:], dtype=self.dtype, device=self.device)
            if store is not None:
                grown[:have] = store[:have]
            self._store[layer] = store = grown
        store[have:have + n] = new
        self._length[layer] = have + n

    def __getitem__(self, layer: int) -> torch.Tensor:
        _, _, n_kv, d = self.shape
        if layer not in self._store:
            # a layer left to transformers (sliding window): the policy never attends it, but one that keeps state
            # for every layer (InfLLM's blocks) reads it; zeros as long as the other layers' keys, read-only
            n = max(self._length.values(), default=0)
            if self._zeros is None or self._zeros.shape[0] < n * self.batch:
                self._zeros = torch.zeros(max(2 * n * self.batch, 64), n_kv, d, dtype=self.dtype, device=self.device)
            return self._zeros[:n * self.batch]
        n = self.length(layer)
        return self._store[layer][:n].view(n * self.batch, n_kv, d)


class PolicyState:
    """One batch's run of a policy: the engine's policy object over ``KeyPools``, built at the first step (when
    the model's shapes are known), what the last steps attended (``selected``), and the RoPE frequencies.

    selected[layer]: the token indices (within the row's own tokens) the layer's last selective step attended
    before the step's own tokens: [n] for a batch of one; for a batch, a list of one per row (None for a row that
    attended densely)."""

    def __init__(self, policy: str, settings: dict, kernels: str | None = None, chunk: int | None = None,
                 chunk_attention: str = "auto"):
        self.policy_name, self.settings, self.kernels_name, self.chunk = policy, settings, kernels, chunk
        # as asked; resolved by ``build``, where the device and dtype are known
        self.chunk_attention = check_chunk_attention(chunk_attention)
        self.policy = None
        self.pools: KeyPools | None = None
        self.selected: dict[int, torch.Tensor | list] = {}
        self.steps: dict[int, tuple[tuple[int, int], SeqStep]] = {}  # row -> ((t, c), the step's SeqStep)
        self._inv_freq: dict[int, torch.Tensor] = {}

    def build(self, module: torch.nn.Module, key: torch.Tensor) -> None:
        config = module.config
        window = int(getattr(config, "max_position_embeddings", 0) or 0)
        if window <= 0:
            raise UnsupportedModel(f"{config.model_type}: no max_position_embeddings to fit the policy's defaults to")
        self.chunk = self.chunk or default_chunk(window)
        b, n_kv, _, d = key.shape
        self.pools = KeyPools(config.num_hidden_layers, b, n_kv, d, key.dtype, key.device)
        name = kernels_for(self.kernels_name, key.device)
        self.chunk_attention = chunk_attention_backend(self.chunk_attention, name, key.device, key.dtype)
        self.kernels = get_kernels(name, self.chunk_attention)
        self.policy = make_policy(self.policy_name, self.pools, self.kernels, window, self.chunk, self.settings)

    def inv_freq(self, module: torch.nn.Module, d: int, device: torch.device) -> torch.Tensor:
        layer = module.layer_idx
        if layer not in self._inv_freq:
            self._inv_freq[layer] = rope_frequencies(module, d).to(device)
        return self._inv_freq[layer]

    def hits_misses(self) -> tuple[int, int]:
        """Selection Cache hits and misses (TokenSelect; (0, 0) for the other policies or before a step)."""
        stats = self.policy.stats() if self.policy is not None else None
        return (stats.selection_cache_hits, stats.selection_cache_misses) if stats is not None else (0, 0)

    def step(self, row: int, table: torch.Tensor, t: int, c: int, q_row: torch.Tensor) -> SeqStep:
        """The row's SeqStep of this forward pass (t cached tokens, c new ones; table: their t + c slots):
        prepared by the first layer that selects, shared by the others, as the engine prepares a step once."""
        key, entry = (t, c), self.steps.get(row)
        if entry is None or entry[0] != key:
            entry = self.steps[row] = (key, start_step(self.policy, row, table, t, c, c == 1, tuple(q_row.shape),
                                                       q_row.dtype))
        return entry[1]


def check_settings(policy: str, settings: dict) -> dict:
    """The settings the user gave (None: the default), checked against the engine's policy; ``dense_until``
    None is kept (the engine reads it as the model's window)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    accepted = policy_settings(policy)
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"policy {policy!r} takes no setting {', '.join(unknown)} "
                         f"(it takes: {', '.join(accepted) or 'none'})")
    return {key: value for key, value in settings.items() if value is not None or key == "dense_until"}


class PolicyCache(DynamicCache):
    """A ``DynamicCache`` (post-RoPE keys/values per layer, [B, H_kv, T, d]) that also runs one of the engine's
    policies: ``PolicyCache("quest", k=1024)``. settings: the policy's own (``tokenselect.policies
    .policy_settings(name)``; left out: the engine's defaults fitted to the model's window); kernels: "torch" |
    "triton" | None (Triton on CUDA); chunk_attention: what runs a prefill chunk's attention over its list, "auto"
    (cuDNN on Hopper in bf16/fp16, else the kernels' own), "triton" or "cudnn" (the engine's setting of that name;
    resolved at the first step, then ``state.chunk_attention`` names it); chunk: the policy's prefill chunk (InfLLM
    sizes its memory by it, ReAttention its spans; default the engine's, 512 or a quarter of a small window); config:
    the model's config (transformers uses it for sliding-window layers). One cache serves one ``generate``."""

    def __init__(self, policy: str = "tokenselect", *, kernels: str | None = None, chunk: int | None = None,
                 chunk_attention: str = "auto", config=None, **settings):
        super().__init__(config=config)
        self.state = PolicyState(policy, check_settings(policy, settings), kernels, chunk, chunk_attention)
        self.active_layer: int | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.active_layer = layer_idx
        _ACTIVE.cache = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def policy(self):
        """The engine's policy object (None before the first step)."""
        return self.state.policy

    @property
    def selected(self) -> dict:
        return self.state.selected

    def hits_misses(self) -> tuple[int, int]:
        return self.state.hits_misses()


class SelectionCache(PolicyCache):
    """``PolicyCache("tokenselect", ...)``: k, n_init, n_local, theta (None: no Selection Cache), dense_until
    (None: the model's window; 0: the paper's, select past n_init + k + n_local), selector, score_scale,
    positions."""

    def __init__(self, *, kernels: str | None = None, chunk: int | None = None, chunk_attention: str = "auto",
                 config=None, **settings):
        super().__init__("tokenselect", kernels=kernels, chunk=chunk, chunk_attention=chunk_attention, config=config,
                         **settings)


_ACTIVE = threading.local()  # .cache: the PolicyCache whose update ran last in this thread (the layer about to attend)
_DEFAULT: dict[int, tuple[weakref.ref, PolicyState]] = {}  # id(model config) -> (config, the no-cache run's state)


def _state_of(config) -> PolicyState | None:
    """The no-cache run's state kept for this very config object (not one that took a collected one's id)."""
    entry = _DEFAULT.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def default_state(model: torch.nn.Module) -> PolicyState | None:
    """The state of the model's last run without a cache object (its ``selected``, ``hits_misses()``)."""
    config = getattr(model, "config", model)
    return _state_of(config) or _state_of(getattr(config, "get_text_config", lambda **_: config)(decoder=True))


def _default_for(module: torch.nn.Module, policy: str, t: int) -> PolicyState:
    """The no-cache state of the module's model; a fresh one when the step finds fewer cached tokens than the
    state has seen in this layer (a new run)."""
    config = module.config
    state = _state_of(config)
    if (state is None or state.policy_name != policy
            or (state.pools is not None and state.pools.length(module.layer_idx) > t)):
        if state is None:  # forget the state with the model (once per config)
            weakref.finalize(config, _DEFAULT.pop, id(config), None)
        state = PolicyState(policy, {})
        _DEFAULT[id(config)] = (weakref.ref(config), state)
    return state


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


def _valid_columns(mask: torch.Tensor | None, batch: int, total: int) -> torch.Tensor | None:
    """[B, T] bool: the columns that are tokens of each row (not padding): those its last query sees, as the
    model's full-attention mask ([B, 1, c, T] bool, True = attend, or additive float) says. None: all are."""
    if mask is None:
        return None
    last = mask[:, 0, -1, :total]
    valid = last if last.dtype == torch.bool else last == 0
    valid = valid.expand(batch, total)
    return None if bool(valid.all()) else valid


def _unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [n, B, heads, d] rotated at positions [n, B] -> un-rotated, in fp32 (then x's dtype)."""
    flat = rotate(x.float().flatten(0, 1), -positions.flatten(), inv_freq)
    return flat.view(x.shape).to(x.dtype)


def _live(attended) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, key positions) of what an ``Attended`` attends: its first n_valid entries."""
    n = attended.slots.numel() if attended.n_valid is None else int(attended.n_valid)
    return attended.slots[:n], attended.key_pos[:n]


def _dense(attended, table: torch.Tensor, c: int) -> bool:
    """Whether the step attends every token of its table at its own position, its queries last: full attention."""
    slots, key_pos = _live(attended)
    n = table.numel()
    if slots.numel() != n or attended.q_pos.numel() != c:
        return False
    index = torch.arange(n, device=table.device)
    return torch.equal(slots, table) and torch.equal(key_pos, index) and torch.equal(attended.q_pos, index[n - c:])


def policy_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     default_policy: str = "tokenselect", **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention functions. query: [B, H, c, d] post-RoPE; key, value: [B, H_kv, T, d] (the whole
    cache after this step's update, T = t + c). Returns ([B, c, H, d], None), as transformers' attention
    functions do. default_policy: the policy that runs without a cache object."""
    def sdpa(rows: slice = slice(None)) -> tuple[torch.Tensor, None]:
        """transformers' own SDPA attention (ordinary attention) of the batch's ``rows``."""
        mask = None if attention_mask is None else attention_mask[rows]
        return sdpa_attention_forward(module, query[rows], key[rows], value[rows], mask, dropout=dropout,
                                      scaling=scaling, **kwargs)

    layer = getattr(module, "layer_idx", None)
    if layer is None or _sliding(module) or kwargs.get("softcap") is not None:
        return sdpa()
    b, h, c, d = query.shape
    total = key.shape[2]
    t = total - c
    cache = getattr(_ACTIVE, "cache", None)
    if cache is not None and cache.active_layer == layer and layer < len(cache.layers) \
            and key is cache.layers[layer].keys:
        state = cache.state
    else:  # transformers' own cache (or none): the policy of the implementation's name, its defaults
        state = _default_for(module, default_policy, t)
    if state.policy_name == "full":
        return sdpa()
    if getattr(module.config, "attn_logit_softcapping", None):
        raise UnsupportedModel(f"{module.config.model_type}: attention logit soft-capping is not supported")
    if state.policy is None:
        state.build(module, key)
    pools, policy = state.pools, state.policy
    if b != pools.batch:
        raise ValueError(f"tokenselect.hf: a cache built for a batch of {pools.batch} got a batch of {b}")
    if policy.name == "infllm" and c > state.chunk:
        raise ValueError(f"infllm through tokenselect.hf: a step of {c} tokens is longer than its chunk "
                         f"({state.chunk}); pass prefill_chunk_size={state.chunk} to generate (InfLLM counts the "
                         "attention each chunk's queries give the local window, a chunk at a time)")
    inv_freq = state.inv_freq(module, d, query.device)
    valid = _valid_columns(attention_mask, b, total)
    # positions of the cached columns: transformers' position_ids for this step's, else (and for columns cached
    # before the state saw them) each row's count of real tokens before them, as generate numbers them
    rank = None if valid is None else valid.long().cumsum(1) - 1  # [B, T]
    ids = kwargs.get("position_ids")
    if ids is not None and ids.shape[-1] == c:
        q_pos = ids.to(key.device).expand(b, c).T  # [c, B]
    else:
        q_pos = (torch.arange(t, total, device=key.device)[:, None].expand(c, b) if rank is None
                 else rank[:, t:].T)
    seen = pools.length(layer)
    if seen > total:
        raise RuntimeError("the cache shrank under tokenselect.hf (cropping is not supported)")
    if seen < total:
        cols = torch.arange(seen, total, device=key.device)
        pos = cols[:, None].expand(-1, b) if rank is None else rank[:, seen:].T  # [n, B]
        if seen <= t:
            pos = torch.cat([pos[:t - seen], q_pos])
        pools.append(layer, _unrotate(key[:, :, seen:].permute(2, 0, 1, 3), pos, inv_freq))
    q_raw = _unrotate(query.permute(2, 0, 1, 3), q_pos, inv_freq)  # [c, B, H, d]

    plans = []  # per row: (plan, past slots, own columns, own query rows) or None (no token of the row here)
    for row in range(b):
        if valid is None:
            past_cols = torch.arange(t, device=key.device)
            own = torch.arange(t, total, device=key.device)
        else:
            past_cols = valid[row, :t].nonzero().flatten()
            own = t + valid[row, t:].nonzero().flatten()
        if own.numel() == 0:
            plans.append(None)
            continue
        own_slots = own * b + row
        table = torch.cat([past_cols * b + row, own_slots])  # the row's tokens' slots, its own last
        q_row = q_raw[own - t, row]  # [c_row, H, d]
        step = state.step(row, table, past_cols.numel(), own.numel(), q_row)
        plans.append((policy.attend(layer, step, q_row, own_slots), table, own, q_row))
    dense = [p is None or _dense(p[0], p[1], p[2].numel()) for p in plans]
    if all(dense):  # every row as ordinary attention: transformers' own, for the batch
        return sdpa()
    out = query.new_zeros(b, c, h, d)
    sm_scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    kern, keys = state.kernels, pools[layer]
    chosen = [None] * b
    for row, (entry, is_dense) in enumerate(zip(plans, dense)):
        if entry is None:
            continue
        attended, table, own, q_row = entry
        if is_dense:  # as this row alone: SDPA over its columns
            out[row] = sdpa(slice(row, row + 1))[0][0]
            continue
        slots, positions = _live(attended)  # [n]: the list, the row's own tokens among them
        columns = slots // b
        # gathered rows (n of them, not the whole cache): the kernels read [n, H_kv, d] contiguous pools
        k_rows = keys[slots]
        v_rows = value[row][:, columns].transpose(0, 1).contiguous()
        index = torch.arange(slots.numel(), device=key.device)
        out[row, own - t] = kern.sparse_attention(q_row, k_rows, v_rows, index, positions, attended.q_pos,
                                                  inv_freq, 1.0, sm_scale)
        listed = columns[~torch.isin(columns, own)]  # what the row's queries attended before their own tokens
        chosen[row] = listed if rank is None else rank[row, listed]
    state.selected[layer] = chosen[0] if b == 1 else chosen
    return out, None


def _make(policy: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return policy_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                default_policy=policy, **kwargs)

    attention.__name__ = attention.__qualname__ = f"{policy}_attention"
    attention.__doc__ = f"``policy_attention`` whose policy without a cache object is {policy!r}."
    return attention


tokenselect_attention = _make("tokenselect")
for _name, _policy in IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, tokenselect_attention if _policy == "tokenselect" else _make(_policy))
    AttentionMaskInterface.register(_name, sdpa_mask)
