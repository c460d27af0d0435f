"""TokenSelect: token-level, per-head query-key criticality with a head vote (Wu et al., 2024).

For a chunk the middle of the cache is scored against the chunk-mean un-rotated query; every
kv head is read in place through the slot list (paged dot product) from the cache's selection keys
(``KVCache.k_select``: the K pool, or its fp8 copy with ``select_dtype="fp8"``), the per-head scores are
combined by one of three selectors, and the top ``k`` tokens are attended together with the
sinks and the local window. Decode steps go through the Selection Cache.

Selectors (paper eqs. 5-7), over scores s[h, t] = scale * <q_h, K[t, h // group]>:
    topk       sum_h s[h, t]                       (one loud head dominates)
    hard_vote  sum_h [t in top-k of head h]        (one vote per head, counted)
    soft_vote  sum_h softmax_t(s[h, :])[t]         (one normalised vote per head; default)

With ``neighbours`` r > 0 (not the paper's; off by default) a token's vote is the best vote within r tokens of it,
so the top-k takes runs of tokens around the best-voted ones (a needle's whole sentence, as ReAttention's spans and
InfLLM's blocks attend), still k distinct tokens, each run's tokens tied and taken first to last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import Validated, setting
from .base import (SELECT, PolicyStats, SelectivePolicy, SeqStep, batch_lengths, batch_once, dense_until_setting,
                   n_init_setting, n_local_setting, positions_setting, rows)
from .selection_cache import SelectionCache

SELECTORS = ("soft_vote", "hard_vote", "topk")


@dataclass(frozen=True)
class TokenSelectSettings(Validated):
    k: int = setting(2048, "tokens selected from the middle of the cache", unit="tokens", low=0, scales=True,
                     per_request=True)
    n_init: int = n_init_setting(128)
    n_local: int = n_local_setting(512)
    theta: float | None = setting(0.9, "Selection Cache threshold on cos(q, q_cached); 1.0 never reuses",
                                  low=-1.0, high=1.0, per_request=True, none="off: every decode step selects")
    selector: str = setting("soft_vote", "head vote", choices=SELECTORS)
    neighbours: int = setting(0, "a token's vote is the best within this many tokens on either side, so runs of "
                                 "tokens around the best-voted are selected (0: each token on its own vote)",
                              unit="tokens", low=0)
    prefill_group: int = setting(512, "prefill queries that choose together, with their mean query: a prefill chunk "
                                      "longer than this chooses for each group of this many of its queries, as "
                                      "chunks of this size would (the groups' choices in one launch of each "
                                      "selection kernel), so that a longer --chunk-size runs the model's matrix "
                                      "products on more rows without coarsening the choice; 0: a chunk chooses once",
                                 unit="tokens", low=0)
    score_scale: str = setting("raw", "per-head softmax scale for the vote: raw, sqrt_d or a number")
    positions: str = positions_setting()
    dense_until: int | None = dense_until_setting()


class TokenSelect(SelectivePolicy):
    name = "tokenselect"
    Settings = TokenSelectSettings
    fp8_selection_keys = True
    batch_choice = True

    def __init__(self, cache: KVCache, kernels: Kernels, **settings):
        s = self.Settings(**settings)
        super().__init__(cache, kernels, n_init=s.n_init, n_local=s.n_local, budget=s.k, positions=s.positions,
                         dense_until=s.dense_until)
        self.k, self.selector, self.neighbours, self.prefill_group = s.k, s.selector, s.neighbours, s.prefill_group
        self.scale = resolve_score_scale(s.score_scale, cache.k.shape[-1])
        # an entry: a miss's choice, [k] indices into the middle
        self.selection_cache = SelectionCache(s.theta, cache.k.shape[0], s.k, kernels.selection_check,
                                              kernels.selection_update)

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The ``k`` middle tokens with the highest vote, without a branch. A prefill chunk selects with its mean
        query. A decode step's query is its own (a view: no kernel), and goes through the Selection Cache, whose
        decision gates the work: on a hit the vote and the top-k see no live candidate (their kernels read
        nothing; the top-k's picks are discarded), and the store-or-reuse returns the cached choice."""
        query = q[0] if step.decode else self.kernels.query_mean(q, q.dtype)
        middle, live = self.middle(step)
        return self.select(layer, step.row, query, middle, live, step.decode), None

    def choose_batch(self, layer: int, steps: list[SeqStep], q: torch.Tensor) -> torch.Tensor | None:
        """``choose`` for a batch of decode steps, or of a prefill chunk's groups of queries (``query_groups``): the
        Selection Cache's check (decode), the vote, the top-k and the store-or-reuse (decode) each in one launch for
        the batch (the sequences' tables, lengths and rows read as strided views of the graph's inputs; a chunk's
        groups share one slot list, which the scores kernel reads once for all), not one a sequence. Another
        selector, or a cache whose queries span tensor-parallel ranks, chooses per sequence (None)."""
        if self.selector != "soft_vote" or self.selection_cache.heads.spans_ranks:
            return None
        middles = rows([self.middle(step)[0] for step in steps])
        live = batch_once(steps, f"length - {self.n_init + self.n_local}",
                          lambda: batch_lengths(steps) - (self.n_init + self.n_local))
        seq_rows = rows([step.row.view(1) for step in steps]).view(-1)
        decode = steps[0].decode
        query = q[:, 0] if decode else self.kernels.query_mean(q, q.dtype)
        return self.select(layer, seq_rows, query, middles, live, decode)

    def query_groups(self, step: SeqStep, w: int) -> tuple[int, list[SeqStep]] | None:
        """A selecting prefill chunk of more than ``prefill_group`` queries: its groups, each a SeqStep whose length
        counts the chunk's tokens before the group (the chunk's keys are all cached before a layer attends, and a
        group's list holds none past its own), made once a step. Every group selects, as the chunk does: the
        scheduler ends a chunk where chunks of the group's size would change from attending every token to
        selecting (``prefill_cut``)."""
        g = self.prefill_group
        if step.decode or step.mode != SELECT or not 0 < g < w:
            return None

        def groups():
            lengths = step.length + self.cache.arange(-(-w // g)) * g
            return [SeqStep(step.table, length, step.row, False, SELECT, step.buffers) for length in lengths]
        return g, step.once(f"groups of {g} of {w}", groups)

    def select(self, layer: int, row: torch.Tensor, query: torch.Tensor, middle: torch.Tensor, live: torch.Tensor,
               decode: bool) -> torch.Tensor:
        """The choice of one sequence (row int64 [], query [n_heads, d], middle [M], live int64 []) or of a batch
        (decode steps, or a prefill chunk's groups: row [B], query [B, n_heads, d], middle [B, M], live [B]): [k] or
        [B, k] indices into the middle. A decode step goes through the Selection Cache."""
        sc = self.selection_cache
        miss, candidates = sc.decide(row, layer, query, live) if decode else (None, live)
        picks = self.top(query, self.cache.k_select[layer], middle, candidates)
        return picks if miss is None else sc.update(row, layer, query, picks, miss)

    def prefill_cut(self, t: int, n: int) -> int:
        """Up to the first group that selects where the chunk's first group attends every token (``mode``: a group
        selects once the context outgrows sinks + k + window and its end passes ``dense_until``), so that a chunk's
        groups all attend in the mode a chunk of the group's size would."""
        g = self.prefill_group
        if not 0 < g < n or self.mode(t, g) == SELECT:
            return n
        starts = range(t + g, t + n, g)
        return next((start - t for start in starts if self.mode(start, min(g, t + n - start)) == SELECT), n)

    @classmethod
    def prefix_grain(cls, settings: dict, chunk: int) -> int:
        """The group where it divides the chunk: each group's choice is its own queries', as a chunk of its size
        would make it (``prefill_cut`` keeps the modes), so a prefix ending at any group's start is what a prompt
        computes there."""
        g = settings.get("prefill_group", cls.Settings.prefill_group)
        return g if 0 < g < chunk and chunk % g == 0 else chunk

    def prepare(self, seq_id: int, slots: torch.Tensor, t: int, capacity: int, decode: bool,
                q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        return self.selection_cache.row(seq_id, q_shape[1] * q_shape[2], slots.device)

    def across_ranks(self, heads) -> None:
        """The vote and the Selection Cache's cosine (over the query's every head) span the ranks' heads."""
        super().across_ranks(heads)
        self.selection_cache.heads = heads

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        sc = self.selection_cache
        return () if sc.unit is None else (sc.unit, sc.selection, sc.valid, sc.device_counts)

    def votes(self, query: torch.Tensor, k_pool: torch.Tensor, middle: torch.Tensor,
              live: torch.Tensor | None = None) -> torch.Tensor:
        """query: [n_heads, head_dim] in the dtype the kernels compute in (the model's; never cast to the
        pool's, which may be fp8), k_pool: [n_slots, n_kv, d], middle: [M] -> vote [M] fp32.
        live: None, or int64 []: only middle[:live] are candidates, the others vote -inf.
        A batch (soft vote): query [B, n_heads, head_dim], middle [B, M], live [B] -> [B, M]."""
        kern = self.kernels
        if self.selector == "soft_vote":  # summed over every rank's heads (``heads``), as over one GPU's
            return self.spread(self.heads.sum(kern.head_soft_vote(query, k_pool, middle, self.scale, live)))
        scores = kern.paged_dot(query, k_pool, middle) * self.scale  # [H, M]
        dead = None if live is None else self.cache.arange(middle.numel()) >= live
        if dead is not None:
            scores = scores.masked_fill(dead, float("-inf"))
        if self.selector == "topk":
            vote = scores.sum(dim=0)
        else:
            per_head = torch.topk(scores, min(self.k, scores.shape[1]), dim=1).indices  # [H, k]
            vote = torch.zeros(scores.shape[1], device=scores.device).scatter_add_(
                0, per_head.flatten(), torch.ones(per_head.numel(), device=scores.device))
        return self.spread(self.heads.sum(vote if dead is None else vote.masked_fill(dead, float("-inf"))))

    def spread(self, vote: torch.Tensor) -> torch.Tensor:
        """``neighbours`` r > 0: each token's vote [M] (or a batch's [B, M]) becomes the largest within r tokens of it
        (a max filter; the ends see fewer). Tokens past the live middle vote -inf and lend no vote; the top-k takes
        none of them (``top``: its live count)."""
        r = self.neighbours
        if r == 0:
            return vote
        return F.max_pool1d(vote.unsqueeze(-2), 2 * r + 1, stride=1, padding=r).squeeze(-2)

    def top(self, query: torch.Tensor, k_pool: torch.Tensor, middle: torch.Tensor,
            live: torch.Tensor | None = None) -> torch.Tensor:
        """Sorted indices into ``middle`` of the ``k`` tokens with the highest vote (among middle[:live]); for a
        batch (``votes``) [B, k]."""
        return self.kernels.topk(self.votes(query, k_pool, middle, live), self.k, live)

    def release(self, seq_id: int) -> None:
        self.selection_cache.release(seq_id)

    def stats(self) -> PolicyStats:
        return PolicyStats(*self.selection_cache.counts())


def resolve_score_scale(score_scale: str | float, head_dim: int) -> float:
    """'raw' -> 1 (the official code's raw dot products), 'sqrt_d' -> 1/sqrt(head_dim), or a number."""
    if score_scale == "raw":
        return 1.0
    if score_scale == "sqrt_d":
        return 1.0 / math.sqrt(head_dim)
    try:
        return float(score_scale)
    except (TypeError, ValueError):
        raise ValueError(f"score_scale must be 'raw', 'sqrt_d' or a number, not {score_scale!r}") from None
