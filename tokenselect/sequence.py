"""A request's state as it moves through the engine, and what the user gets back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenize import IncrementalText
from .sampling import SamplingParams


@dataclass
class RequestOutput:
    """text: the generated text; token_ids: the new tokens; finish_reason: 'stop' or 'length'.
    cached_tokens: prompt tokens reused from the prefix cache.
    prefill_s: seconds from the step that ran the prompt's first chunk to the first new token; decode_s: from
    there to the last new token. Wall-clock at step boundaries, so with other sequences in the same steps
    each includes their share."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of being computed


class Sequence:
    """One request: prompt and generated tokens, its slot table in the KV pool, its sampler."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, device: torch.device, policy=None,
                 tokenizer=None):
        """seq_id: unique among the engine's sequences (it keys their policy state)."""
        self.id = seq_id
        self.policy = policy  # the AttentionPolicy that plans this sequence's attention
        self.policy_key: tuple = ()  # the per-request settings that chose it (the engine's bookkeeping)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        # Slot table: slot of token i of the sequence, filled as tokens enter the cache.
        self.slots = torch.empty(len(prompt_ids) + params.max_tokens, dtype=torch.int64, device=device)
        self.n_cached = 0  # tokens whose K/V are in the cache
        # Prefix reuse (``scheduler.py``, ``prefix_cache.py``): how it may share prompt KV (None: it does not),
        # the cached node its first n_shared slots belong to (held while it runs), and how many of its prompt's
        # tokens were reused rather than computed
        self.reuse = None
        self.prefix_node = None
        self.n_shared = 0
        self.cached_tokens = 0
        self.snapshot_at: set[int] = set()  # prompt lengths at which its policy's state goes into the cache too
        self.detokenizer = IncrementalText(tokenizer) if tokenizer is not None else None  # None: no text
        self.finish_reason: str | None = None  # "stop", "length", "abort", or "error" (then ``error`` says why)
        self.error: BaseException | None = None
        self.logits: list[torch.Tensor] | None = None  # a list to record every row's logits
        # perf_counter() at the start of the step that ran its first chunk, at its first and last new token
        self.started_at = self.first_token_at = self.last_token_at = None
        # per generated token, with params.logprobs set: (its log-probability, [(id, log-probability)] of the
        # params.logprobs likeliest tokens), see ``sampling.token_logprobs``
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = [] if params.logprobs is not None else None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def text(self) -> str:
        """The generated text so far (empty without a tokenizer), cut before a stop string once one is hit."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens start..start+n-1 of prompt + output, without copying a long prompt."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:min(start + n, p)] + self.output_ids[max(start - p, 0):start + n - p]

    @property
    def reserved(self) -> int:
        """KV slots this request may need in all: prompt plus every token it may generate."""
        return self.slots.numel()

    @property
    def prefilling(self) -> bool:
        return self.n_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        first, start = self.first_token_at, self.started_at
        return RequestOutput(self.id, self.prompt_ids, list(self.output_ids), self.text, self.finish_reason,
                             first - start if first is not None else 0.0,
                             self.last_token_at - first if first is not None else 0.0, self.cached_tokens)
