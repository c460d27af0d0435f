"""Two-stage selection on a real model's keys and queries, on a CPU (issue #28's first idea: score block summaries
first, then tokens only inside the best blocks, so that a selecting step reads a fraction of the keys). The head soft
votes of TokenSelect's calls are recorded as ``selection_key_bits_cpu.py`` records them (SmolLM2 over the shipped
prose, theta off), and each call is answered again in two stages:

1. a first stage scores every block of BLOCK consecutive candidates by a summary of its keys, per head, and the heads
   vote on the blocks as TokenSelect's heads vote on tokens (a softmax over the blocks, summed over the heads; or the
   plain sum of the heads' scores); the best blocks holding ``keep`` tokens are kept;
2. a second stage takes TokenSelect's soft vote over the kept tokens alone (their own softmax per head), over the
   keys as cached or over their fp8 copy (what the engine scores today), and chooses its top k.

Summaries, with the bytes they cost a token and kv head at head_dim d in bf16:
- bound: Quest's upper bound sum_c max(q_c min_c, q_c max_c) over the block's per-channel min and max (4d / BLOCK);
- mean: the dot product with the block's mean key (2d / BLOCK).

Reported against the vote over every candidate's keys as cached (the reference): holds, the share of the reference's
top-k inside the kept blocks; recall, the share of the reference's top-k that the two stages choose; mass, the
reference vote the choice carries over the reference's own. The engine's fp8 selection keys, which lost nothing on the
real-model accuracy tables, choose 83-89% of the reference's tokens at these sizes (``selection_key_bits_cpu.md``):
the yardstick for recall.

    PYTHONPATH=$PWD/benchmarks python3 benchmarks/block_first_stage_cpu.py --model smollm2-135m-instruct
    PYTHONPATH=$PWD/benchmarks python3 benchmarks/block_first_stage_cpu.py --model qwen2.5-coder-0.5b-instruct \
        --dense-until 0
"""
from __future__ import annotations

import argparse
import itertools

import torch

from selection_key_bits_cpu import record  # benchmarks/, beside this script
from tokenselect.kernels.head_vote import head_soft_vote_ref


def block_scores(q: torch.Tensor, keys: torch.Tensor, block: int, summary: str) -> torch.Tensor:
    """q [H, d], keys [N, n_kv, d] (fp32) -> [H, ceil(N / block)]: each head's score of each block of ``block``
    consecutive keys by its summary (the last block may be shorter)."""
    n, n_kv, d = keys.shape
    group = q.shape[0] // n_kv
    pad = -n % block
    qk = q.view(n_kv, group, d)  # heads by kv head
    if summary == "bound":  # the last block padded with its last key, which moves neither its min nor its max
        blocks = torch.cat([keys, keys[-1:].expand(pad, -1, -1)]).view(-1, block, n_kv, d)
        low, high = blocks.amin(dim=1), blocks.amax(dim=1)  # [nb, n_kv, d]
        per_head = torch.maximum(qk[None] * low[:, :, None], qk[None] * high[:, :, None]).sum(-1)  # [nb, n_kv, g]
    else:  # padded with zeros, each block's sum over its own count
        blocks = torch.cat([keys, keys.new_zeros(pad, n_kv, d)]).view(-1, block, n_kv, d)
        counts = torch.full((blocks.shape[0], 1, 1), float(block))
        counts[-1] = block - pad
        per_head = torch.einsum("kgd,bkd->bkg", qk, blocks.sum(dim=1) / counts)
    return per_head.reshape(-1, q.shape[0]).T


def first_stage(q: torch.Tensor, keys: torch.Tensor, scale: float, block: int, summary: str, vote: str,
                keep: int) -> torch.Tensor:
    """The kept candidates' indices (ascending): the best blocks, by the heads' vote, holding ``keep`` tokens."""
    scores = block_scores(q, keys, block, summary) * scale
    ballot = torch.softmax(scores, dim=-1).sum(0) if vote == "soft" else scores.sum(0)
    best = ballot.topk(min(-(-keep // block), ballot.numel())).indices
    tokens = (best[:, None] * block + torch.arange(block)[None]).flatten()
    return tokens[tokens < keys.shape[0]].sort().values


def compare(calls: list[dict], k: int, blocks: list[int], keeps: list[int]) -> dict[tuple, list[tuple]]:
    """(phase, summary, vote, block, keep in k) -> [(holds, recall over the cached keys, recall over fp8, mass over
    fp8)] over the calls."""
    out: dict[tuple, list[tuple]] = {}
    for call in calls:
        q, keys, scale = call["q"], call["keys"], call["scale"]
        n = keys.shape[0]
        ref = head_soft_vote_ref(q, keys, torch.arange(n), scale)
        want = ref.topk(k).indices
        best = float(ref[want].sum())
        fp8 = keys.to(torch.float8_e4m3fn).float()
        for summary, vote, block, keep in itertools.product(("bound", "mean"), ("soft", "sum"), blocks, keeps):
            kept = first_stage(q, keys, scale, block, summary, vote, keep * k)
            holds = torch.isin(want, kept).float().mean().item()
            row = [holds]
            for pool in (keys, fp8):
                second = head_soft_vote_ref(q, pool, kept, scale)
                got = kept[second.topk(min(k, kept.numel())).indices]
                row.append(torch.isin(want, got).float().mean().item())
            row.append(float(ref[got].sum()) / best)
            out.setdefault((call["phase"], summary, vote, block, keep), []).append(tuple(row))
        ref8 = head_soft_vote_ref(q, fp8, torch.arange(n), scale).topk(k).indices  # today's one stage, for scale
        out.setdefault((call["phase"], "none (fp8 keys, one stage)", "soft", 1, 0), []).append(
            (1.0, 1.0, torch.isin(want, ref8).float().mean().item(), float(ref[ref8].sum()) / best))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=16384, help="prose tokens prefilled before the decode steps")
    ap.add_argument("--steps", type=int, default=8, help="decode steps, each selecting")
    ap.add_argument("--every", type=int, default=7, help="record every N-th vote call (all layers come round)")
    ap.add_argument("--dense-until", type=int, help="TokenSelect's dense_until (0: select inside the window too, "
                                                        "for a model whose window holds TOKENS)")
    ap.add_argument("--k", type=int, default=256, help="tokens chosen (at 16K tokens the policy's 2048 is an eighth of "
                                                       "the candidates, where at 1M it is 0.2%%)")
    ap.add_argument("--blocks", default="8,16,32", help="first-stage block sizes, tokens")
    ap.add_argument("--keeps", default="2,4,8", help="tokens the first stage keeps, in multiples of k")
    args = ap.parse_args()
    torch.manual_seed(0)
    settings = {} if args.dense_until is None else {"dense_until": args.dense_until}
    calls, _ = record(args.model, args.tokens, args.steps, args.every, settings)
    blocks, keeps = [int(b) for b in args.blocks.split(",")], [int(m) for m in args.keeps.split(",")]
    results = compare(calls, args.k, blocks, keeps)
    print(f"\n| {args.model}, {args.tokens} tokens of prose, k {args.k}: summary | heads' vote | block | keeps | phase "
          f"| calls | holds mean (min) | recall, cached keys, mean (min) | recall, fp8 keys, mean (min) | mass, fp8 "
          f"keys, mean (min) |\n|---|---|---|---|---|---|---|---|---|---|")
    for (phase, summary, vote, block, keep), rows in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1] != (
            "none (fp8 keys, one stage)"), kv[0][1:])):
        cells = " | ".join(f"{sum(c) / len(c):.1%} ({min(c):.1%})" for c in zip(*rows))
        print(f"| {summary} | {vote} | {block} | {keep}k | {phase} | {len(rows)} | {cells} |")


if __name__ == "__main__":
    main()
