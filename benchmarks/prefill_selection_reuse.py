"""Would a Selection Cache pay in prefill? TokenSelect selects once a prefill chunk, with the chunk's mean query; this
records those queries on a real model over real prose and replays the Selection Cache's rule on them (a layer reuses
its last selection while cos(q, the query it was made for) >= theta), for several theta.

It also prices an incremental prefill selection: each chunk votes only over the previous chunk's incremental picks
and the tokens that entered the middle since (about k + chunk candidates, not the whole context), its soft vote
normalised over those candidates; with ``--refresh R`` every R-th selecting chunk of a layer votes over the whole
middle instead (the exact picks, from which the next chunks go on); with ``--pages E`` the candidates also take the
E tokens of the pages QUEST's bound ranks highest (``page_candidates``), so that tokens outside the last picks may
come back. Printed: how many of the exact selection's k
tokens the incremental one keeps (quantiles over chunks and layers), and the share of the middle it scores.

    PYTHONPATH=$PWD python3 benchmarks/prefill_selection_reuse.py MODEL TOKENS CHUNK [--device cpu] [--refresh R] [--pages E]

Prints the share of prefill selections that would be reused and the quantiles of consecutive chunks' cosine.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

from tokenselect import LLM, SamplingParams
from tokenselect.policies.tokenselect import TokenSelect

THETAS = (0.95, 0.9, 0.8)


def reused(queries: dict[int, list[torch.Tensor]], theta: float) -> tuple[int, int]:
    """(selections a Selection Cache at ``theta`` would reuse, selections) over each layer's chunk queries."""
    hits = total = 0
    for qs in queries.values():
        cached = None
        for q in qs:
            if cached is not None and F.cosine_similarity(q, cached, dim=0) >= theta:
                hits += 1
            else:
                cached = q
            total += 1
    return hits, total


PAGE = 16  # tokens a page of the --pages proxy


def page_candidates(query: torch.Tensor, k_pool: torch.Tensor, middle: torch.Tensor, n: int, extra: int,
                    scale: float) -> torch.Tensor:
    """Indices into middle[:n] of the tokens of the ``extra // PAGE`` pages (of PAGE consecutive middle tokens) that
    QUEST's bound ranks highest: per head, sum_d max(q_d * min_d, q_d * max_d) over the page's keys, softmaxed over
    the pages and summed over the heads as TokenSelect's soft vote sums its tokens'. query: [n_heads, d]."""
    pages = n // PAGE
    keys = k_pool[middle[:pages * PAGE]].float()  # [pages * PAGE, n_kv, d]
    keys = keys.view(pages, PAGE, *keys.shape[1:])
    lo, hi = keys.amin(dim=1), keys.amax(dim=1)  # [pages, n_kv, d]
    n_kv, d = lo.shape[1], lo.shape[2]
    q = query.float().view(n_kv, -1, d)  # [n_kv, group, d]
    bound = torch.maximum(q[None] * lo[:, :, None], q[None] * hi[:, :, None]).sum(dim=-1)  # [pages, n_kv, group]
    vote = torch.softmax(bound.reshape(pages, -1) * scale, dim=0).sum(dim=1)
    top = torch.topk(vote, min(pages, extra // PAGE)).indices
    return (top[:, None] * PAGE + torch.arange(PAGE, device=top.device)).flatten()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokens", type=int)
    ap.add_argument("chunk", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--refresh", type=int, default=0, help="every R-th selecting chunk of a layer selects exactly")
    ap.add_argument("--pages", type=int, default=0, help="also this many candidate tokens from the pages QUEST's "
                    "bound ranks highest (page_candidates), for the exact selection's turnover")
    args = ap.parse_args(argv)
    from real_model_checks import prose_ids  # benchmarks/, beside this script

    queries: dict[int, list[torch.Tensor]] = {}
    kept: list[float] = []  # per chunk and layer: the exact picks the incremental selection keeps, a share of k
    scored: list[float] = []  # per chunk and layer: its candidates, a share of the live middle
    last: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (its last incremental picks, the live middle then)
    chunks: dict[int, int] = {}  # layer -> its selecting chunks so far
    select = TokenSelect.select

    def recording(self, layer, row, query, middle, live, decode):
        picks = select(self, layer, row, query, middle, live, decode)
        if not decode:
            queries.setdefault(layer, []).append(query.float().flatten().cpu())
            n = int(live)
            chunks[layer] = chunks.get(layer, 0) + 1
            ours = picks.reshape(-1)[:min(n, self.k)]
            if layer in last and n > self.k:
                before, n_before = last[layer]
                parts = [before, torch.arange(n_before, n, device=before.device)]
                if args.pages:
                    parts.append(page_candidates(query, self.cache.k_select[layer], middle, n, args.pages, self.scale))
                candidates = torch.unique(torch.cat(parts))
                votes = self.votes(query, self.cache.k_select[layer], middle[candidates])
                incremental = candidates[torch.topk(votes, min(self.k, candidates.numel())).indices]
                kept.append(len(set(incremental.tolist()) & set(picks.tolist())) / picks.numel())
                if not (args.refresh and chunks[layer] % args.refresh == 0):
                    ours = incremental
                scored.append((n if ours is not incremental else candidates.numel()) / n)
            last[layer] = (ours, n)
        return picks

    TokenSelect.select = recording
    try:
        llm = LLM(args.model, "tokenselect", device=args.device, kv_cache_tokens=args.tokens + 64,
                  chunk_size=args.chunk, dense_until=0)
        start = time.perf_counter()
        llm.generate([prose_ids(llm, args.tokens)], SamplingParams(max_tokens=1, temperature=0))
    finally:
        TokenSelect.select = select
    print(f"prefill {time.perf_counter() - start:.0f} s, {len(queries[0])} selecting chunks a layer")
    for theta in THETAS:
        hits, total = reused(queries, theta)
        print(f"theta {theta}: {hits}/{total} = {hits / total:.1%} of prefill selections would be reused")
    cos = sorted(F.cosine_similarity(qs[i], qs[i - 1], dim=0).item() for qs in queries.values()
                 for i in range(1, len(qs)))
    print("consecutive chunks' cosine, 10/50/90%:", *(f"{cos[len(cos) * p // 10]:.4f}" for p in (1, 5, 9)))
    if kept:
        kept.sort()
        print(f"incremental selection over {len(kept)} chunk-layers: keeps of the exact picks, 10/50/90%:",
              *(f"{kept[len(kept) * p // 10]:.3f}" for p in (1, 5, 9)), f"(mean {sum(kept) / len(kept):.3f});",
              f"scores {sum(scored) / len(scored):.1%} of the live middle on average")


if __name__ == "__main__":
    sys.exit(main())
