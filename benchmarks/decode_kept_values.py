"""How much of what a decode step attends did the step before it attend? With value offload each layer's staged values
stay on the device (``KVCache.stage``): a row staged again is copied there instead of crossing the bus. This runs a
real model over real prose with the values offloaded, TokenSelect selecting at every decode step (``theta`` off) and
at its default Selection Cache, and prints the share of the decode steps' staged value rows found kept.

    PYTHONPATH=$PWD python3 benchmarks/decode_kept_values.py MODEL TOKENS [--steps N] [--device cpu] [--k K]

The end-to-end bench's random-weight model picks other tokens every step (its kept share is its sinks and window);
this is the share a real model's steps show.
"""
import argparse
import sys
import time

from tokenselect import LLM, SamplingParams


def kept_share(model: str, ids: list[int], steps: int, device: str, settings: dict) -> tuple[float, float]:
    """(share of the decode steps' staged value rows found kept, the Selection Cache's hit rate) for one engine."""
    llm = LLM(model, "tokenselect", device=device, kv_offload="values", kv_cache_tokens=len(ids) + steps + 64,
              **settings)
    seq = llm.add_request(ids, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    while not seq.output_ids:
        llm.step()
    staged, found = llm.cache.kept_counts()
    while not seq.finished:
        llm.step()
    staged_after, found_after = llm.cache.kept_counts()
    stats = llm.policy.stats()
    looked_up = stats.selection_cache_hits + stats.selection_cache_misses
    hits = stats.selection_cache_hits / looked_up if looked_up else 0.0
    return (found_after - found) / (staged_after - staged), hits


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("tokens", type=int)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=None, help="TokenSelect's k (default: its own)")
    args = parser.parse_args(argv)
    from real_model_checks import prose_ids  # benchmarks/, beside this script

    extra = {} if args.k is None else {"k": args.k}
    ids = prose_ids(LLM(args.model, "full", device=args.device, kv_cache_tokens=64), args.tokens)
    for label, settings in (("every step selecting (theta off)", {"theta": None}), ("Selection Cache at 0.9", {})):
        start = time.perf_counter()
        share, hits = kept_share(args.model, ids, args.steps, args.device, {**settings, **extra})
        print(f"{args.model}, {args.tokens} tokens of prose, {args.steps} decode steps, {label}: {share:.1%} of the "
              f"value rows staged were kept from the step before (Selection Cache hits {hits:.0%}; "
              f"{time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
