"""Rotary position embedding: inverse frequencies for every scaling type, and the rotation itself.

Keys are cached *before* RoPE; attention rotates queries and gathered keys at the positions the
attention policy chooses. So RoPE is a pure function of (vectors, positions, inv_freq), and the
frequencies are a property of the model config (plus the current length, for dynamic NTK).

The formulas follow Hugging Face ``modeling_rope_utils`` so that checkpoints behave as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """What a model's config says about RoPE. ``kind`` is one of
    default | linear | dynamic | yarn | llama3 (from a checkpoint) or ntk (a user override)."""

    head_dim: int
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    max_position: int = 2048  # config.max_position_embeddings
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn
    freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (a GGUF's rope_freqs, Llama 3.1)

    KINDS = ("default", "linear", "dynamic", "yarn", "llama3")

    @classmethod
    def from_hf(cls, cfg: dict, head_dim: int) -> "RopeSpec":
        """Read a HF config dict, in either the v4 (``rope_theta`` + ``rope_scaling``) or the v5
        (``rope_parameters``) layout."""
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        params.update(scaling)
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in cls.KINDS:
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(cls.KINDS)})")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        orig = params.get("original_max_position_embeddings")
        if kind == "yarn" and orig is None:
            orig = max_pos
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            kind=kind,
            factor=float(params.get("factor") or 1.0),
            max_position=max_pos,
            original_max_position=int(orig) if orig is not None else None,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            freq_factors=tuple(params["freq_factors"]) if params.get("freq_factors") else None,
        )

    def with_scaling(self, kind: str, factor: float) -> "RopeSpec":
        """A copy with a user override such as ``dynamic:4`` (the baselines' NTK rows)."""
        if kind not in ("ntk", "linear", "dynamic", "yarn"):
            raise ValueError(f"unknown rope scaling {kind!r}; use ntk, linear, dynamic or yarn")
        return RopeSpec(
            head_dim=self.head_dim, theta=self.theta, kind=kind, factor=float(factor),
            max_position=self.max_position, original_max_position=self.max_position,
        )

    def inv_freq(self, seq_len: int = 0) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin scale (YaRN's mscale).

        ``seq_len`` is the length attended so far; only dynamic NTK depends on it."""
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        base_freq = 1.0 / (self.theta ** exponents)
        if self.freq_factors is not None:  # llama.cpp divides each frequency by its factor
            if len(self.freq_factors) != d // 2:
                raise ValueError(f"{len(self.freq_factors)} rope frequency factors for head_dim {d}")
            base_freq = base_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.kind == "default":
            return base_freq, 1.0
        if self.kind == "linear":
            return base_freq / self.factor, 1.0
        if self.kind == "ntk":  # static NTK-aware: base stretched once by factor^(d/(d-2))
            return 1.0 / ((self.theta * self.factor ** (d / (d - 2))) ** exponents), 1.0
        if self.kind == "dynamic":
            return self.dynamic_inv_freq(torch.tensor([seq_len]), base_freq), 1.0
        if self.kind == "llama3":
            return self._llama3(base_freq), 1.0
        return self._yarn()

    def dynamic_inv_freq(self, length: torch.Tensor, base_freq: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK (HF "dynamic"): the base grown with the attended length, as tensor operations on length's
        device, so that a step recorded as a CUDA graph follows its length without a host read. length: int64 [1],
        the tokens attended so far; base_freq: [head_dim // 2] fp32 on the same device, the frequencies up to the
        window. The grown base is computed in fp64 and rounded to fp32 before the power, as transformers' Python
        float is."""
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=length.device).float() / d
        # at or below the window the base stays (the where); clamped so that no power of a negative is computed
        growth = (self.factor * length.double() / self.max_position - (self.factor - 1)).clamp_min(1.0)
        base = (self.theta * growth ** (d / (d - 2))).float()
        return torch.where(length > self.max_position, 1.0 / base ** exponents, base_freq)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position or self.max_position
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self) -> tuple[torch.Tensor, float]:
        d, base, factor = self.head_dim, self.theta, self.factor
        orig = self.original_max_position or self.max_position

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = self.attention_factor
        if attn is None:
            if self.mscale and self.mscale_all_dim:
                attn = get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
            else:
                attn = get_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attn)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Apply RoPE (HF's rotate-half layout) to ``x: [n, heads, head_dim]`` at ``positions: [n]``.

    cos/sin are computed in fp32 and cast to ``x.dtype`` before the rotation, as HF does."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]  # [n, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = (emb.cos() * scale).to(x.dtype)[:, None, :]
    sin = (emb.sin() * scale).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
