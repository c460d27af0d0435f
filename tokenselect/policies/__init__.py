"""Attention policies, chosen by name, and the settings users pass to them.

Settings a user leaves out take the paper's defaults. Those defaults were chosen for models with an
8K window; for a smaller window the size settings (``SIZE_SETTINGS`` of each policy) shrink in
proportion, so that the attended list still fits the window the model was trained on.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from ..kernels import Kernels
from ..kv_cache import KVCache
from .base import Attended, AttentionPolicy, SelectivePolicy, SeqStep, start_step
from .full import FullAttention
from .infllm import InfLLM
from .quest import Quest
from .reattention import ReAttention
from .streaming import StreamingLLM
from .tokenselect import TokenSelect

POLICIES: dict[str, type[AttentionPolicy]] = {
    cls.name: cls for cls in (FullAttention, TokenSelect, ReAttention, StreamingLLM, InfLLM, Quest)
}
PAPER_WINDOW = 8192  # the window the papers' defaults were set for (Llama-3-8B)
SIZE_SETTINGS = ("n_init", "k", "n_local", "span", "block_size")


def policy_settings(name: str) -> dict[str, object]:
    """The settings a policy takes, with their defaults."""
    params = inspect.signature(POLICIES[name].__init__).parameters
    return {p: v.default for p, v in params.items()
            if p not in ("self", "cache", "kernels", "window", "chunk")}


def make_policy(name: str, cache: KVCache, kernels: Kernels, window: int, chunk: int,
                settings: dict | None = None) -> AttentionPolicy:
    """Build policy ``name``. Unknown settings raise; defaulted size settings fit the window."""
    if name not in POLICIES:
        raise ValueError(f"unknown attention {name!r}; choose from {', '.join(POLICIES)}")
    settings = dict(settings or {})
    accepted = policy_settings(name)
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"attention {name!r} takes no setting {', '.join(unknown)} "
                         f"(it takes: {', '.join(accepted) or 'none'})")
    if "dense_until" in accepted and settings.get("dense_until") is None:
        settings["dense_until"] = window  # full attention while the context fits the model's window
    shrink = min(1.0, window / PAPER_WINDOW)
    for key in SIZE_SETTINGS:
        if key in accepted and key not in settings:
            settings[key] = max(1, int(accepted[key] * shrink)) if accepted[key] else 0
    params = inspect.signature(POLICIES[name].__init__).parameters
    extra = {key: value for key, value in (("window", window), ("chunk", chunk)) if key in params}
    return POLICIES[name](cache, kernels, **extra, **settings)


def policy_spec(text: str) -> tuple[str, dict]:
    """``tokenselect:theta=-1;k=4096`` -> ("tokenselect", {"theta": -1, "k": 4096}): a policy with its own
    settings, so that one run can put several settings of a policy side by side."""
    name, _, rest = text.partition(":")
    settings = {}
    for item in filter(None, rest.split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy setting {item!r} in {text!r} is not KEY=VALUE")
        try:
            settings[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[key.strip()] = value.strip()
    return name, settings


def default_chunk(window: int) -> int:
    """Prefill chunk: the papers' 512, or a quarter of a small window."""
    return min(512, max(16, window // 4))


# ---- command-line flags shared by generate / eval / serve / bench ---------------------------------

def add_policy_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention policy settings (unset: the paper's defaults, fitted to the model window)")
    g.add_argument("--k", type=int, help="tokens (tokenselect, infllm, quest) selected from the middle of the cache")
    g.add_argument("--n-init", type=int, help="sink tokens kept at the start (reattention: global tokens)")
    g.add_argument("--n-local", type=int, help="most recent tokens always attended")
    g.add_argument("--dense-until", type=int,
                   help="tokenselect: attend every token (as full attention) while the context is at most this "
                        "many tokens; default: the model's trained window, so the model is unchanged at lengths it "
                        "handles; 0: select as soon as the context exceeds n_init + k + n_local (the paper)")
    g.add_argument("--theta", type=float, help="Selection Cache threshold on cos(q, q_cached); 1.0 never reuses")
    g.add_argument("--selector", choices=["soft_vote", "hard_vote", "topk"], help="tokenselect head vote (default soft_vote)")
    g.add_argument("--score-scale", help="per-head softmax scale for the vote: raw (default), sqrt_d or a number")
    g.add_argument("--span", type=int, help="reattention: neighbours attended around each selected token")
    g.add_argument("--n-spans", type=int, help="reattention: number of selected spans (k')")
    g.add_argument("--block-size", type=int, help="infllm: tokens per memory block (default 128)")
    g.add_argument("--repr-keys", type=int, help="infllm: representative keys per block (default 4)")
    g.add_argument("--page-size", type=int, help="quest: tokens per page (default 16)")
    g.add_argument("--positions", choices=["reindex", "original", "fixed"],
                   help="RoPE by index within the attended list (default), at original positions, or "
                        "(infllm's default) fixed: the memory at distance n_local from the chunk")
    g.add_argument("--config", type=Path, help="JSON or YAML file of settings (flags override it)")
    e = parser.add_argument_group("engine settings")
    e.add_argument("--kernels", choices=["triton", "torch"], help="default: triton on CUDA, torch on CPU")
    e.add_argument("--rope-scaling", help="override RoPE scaling, e.g. dynamic:4, ntk:8, yarn:4, linear:2")
    e.add_argument("--chunk-size", type=int, help="prefill chunk in tokens (default 512, or window/4 if smaller)")
    e.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    e.add_argument("--kv-cache-tokens", type=int, help="size of the KV pool in tokens")
    e.add_argument("--kv-dtype", choices=["auto", "fp8", "bf16", "fp16", "fp32"],
                   help="KV storage dtype (default auto: the model's dtype; fp8 halves the pool)")
    e.add_argument("--kv-offload", choices=["none", "values"],
                   help="values: keep the V pool in pinned host memory and only K on the GPU, which roughly "
                        "doubles the tokens that fit; the GPU gathers the values it attends over the bus "
                        "(default none)")
    e.add_argument("--select-dtype", choices=["auto", "fp8"],
                   help="fp8: keep an fp8 copy of the keys for TokenSelect and ReAttention to score, so that a "
                        "selection reads half the bytes of bf16 keys (attention still reads the KV pool; costs one "
                        "byte per key element); default auto: selection reads the KV pool's keys")
    e.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run each step's layers as CUDA graphs captured around attention, and decode steps "
                        "and long prompts' prefill chunks (tokenselect, streaming, full, infllm) as one graph "
                        "each, attention included (default: on with CUDA)")
    e.add_argument("--max-num-seqs", type=int,
                   help="sequences running at once (default 64); 1 gives every prefill chunk a step of its own, "
                        "which runs as one CUDA graph")


POLICY_FLAGS = ("k", "n_init", "n_local", "dense_until", "theta", "selector", "score_scale", "span", "n_spans", "positions",
                "block_size", "repr_keys", "page_size")
ENGINE_FLAGS = ("kernels", "rope_scaling", "chunk_size", "dtype", "device", "kv_cache_tokens", "kv_dtype",
                "kv_offload", "select_dtype", "cuda_graphs", "max_num_seqs")


def load_config_file(path: Path) -> dict:
    """Settings from a JSON or YAML file (keys as in the Python API: k, n_init, theta, ...)."""
    text = Path(path).read_text()
    if Path(path).suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    return {key.replace("-", "_"): value for key, value in data.items()}


def policy_kwargs(args: argparse.Namespace, attention: str | None = None, engine: bool = True) -> dict:
    """``LLM(...)`` keyword arguments from parsed flags: engine settings plus the policy settings the
    user gave. With ``attention``, only the settings that policy takes are kept (so one set of flags
    can drive several policies side by side). ``engine=False`` leaves out the engine settings
    (for ``LLM.set_attention``)."""
    settings = load_config_file(args.config) if getattr(args, "config", None) else {}
    for key in POLICY_FLAGS + ENGINE_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if attention is not None:
        accepted = set(policy_settings(attention)) | set(ENGINE_FLAGS)
        settings = {key: value for key, value in settings.items() if key in accepted}
    if not engine:
        settings = {key: value for key, value in settings.items() if key not in ENGINE_FLAGS}
    return settings


__all__ = ["Attended", "AttentionPolicy", "SelectivePolicy", "SeqStep", "start_step", "POLICIES", "make_policy",
           "policy_settings", "default_chunk", "add_policy_args", "policy_kwargs"]
