"""Attention policies, chosen by name, and the settings users pass to them.

Each policy declares its settings once, as a dataclass (``Settings``: defaults, units, ranges, help; see
``settings.py``); the command-line flags, the server's per-request settings and ``docs/settings.md`` are made
from those declarations. Settings a user leaves out take the paper's defaults, the sizes among them fitted to
the model's window (``settings.fitted``).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import PAPER_WINDOW, EngineSettings, add_flag, add_flags, check, fitted, markdown_table, specs
from .base import Attended, AttentionPolicy, PolicyStats, SelectivePolicy, SeqStep, start_step
from .full import FullAttention
from .infllm import InfLLM
from .quest import Quest
from .reattention import ReAttention
from .streaming import StreamingLLM
from .tokenselect import TokenSelect

POLICIES: dict[str, type[AttentionPolicy]] = {
    cls.name: cls for cls in (FullAttention, TokenSelect, ReAttention, StreamingLLM, InfLLM, Quest)
}


def policy_settings(name: str) -> dict[str, object]:
    """The settings a policy takes, with their declared defaults (before fitting to a window)."""
    return {spec.name: spec.default for spec in specs(POLICIES[name].Settings)}


def fitted_settings(name: str, settings: dict, window: int) -> dict:
    """Every setting of policy ``name`` as it runs on a model of ``window`` tokens: the given ones, the defaults
    (sizes fitted to the window; a selective policy's dense_until: the window). ValueError for a setting the policy
    does not take or a value out of range."""
    if name not in POLICIES:
        raise ValueError(f"unknown attention {name!r}; choose from {', '.join(POLICIES)}")
    kind = POLICIES[name].Settings
    check(kind, settings, f"attention {name!r}")
    values = fitted(kind, settings, window)
    if "dense_until" in values and values["dense_until"] is None:
        values["dense_until"] = window  # full attention while the context fits the model's window
    return values


def make_policy(name: str, cache: KVCache, kernels: Kernels, window: int, chunk: int,
                settings: dict | None = None, heads=None) -> AttentionPolicy:
    """Build policy ``name`` with ``fitted_settings``; those that need them get the window and the chunk.
    heads: the reduction over heads across tensor-parallel ranks (``parallel.HeadReduce``; None: this process's)."""
    values = fitted_settings(name, dict(settings or {}), window)
    params = inspect.signature(POLICIES[name].__init__).parameters
    extra = {key: value for key, value in (("window", window), ("chunk", chunk)) if key in params}
    policy = POLICIES[name](cache, kernels, **extra, **values)
    if heads is not None:
        policy.across_ranks(heads)
    return policy


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


def default_chunk(window: int, group: int = 0) -> int:
    """Prefill chunk: the papers' 512, or a quarter of a small window. Four of those for a policy whose chunks choose
    for each ``group`` of their queries (TokenSelect's prefill_group) where a group is no longer: its choices stay
    those of chunks of the group's size, and the model's matrix products run on four times the rows (a 128K prompt
    of the Llama-3-8B shape prefilled in 4.28 s against 4.61-4.80 s, results/supporting/prefill_groups_h200.md)."""
    chunk = min(512, max(16, window // 4))
    return 4 * chunk if 0 < group <= chunk else chunk


# ---- command-line flags shared by generate / eval / serve / bench ---------------------------------

def _policy_specs() -> dict[str, list]:
    """Setting name -> [(policy, its Spec)] over every policy, in declaration order."""
    by_name: dict[str, list] = {}
    for name, cls in POLICIES.items():
        for spec in specs(cls.Settings):
            by_name.setdefault(spec.name, []).append((name, spec))
    return by_name


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """A flag per policy setting (each policy takes those it declares) and per engine setting, with their
    defaults, units and ranges in the help."""
    g = parser.add_argument_group(f"attention policy settings (unset: the paper's defaults; defaults marked "
                                  f"'x min(1, window/{PAPER_WINDOW})' shrink with a model window under "
                                  f"{PAPER_WINDOW} tokens)")
    for name, uses in _policy_specs().items():
        spec = uses[0][1]
        defaults = "; ".join(f"{policy} {s.describe_default()}" for policy, s in uses)
        choices = list(dict.fromkeys(c for _, s in uses for c in s.choices)) if spec.choices else None
        add_flag(g, spec, f"{spec.help} (default: {defaults})", choices)
    g.add_argument("--config", type=Path, help="JSON or YAML file of settings (flags override it)")
    add_flags(parser.add_argument_group("engine settings"), EngineSettings, skip=("max_model_len",))


POLICY_FLAGS = tuple(_policy_specs())
# max_model_len is the server's own flag (``server_options.py``); the engine takes it as a keyword
ENGINE_FLAGS = tuple(spec.name for spec in specs(EngineSettings) if spec.name != "max_model_len")


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


def settings_markdown() -> str:
    """``docs/settings.md``: the engine's settings and every policy's, as tables."""
    parts = ["# Settings", "",
             "Generated from the settings dataclasses (`tokenselect/settings.py`, each policy's `Settings`) by",
             "`python -m tokenselect.policies`; `tests/test_cli_settings.py` checks that this file is current.",
             f"Defaults marked `x min(1, window/{PAPER_WINDOW})` shrink with a model window under {PAPER_WINDOW} "
             "tokens; a value you give is kept.", "", "## Engine", "", markdown_table(EngineSettings)]
    for name, cls in POLICIES.items():
        parts += ["", f"## `{name}`", "", markdown_table(cls.Settings) if specs(cls.Settings) else "No settings."]
    return "\n".join(parts) + "\n"


__all__ = ["Attended", "AttentionPolicy", "PolicyStats", "SelectivePolicy", "SeqStep", "start_step", "POLICIES",
           "make_policy",
           "policy_settings", "fitted_settings", "default_chunk", "add_policy_args", "policy_kwargs",
           "settings_markdown"]
