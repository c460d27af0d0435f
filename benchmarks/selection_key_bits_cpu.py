"""How many bits a selection key needs, on a real model's keys and queries, on a CPU (issue #28: against the
strongest dense attention a 1M chunk can reach its goals only by reading fewer key bytes than fp8's one a
element). TokenSelect runs over TOKENS of the shipped prose, then decode steps selecting at each (theta off); every
head soft vote of a sample of its calls is recorded (the query, the candidates' keys as the pool holds them), and
each call's vote is computed again over the keys stored in narrower forms. Each form's top-k (the policy's k) is
compared with the vote over the keys as cached: the share of the same tokens chosen (recall), the share of the
reference's vote mass the chosen tokens carry (mass), and how much of the reference's choice a form's top 2k or 4k
holds (a two-stage selection's first stage over narrow keys, its second rescoring those over the full ones).

    PYTHONPATH=$PWD/benchmarks python3 benchmarks/selection_key_bits_cpu.py --model smollm2-135m-instruct
    PYTHONPATH=$PWD/benchmarks python3 benchmarks/selection_key_bits_cpu.py --model qwen2.5-coder-0.5b-instruct \
        --dense-until 0

Forms (bytes a token and kv head at head_dim d, scales in fp16 unless said):
- fp8: the engine's selection keys today, e4m3 by a plain cast (d);
- int8/token: symmetric, one scale a token and kv head (d + 2);
- int4/token: symmetric [-7, 7], one scale a token and kv head (d/2 + 2);
- int4/group32: one scale a group of 32 dimensions (d/2 + d/16);
- int4/channel: one scale a channel, over the call's candidates (d/2; a static scale a real pool would calibrate
  and keep, so an optimistic bound for it);
- fp4/group16: e2m1 values with an e4m3 scale a group of 16, as NVFP4 (d/2 + d/16).
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kernels.head_vote import head_soft_vote_ref

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def symmetric(k: torch.Tensor, levels: int, dims: tuple[int, ...]) -> torch.Tensor:
    """k rounded to integers in [-levels, levels] over a scale shared along ``dims`` (absmax), back in fp32."""
    scale = k.abs().amax(dim=dims, keepdim=True).clamp_min(1e-12) / levels
    scale = scale.half().float()
    return (k / scale).round().clamp(-levels, levels) * scale


def grouped(k: torch.Tensor, group: int, fn) -> torch.Tensor:
    """fn applied to groups of ``group`` consecutive dimensions of k [..., d] (as [..., d / group, group])."""
    shape = k.shape
    return fn(k.reshape(*shape[:-1], shape[-1] // group, group)).reshape(shape)


def fp4(k: torch.Tensor) -> torch.Tensor:
    """e2m1 values over a group's e4m3 scale (absmax / 6), NVFP4's form, for k [..., group]."""
    scale = (k.abs().amax(dim=-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float().clamp_min(1e-12)
    x = (k / scale).clamp(-6, 6)
    nearest = (x.abs()[..., None] - E2M1).abs().argmin(dim=-1)
    return E2M1[nearest] * x.sign() * scale


FORMS = {
    "fp8": lambda k: k.to(torch.float8_e4m3fn).float(),
    "int8/token": lambda k: symmetric(k, 127, (-1,)),
    "int4/token": lambda k: symmetric(k, 7, (-1,)),
    "int4/group32": lambda k: grouped(k, 32, lambda g: symmetric(g, 7, (-1,))),
    "int4/channel": lambda k: symmetric(k, 7, (0,)),
    "fp4/group16": lambda k: grouped(k, 16, fp4),
}


def record(model: str, tokens: int, steps: int, every: int, settings: dict) -> tuple[list[dict], int]:
    """The policy's k and, for every ``every``-th head soft vote call, the query, the live candidates' keys (fp32
    copies, [N, n_kv, d]) and the scale, tagged prefill or decode. settings: TokenSelect's own, beside theta off."""
    llm = LLM(model, "tokenselect", kernels="torch", theta=None, kv_cache_tokens=tokens + steps + 64, **settings)
    policy = llm.policy
    vote = policy.kernels.head_soft_vote
    calls, seen, phase = [], [0], ["prefill"]

    def recording(q, k_pool, slots, scale=1.0, n_valid=None):
        seen[0] += 1
        if seen[0] % every == 0:
            queries = q if q.dim() == 3 else q[None]
            rows = slots if slots.dim() == 2 else slots.expand(queries.shape[0], -1)
            live = [rows.shape[1]] * rows.shape[0] if n_valid is None else n_valid.reshape(-1).tolist()
            for b, n in enumerate(live):
                if n > 2 * policy.k:  # a choice worth comparing: more than twice as many candidates as chosen
                    calls.append({"phase": phase[0], "q": queries[b].float().clone(), "scale": scale,
                                  "keys": k_pool[rows[b, :n]].float().clone()})
        return vote(q, k_pool, slots, scale, n_valid)

    policy.kernels = dataclasses.replace(policy.kernels, head_soft_vote=recording)
    from real_model_checks import prose_ids  # benchmarks/, beside this script

    seq = llm.add_request(prose_ids(llm, tokens), SamplingParams(max_tokens=steps + 1, temperature=0,
                                                                  ignore_eos=True))
    while not seq.output_ids:
        llm.step()
    phase[0] = "decode"
    while not seq.finished:
        llm.step()
    return calls, policy.k


def compare(calls: list[dict], k: int) -> dict[tuple[str, str], list[tuple[float, ...]]]:
    """(phase, form) -> [(recall, mass, held by 2k, held by 4k)] over the calls: held by m k is the share of the
    reference's top-k among the form's top m k, what a first stage over the narrow keys keeps for a second one to
    rescore."""
    out: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for call in calls:
        n = call["keys"].shape[0]
        slots = torch.arange(n)
        ref = head_soft_vote_ref(call["q"], call["keys"], slots, call["scale"])
        want = ref.topk(k).indices
        best = float(ref[want].sum())
        for name, form in FORMS.items():
            order = head_soft_vote_ref(call["q"], form(call["keys"]), slots, call["scale"]).argsort(descending=True)
            got = order[:k]
            held = [torch.isin(want, order[:m * k]).float().mean().item() for m in (2, 4)]
            out.setdefault((call["phase"], name), []).append(
                (torch.isin(got, want).float().mean().item(), float(ref[got].sum()) / best, *held))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=7, help="record every N-th vote call (all layers come round)")
    ap.add_argument("--dense-until", type=int, help="TokenSelect's dense_until (0: select inside the window too, "
                                                        "for a model whose window holds TOKENS)")
    ap.add_argument("--k", type=int, action="append",
                    help="the top-k sizes compared (repeatable; default the policy's k and 256: at 16K tokens the "
                         "policy's 2048 is an eighth of the candidates, where at 1M it is 0.2%%)")
    args = ap.parse_args()
    torch.manual_seed(0)
    settings = {} if args.dense_until is None else {"dense_until": args.dense_until}
    calls, policy_k = record(args.model, args.tokens, args.steps, args.every, settings)
    for k in args.k or [policy_k, 256]:
        results = compare(calls, k)
        print(f"\n| {args.model}, {args.tokens} tokens of prose, k {k}: form | phase | calls | recall mean "
              f"| recall min | mass mean | mass min | top-2k holds (min) | top-4k holds (min) |\n"
              f"|---|---|---|---|---|---|---|---|---|")
        for (phase, name), rows in sorted(results.items(), key=lambda kv: (kv[0][0], list(FORMS).index(kv[0][1]))):
            recall, mass, held2, held4 = zip(*rows)
            print(f"| {name} | {phase} | {len(rows)} | {sum(recall) / len(rows):.1%} | {min(recall):.1%} | "
                  f"{sum(mass) / len(rows):.2%} | {min(mass):.2%} | {sum(held2) / len(rows):.1%} "
                  f"({min(held2):.1%}) | {sum(held4) / len(rows):.1%} ({min(held4):.1%}) |")


if __name__ == "__main__":
    main()
