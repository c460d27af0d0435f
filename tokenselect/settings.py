"""Settings that describe themselves: one dataclass for the engine and one per policy.

Each field is declared once with ``setting(...)``: its default, its unit, its valid range or choices, its help
text, whether a size default is fitted to the model's window (``scales``) and whether a server request may set
it for itself (``per_request``). The command-line flags (``add_flags``), the validation of the engine's,
a policy's and a request's values (``problem``), and the documentation's tables (``markdown_table``) are made
from those declarations.

Fitting to the window: the papers' defaults were set for models with an 8K window (Llama-3-8B). For a
smaller window a ``scales`` default shrinks by window / PAPER_WINDOW, so that the attended list still fits
the window the model was trained on (``fitted``). Only defaults scale; a value the user gives is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

PAPER_WINDOW = 8192  # the window the papers' defaults were set for (Llama-3-8B)


def setting(default: Any, help: str, *, kind: type | None = None, **description):
    """A dataclass field with its description: ``help``, and ``Spec``'s keywords (unit, low, high, choices, scales,
    per_request, none). kind: the value's type on the command line (default: the default's type)."""
    kind = kind or (type(default) if default is not None else str)
    return dataclasses.field(default=default, metadata=dict(help=help, kind=kind, **description))


@dataclass(frozen=True)
class Spec:
    """One setting as declared (``setting``). none: what None means, where None is allowed."""

    name: str
    default: Any
    help: str
    kind: type
    unit: str = ""
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    scales: bool = False
    per_request: bool = False
    none: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def describe_default(self) -> str:
        if self.default is None:
            return self.none or "none"
        text = f"{self.default}" + (f" {self.unit}" if self.unit else "")
        return text + (f" x min(1, window/{PAPER_WINDOW})" if self.scales else "")

    def describe_range(self) -> str:
        if self.choices:
            return ", ".join(map(str, self.choices))
        if self.low is None and self.high is None:
            return ""
        # the unit here too: a setting whose default is None (described by its ``none`` text) shows it only here
        return f"[{'-inf' if self.low is None else self.low}, {'inf' if self.high is None else self.high}]" + (
            f" {self.unit}" if self.unit else "")


def specs(settings_type) -> list[Spec]:
    """The declared settings of a settings dataclass, in order."""
    return [Spec(f.name, f.default, **f.metadata) for f in dataclasses.fields(settings_type)]


def problem(spec: Spec, value: Any, high: float | None = None) -> str | None:
    """Why ``value`` is not a valid value of the setting (None: it is). high: a tighter upper bound."""
    if value is None:
        return None if spec.default is None or spec.none else f"{spec.name} must be set"
    if spec.choices is not None:
        return None if value in spec.choices else (
            f"{spec.name} must be one of {', '.join(map(str, spec.choices))}, not {value!r}")
    if spec.kind in (int, float):
        whole = spec.kind is int
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not isinstance(value, int)):
            return f"{spec.name} must be a {'whole number' if whole else 'number'}, not {value!r}"
        if math.isnan(value):
            return f"{spec.name} must be a number, not {value!r}"
        top = spec.high if high is None else high if spec.high is None else min(spec.high, high)
        if (spec.low is not None and value < spec.low) or (top is not None and value > top):
            if spec.low is not None and top is None:
                return f"{spec.name} must be >= {spec.low}, not {value}"
            return f"{spec.name} must be in [{spec.low}, {top}], not {value}"
    return None


def check(settings_type, values: dict, what: str) -> None:
    """ValueError for a name the settings type does not have, or a value out of its range."""
    known = {spec.name: spec for spec in specs(settings_type)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{what} takes no setting {', '.join(unknown)} (it takes: {', '.join(known) or 'none'})")
    for name, value in values.items():
        why = problem(known[name], value)
        if why is not None:
            raise ValueError(why)


def fitted(settings_type, values: dict, window: int) -> dict:
    """Every setting of the type: the given values, and the defaults, those that ``scales`` fitted to ``window``."""
    shrink = min(1.0, window / PAPER_WINDOW)
    out = {}
    for spec in specs(settings_type):
        if spec.name in values:
            out[spec.name] = values[spec.name]
        elif spec.scales and spec.default:
            out[spec.name] = max(1, int(spec.default * shrink))
        else:
            out[spec.name] = spec.default
    return out


def scaled(settings_type, values: dict, window: int) -> list[str]:
    """The settings whose defaults ``fitted`` shrank for ``window`` (those not in ``values``)."""
    if window >= PAPER_WINDOW:
        return []
    return [spec.name for spec in specs(settings_type) if spec.scales and spec.default and spec.name not in values]


def add_flag(group, spec: Spec, text: str, choices: list | None = None) -> None:
    """The setting's flag (``--k``, ``--n-local``, ...), unset by default (so that a config file or the declared
    default applies). choices: those of the flag (default: the setting's)."""
    if spec.kind is bool:
        group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif spec.choices is not None:
        group.add_argument(spec.flag, choices=choices or list(spec.choices), help=text)
    else:
        group.add_argument(spec.flag, type=spec.kind, help=text)


def add_flags(group, settings_type, skip: tuple = ()) -> None:
    """A flag per setting, with the setting's help, default, unit and range in its help text."""
    for spec in specs(settings_type):
        if spec.name not in skip:
            add_flag(group, spec, f"{spec.help} (default {spec.describe_default()}" + (
                f"; {spec.describe_range()})" if spec.describe_range() else ")"))


def markdown_table(settings_type) -> str:
    """The settings as a Markdown table: setting, flag, default, range, per request, meaning."""
    rows = ["| setting | flag | default | range | per request | meaning |", "|---|---|---|---|---|---|"]
    for spec in specs(settings_type):
        rows.append(f"| `{spec.name}` | `{spec.flag}` | {spec.describe_default()} | {spec.describe_range()} | "
                    f"{'yes' if spec.per_request else ''} | {spec.help} |")
    return "\n".join(rows)


class Validated:
    """Base of a settings dataclass: a value out of its declared range raises ValueError when it is made."""

    def __post_init__(self):
        check(type(self), vars(self), type(self).__name__)


CHUNK_ATTENTION = ("auto", "triton", "cudnn")  # ``kernels.chunk_attention_backend`` resolves them


@dataclass(frozen=True)
class EngineSettings(Validated):
    """What the engine runs with, whatever the policy (``LLM(...)`` keywords, ``tokenselect`` flags)."""

    kernels: str | None = setting(None, "kernels of the policies and of attention", choices=("triton", "torch"),
                                  none="triton on CUDA, torch on the CPU")
    chunk_attention: str = setting("auto", "what runs a prefill chunk's attention over its selected list: triton (the "
                                           "sparse attention kernel), cudnn (PyTorch's cuDNN attention over the "
                                           "list's rotated keys and gathered values, 1.5x the kernel over "
                                           "TokenSelect's chunks on an H200; CUDA, bf16/fp16, chunks of a multiple "
                                           "of 64 queries), auto: cudnn on Hopper GPUs, else triton",
                                   choices=CHUNK_ATTENTION)
    rope_scaling: str | None = setting(None, "override RoPE scaling, e.g. dynamic:4, ntk:8, yarn:4, linear:2",
                                       none="the checkpoint's")
    chunk_size: int | None = setting(None, "prefill chunk", unit="tokens", low=1, kind=int,
                                     none="512, or window/4 if smaller; 4 times that for TokenSelect, whose groups "
                                          "of prefill_group queries choose as chunks of that size would")
    dtype: str = setting("auto", "weights' and activations' dtype: auto (fp32 on CPU, bf16 on GPU), float32, "
                                 "bfloat16, float16")
    weight_dtype: str = setting("auto", "the four projections of every layer: auto (in dtype), fp8 (e4m3 with one "
                                        "scale a matrix: half the weight bytes a decode step reads, whose rows are "
                                        "multiplied as they are, and the fp8 matrix rate over a prefill chunk, whose "
                                        "rows are quantized with a scale a token; Hopper GPUs and CPUs; each "
                                        "matrix quantized as the checkpoint is read, so a model whose 16-bit "
                                        "weights would not fit loads; the embeddings, norms and output head stay "
                                        "in dtype)", choices=("auto", "fp8"))
    device: str | None = setting(None, "cpu or cuda", none="cuda if available")
    kv_cache_tokens: int | None = setting(None, "size of the KV pool", unit="tokens", low=1, kind=int,
                                          none="what fits in the free memory")
    kv_dtype: str = setting("auto", "KV storage dtype (auto: the model's; fp8 halves the pool)",
                            choices=("auto", "fp8", "bf16", "fp16", "fp32"))
    kv_offload: str = setting("none", "values: keep the V pool in pinned host memory and only K on the GPU, which "
                                      "roughly doubles the tokens that fit; the GPU gathers the values it attends "
                                      "over the bus, keeping each layer's last ones on the device for the next step",
                              choices=("none", "values"))
    select_dtype: str = setting("auto", "fp8: keep an fp8 copy of the keys for TokenSelect and ReAttention to "
                                        "score, so that a selection reads half the bytes of bf16 keys (attention "
                                        "still reads the KV pool; costs one byte per key element, so the pool "
                                        "holds a fifth fewer tokens); kv: selection reads the KV pool's keys; "
                                        "auto: fp8 when the engine starts with TokenSelect on a GPU over a 16-bit "
                                        "pool without value offload (measured to lose no accuracy on the real "
                                        "models' tables), else kv; kv where KV memory bounds a server's batch (the "
                                        "pool holds 5/4 the tokens)", choices=("auto", "fp8", "kv"))
    max_model_len: int | None = setting(None, "longest prompt + generation", unit="tokens", low=1, kind=int,
                                        none="the KV pool's size")
    max_num_seqs: int = setting(64, "sequences running at once; 1 gives every prefill chunk a step of its own, "
                                    "which runs as one CUDA graph", low=1)
    cuda_graphs: bool | None = setting(None, "run decode steps and long prompts' prefill chunks as one CUDA graph "
                                             "each, attention included, and other steps' layers as graphs around "
                                             "attention", kind=bool, none="on with CUDA")
    tail_chunk: int = setting(0, "run the prompt's last N tokens (typically the question) as a prefill chunk of their "
                                 "own, so that a policy choosing with a chunk's mean query (TokenSelect, ReAttention) "
                                 "chooses for the question rather than for the question averaged with the context "
                                 "before it; full attention is unchanged; 0: off", unit="tokens", low=0)
    prefix_cache: bool = setting(True, "keep the KV of computed prompts while the pool has room, so that a request "
                                       "starting with the same tokens (another question about the same document, a "
                                       "chat's next turn) starts its prefill after them; --no-prefix-cache computes "
                                       "every prompt in full", kind=bool)
    overlap_decode: bool = setting(True, "launch a decode step (greedy, or sampled without a seed: its tokens drawn on "
                                         "the GPU) before reading the previous step's tokens back, so that the GPU "
                                         "does not wait while the host reads tokens, checks stops and prepares the "
                                         "next step; after a sequence's end-of-sequence token or stop string one step "
                                         "of it is computed and dropped; --no-overlap-decode runs one step at a time",
                                   kind=bool)
    tensor_parallel_size: int = setting(1, "GPUs (processes) the model is split across, by heads: one process per "
                                           "rank, started by the engine (or by torchrun across hosts, "
                                           "docs/tensor_parallel.md); NCCL on CUDA, gloo on a CPU", low=1)
    tp_selection: str = setting("global", "with tensor_parallel_size > 1, how a policy's vote over heads spans the "
                                          "ranks: global (summed over every rank's heads: the choice one GPU "
                                          "makes) or local (each rank chooses by its own heads, no collective)",
                                choices=("global", "local"))


@dataclass(frozen=True)
class NoSettings(Validated):
    """A policy that takes no settings (full attention)."""
