"""Whether the top-k's radix select settles before its last byte on `bench attention`'s 1M chunk vote, on a CPU
(issue #28: on an H200 the fp8 chunk's top-k did not get faster with the early settle). The data are drawn as the
bench draws them (`torch.randn` keys and queries, bf16; a 512-query chunk's mean query), the vote is the reference
head soft vote over bf16 keys and over their fp8 (e4m3) copy, and each byte of the radix select is followed as the
kernel takes it: how many keys share the k-th largest's prefix, how many of them are wanted, and so whether it
settles (every key sharing the prefix wanted). A draw of ours, not the GPU's. With ``--model`` a real model's votes
instead: TokenSelect over TOKENS of the shipped prose, then decode steps selecting at each (theta off), every call of
the top-k recorded (the torch kernels on the CPU), and the share of its votes that settle after each byte.

    python3 benchmarks/vote_settle_cpu.py [--length 1048576]
    PYTHONPATH=$PWD/benchmarks python3 benchmarks/vote_settle_cpu.py --model smollm2-135m-instruct --tokens 16384
"""
import argparse
import dataclasses

import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kernels.head_vote import head_soft_vote_ref


def keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the top-k kernel's uint32 keys (as int64), in the scores' order."""
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    return torch.where((bits >> 31) == 1, ~bits & 0xFFFFFFFF, bits | 0x80000000)


def bytes_followed(vote: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """For each byte of the radix select over ``vote`` [n] (fp32, its live part): (keys that share the k-th largest's
    prefix so far, how many of them are wanted); the select is settled where the two are equal."""
    k = min(k, vote.numel())
    bits, kth = keys(vote), keys(vote.topk(k).values.min().view(1))[0]
    return [(int(((bits >> shift) == kth >> shift).sum()), k - int(((bits >> shift) > kth >> shift).sum()))
            for shift in (24, 16, 8, 0)]


def settles_after(vote: torch.Tensor, k: int) -> int:
    """The byte (1-4) after which the radix select over ``vote`` is settled."""
    return next(byte for byte, (sharing, wanted) in enumerate(bytes_followed(vote, k), 1)
                if sharing == wanted or byte == 4)


def real_model(model: str, tokens: int, steps: int) -> None:
    """The votes of a real model's prefill chunks and decode steps: how many settle after each byte."""
    from real_model_checks import prose_ids  # benchmarks/, beside this script

    llm = LLM(model, "tokenselect", kernels="torch", theta=None, kv_cache_tokens=tokens + steps + 64)
    calls = []
    policy = llm.policy
    topk = policy.kernels.topk

    def recording(scores, k, n_valid=None, values=None, out=None):
        rows = scores if scores.dim() == 2 else scores[None]
        live = [rows.shape[1]] * rows.shape[0] if n_valid is None else n_valid.reshape(-1).tolist()
        calls.append([(rows[b, :n].clone(), k) for b, n in enumerate(live) if n > k])  # n <= k: no select
        return topk(scores, k, n_valid, values, out)

    policy.kernels = dataclasses.replace(policy.kernels, topk=recording)
    ids = prose_ids(llm, tokens)
    seq = llm.add_request(ids, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    while not seq.output_ids:  # the prompt's chunks (the step that ends the prompt samples the first token)
        llm.step()
    first_decode = len(calls)
    while not seq.finished:
        llm.step()
    print(f"| {model}, {tokens} tokens of prose: settled after | byte 1 | byte 2 | byte 3 | byte 4 | votes |\n"
          "|---|---|---|---|---|---|")
    for name, picks in (("prefill chunks", [v for c in calls[:first_decode] for v in c]),
                        ("decode steps", [v for c in calls[first_decode:] for v in c])):
        after = [settles_after(v, k) for v, k in picks]
        shares = [f"{after.count(b) / max(len(after), 1):.0%}" for b in (1, 2, 3, 4)]
        print(f"| {name} | " + " | ".join(shares) + f" | {len(after)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1 << 20)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--model", help="a real model's votes instead (see above)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    if args.model:
        return real_model(args.model, args.tokens, args.steps)
    torch.manual_seed(0)
    heads, kv_heads, d = 32, 8, 128
    query = torch.randn(512, heads, d, dtype=torch.bfloat16).float().mean(0).to(torch.bfloat16)
    k = torch.randn(args.length, kv_heads, d, dtype=torch.bfloat16)
    slots = torch.arange(args.length)
    print("| keys | byte | keys sharing the k-th's prefix | of them wanted | settled |\n|---|---|---|---|---|")
    for name, pool in (("bf16", k), ("fp8", k.to(torch.float8_e4m3fn).to(torch.bfloat16))):
        vote = head_soft_vote_ref(query.float(), pool.float(), slots, d ** -0.5)
        for byte, (sharing, wanted) in enumerate(bytes_followed(vote, args.k), 1):
            print(f"| {name} | {byte} | {sharing} | {wanted} | {'yes' if sharing == wanted else 'no'} |")
        print(f"| {name} | distinct votes {vote.unique().numel()} of {args.length}, spread "
              f"{float(vote.std() / vote.mean()):.2%} of the mean | | | |")


if __name__ == "__main__":
    main()
