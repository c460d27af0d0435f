"""What fp8 weights cost a model's predictions: each model teacher-forced over the same prose with its weights as
loaded and with ``weight_dtype="fp8"``, on one device (a CPU by default: fp32 against fp8 weights).

    python benchmarks/fp8_weights_agreement.py --out OUT [--models shipped,smollm2-135m-instruct,...] [--tokens 1000]

For each model: the share of positions whose most likely next token is the same with both weights, and each one's
loss on the prose's next tokens (nats). ``shipped`` is the model inside the package; the others are registry names
and must be fetched first (``tokenselect fetch NAME``). Writes OUT/fp8_weights_agreement.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenselect import LLM
from tokenselect.data import prose_text

MODELS = "shipped,smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct"


def next_token_agreement(plain: LLM, fp8: LLM, ids: list[int]) -> tuple[float, list[float]]:
    """Teacher-forced over ``ids``: (the share of positions whose most likely next token is the same in both,
    [each one's loss on the next tokens, nats])."""
    a, b = plain.prompt_logits(ids), fp8.prompt_logits(ids)
    loss = [torch.nn.functional.cross_entropy(x[:-1], torch.tensor(ids[1:], device=x.device)).item() for x in (a, b)]
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item(), loss


def measure(model: str, tokens: int, device: str) -> dict:
    """One model's row: the first ``tokens`` tokens of the shipped prose (its first 20,000 characters)."""
    name = None if model == "shipped" else model
    plain, fp8 = (LLM(name, device=device, weight_dtype=w) for w in ("auto", "fp8"))
    ids = plain.encode(prose_text()[:20_000])[:tokens]
    start = time.perf_counter()
    agree, loss = next_token_agreement(plain, fp8, ids)
    return {"model": model, "dtype": str(plain.dtype).removeprefix("torch."), "tokens": len(ids),
            "top1_agreement": round(agree * 100, 1), "loss": round(loss[0], 3), "loss_fp8": round(loss[1], 3),
            "loss_change": round((loss[1] / loss[0] - 1) * 100, 2), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where fp8_weights_agreement.{json,md} are written")
    parser.add_argument("--models", default=MODELS, help=f"comma-separated: shipped or registry names ({MODELS})")
    parser.add_argument("--tokens", type=int, default=1000, help="prose tokens each model is teacher-forced over")
    parser.add_argument("--device", default="cpu", help="cpu (fp32 against fp8 weights) or cuda")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        rows.append(measure(model, args.tokens, args.device))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_weights_agreement.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    lines = [f"# fp8 weights against the model's own: next tokens on prose ({args.device})", "",
             f"`python benchmarks/fp8_weights_agreement.py --out OUT --models {args.models} --tokens {args.tokens} "
             f"--device {args.device}`. Teacher-forced; agreement: positions whose most likely next token is the "
             "same with both weights.", "",
             "| model | weights as loaded | tokens | top-1 agreement | loss (nats) | loss, fp8 weights | change |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['tokens']} | {r['top1_agreement']}% | {r['loss']} | "
              f"{r['loss_fp8']} | {r['loss_change']:+.2f}% |" for r in rows]
    (out / "fp8_weights_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
