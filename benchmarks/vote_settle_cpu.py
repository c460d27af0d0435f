"""Whether the top-k's radix select settles before its last byte on `bench attention`'s 1M chunk vote, on a CPU
(issue #28: on an H200 the fp8 chunk's top-k did not get faster with the early settle). The data are drawn as the
bench draws them (`torch.randn` keys and queries, bf16; a 512-query chunk's mean query), the vote is the reference
head soft vote over bf16 keys and over their fp8 (e4m3) copy, and each byte of the radix select is followed as the
kernel takes it: how many keys share the k-th largest's prefix, how many of them are wanted, and so whether it
settles (every key sharing the prefix wanted). A draw of ours, not the GPU's.

    python3 benchmarks/vote_settle_cpu.py [--length 1048576]
"""
import argparse

import torch

from tokenselect.kernels.head_vote import head_soft_vote_ref


def keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the top-k kernel's uint32 keys (as int64), in the scores' order."""
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    return torch.where((bits >> 31) == 1, ~bits & 0xFFFFFFFF, bits | 0x80000000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1 << 20)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    torch.manual_seed(0)
    heads, kv_heads, d = 32, 8, 128
    query = torch.randn(512, heads, d, dtype=torch.bfloat16).float().mean(0).to(torch.bfloat16)
    k = torch.randn(args.length, kv_heads, d, dtype=torch.bfloat16)
    slots = torch.arange(args.length)
    print("| keys | byte | keys sharing the k-th's prefix | of them wanted | settled |\n|---|---|---|---|---|")
    for name, pool in (("bf16", k), ("fp8", k.to(torch.float8_e4m3fn).to(torch.bfloat16))):
        vote = head_soft_vote_ref(query.float(), pool.float(), slots, d ** -0.5)
        bits, kth = keys(vote), keys(vote.topk(args.k).values.min().view(1))[0]
        for byte in range(4):
            shift = 24 - 8 * byte
            sharing = int(((bits >> shift) == kth >> shift).sum())
            wanted = args.k - int(((bits >> shift) > kth >> shift).sum())
            print(f"| {name} | {byte + 1} | {sharing} | {wanted} | {'yes' if sharing == wanted else 'no'} |")
        print(f"| {name} | distinct votes {vote.unique().numel()} of {args.length}, spread "
              f"{float(vote.std() / vote.mean()):.2%} of the mean | | | |")


if __name__ == "__main__":
    main()
