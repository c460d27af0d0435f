"""Sampling settings and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .transfer import to_device

# Below this a temperature divides logits into infinities (NaN probabilities): it samples as greedy, which
# is what such a temperature means anyway.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's top_logprobs limit)
NAN_LOGITS = "the model's logits for this sequence hold a NaN: no token can be drawn"


@dataclass
class SamplingParams:
    """max_tokens: new tokens at most. temperature 0 is greedy (deterministic). top_k 0 and top_p 1
    disable those filters. stop: strings that end generation (not included in the text).
    seed: makes a sampled request reproducible. ignore_eos: keep going past end-of-sequence.
    logprobs: None, or n: record each new token's log-probability and those of the n likeliest tokens at
    its position (``Sequence.logprobs``), from the model's distribution before temperature, top-k and top-p."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, not {self.stop!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], not {self.logprobs}")


def greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def sample_rows(rows: list[torch.Tensor], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int | Exception]:
    """rows: [vocab] fp32 logits of several sequences -> each one's next token, or the exception its sampling raised
    (NaN logits). The greedy rows and those sampled without a seed are drawn together on the logits' device
    (``sample_on_device``) with one read to the host (a step of B such sequences waits for the device once, not B
    times); a seeded row draws from its own host generator (``sample``), so that its tokens repeat."""
    tokens: list[int | Exception] = [0] * len(rows)
    picked = [i for i, p in enumerate(params) if on_device(p)]
    if picked:
        drawn, failed = sample_on_device(torch.stack([rows[i] for i in picked]), [params[i] for i in picked])
        for i, token, bad in zip(picked, *torch.stack([drawn, failed.long()]).tolist()):  # one read
            tokens[i] = RuntimeError(NAN_LOGITS) if bad else token
    for i, (row, p, generator) in enumerate(zip(rows, params, generators)):
        if not on_device(p):
            try:
                tokens[i] = sample(row, p, generator)
            except Exception as error:
                tokens[i] = error
    return tokens


def on_device(params: SamplingParams) -> bool:
    """Whether ``sample_on_device`` draws this request's tokens: greedy, or sampled without a seed (a seeded request
    draws from its own host generator, ``sample``, so that its tokens repeat)."""
    return greedy(params) or params.seed is None


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, vocab] fp32 -> (tokens [B] int64, failed [B] bool), each row's next token where the logits are,
    with no read to the host (a step queued before the previous one is read takes these as its input). Greedy rows
    take their argmax; the others draw from ``distribution``, as the argmax of probs / q for q drawn from Exp(1) on
    the device, which picks token i with probability probs[i]. failed: the row's logits hold a NaN (or a sampled row
    has no token left to draw); its token is 0, a valid input for a step queued on it, whose result the caller
    drops."""
    picks = logits.argmax(dim=-1)
    failed = logits.isnan().any(dim=-1)
    drawn = [b for b, p in enumerate(params) if not greedy(p)]
    if drawn:
        rows = to_device(drawn, logits.device)
        probs = distribution(logits[rows], [params[b] for b in drawn])
        # q > 0: a q of 0 would make 0 / 0 a NaN, which argmax takes for the largest
        q = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
        picks = picks.index_copy(0, rows, (probs / q).argmax(dim=-1))
        failed = failed.index_copy(0, rows, probs.isnan().any(dim=-1) | failed[rows])  # all -inf: softmax is NaN
    return picks.masked_fill(failed, 0), failed


def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [B, vocab] fp32 of sampled (not greedy) rows -> the probabilities each row's token is drawn with:
    softmax(logits / temperature) over the top_k largest (0: all), then over the smallest prefix of those, likeliest
    first, whose mass reaches top_p (always at least the likeliest token). No read to the host."""
    dev = logits.device
    x = logits / to_device([p.temperature for p in params], dev, torch.float32)[:, None]
    if any(p.top_k > 0 for p in params):
        top_k = to_device([min(p.top_k, x.shape[1]) for p in params], dev)[:, None]  # 0: no cut
        kth = x.sort(dim=-1, descending=True).values.gather(1, (top_k - 1).clamp(min=0))
        x = x.masked_fill((top_k > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        top_p = to_device([p.top_p for p in params], dev, torch.float32)[:, None]
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p, 0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32 of a sampled (not greedy) request -> the next token id, drawn from ``distribution`` with
    ``generator`` (a seeded request's own, on the host)."""
    probs = distribution(logits[None], [params])[0]
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """logits: [vocab] -> (log-probability of ``token``, [(token id, log-probability)] of the n likeliest,
    likeliest first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, n) if n else None
    return float(logprobs[token]), (list(zip(top.indices.tolist(), top.values.tolist())) if n else [])
