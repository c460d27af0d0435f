"""Hugging Face transformers' own dense attention (SDPA) on the engine's weights: what users run today.

``transformers_model`` builds the transformers model of a config around the engine's weight tensors (views,
not copies: ``checkpoint_parts`` names each engine parameter's checkpoint tensors), so both run the same
numbers on one copy of the weights. ``measure_transformers`` times what a user's script does: the prompt in
one forward pass (transformers' SDPA, only the last token's logits), then greedy decode steps, each a
forward pass over the model's default cache (``DynamicCache``), launched from the host as transformers runs
them.
"""

from __future__ import annotations

import time

import torch

from .floors import sync


def transformers_model(llm, config: dict):
    """A transformers model of ``config`` (a Hugging Face config dict with "architectures") whose weights are the
    engine ``llm``'s tensors (a fused projection's parts are row slices of it), in eval mode on its device."""
    import transformers

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    from ..models.loader import checkpoint_parts

    arch = getattr(transformers, config["architectures"][0])
    cfg = arch.config_class(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    # built on the CPU without initialising (its parameters are replaced at once; on the meta device RoPE's
    # buffers, computed at construction, would be left unset)
    with no_init_weights():
        model = arch(cfg)
    state = {}
    for name, param in llm.model.named_parameters():
        for hf_name, rows in checkpoint_parts(llm.model, name):
            state[hf_name] = param[rows]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weights not matched: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(llm.device).eval()


@torch.inference_mode()
def measure_transformers(model, ids: list[int], decode_steps: int) -> dict:
    """Prefill ``ids`` in one forward pass, then ``decode_steps`` greedy tokens (after one untimed step) ->
    {"prefill_s", "decode_ms", "tokens"} (the greedy tokens, the untimed step's first)."""
    device = next(model.parameters()).device
    model.set_attn_implementation("sdpa")
    x = torch.tensor([ids], device=device)
    sync(device)
    start = time.perf_counter()
    out = model(x, use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax().view(1, 1)
    sync(device)
    prefill = time.perf_counter() - start
    cache, tokens = out.past_key_values, [int(token)]
    out = model(token, past_key_values=cache, use_cache=True)  # untimed, as the engine's first decode step
    token = out.logits[0, -1].argmax().view(1, 1)
    tokens.append(int(token))
    sync(device)
    start = time.perf_counter()
    for _ in range(decode_steps):
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        tokens.append(int(token))
    sync(device)
    return {"prefill_s": prefill, "decode_ms": (time.perf_counter() - start) / decode_steps * 1e3, "tokens": tokens}
