"""``tokenselect eval --backend transformers``: the same cells, scored on a transformers model through
``tokenselect.hf`` (any architecture transformers has, e.g. ones our engine cannot load).

Policies: ``full`` (transformers' SDPA attention) and ``tokenselect`` (attn_implementation "tokenselect" with a
``tokenselect.hf.SelectionCache`` of the flags' k, n_init, n_local, theta, dense_until). Samples run one at a
time (the backend selects for a batch of one). prefill_s is the time to the first token's logits, decode_s the
rest of ``generate``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BACKEND_POLICIES = ("full", "tokenselect")
CACHE_SETTINGS = ("k", "n_init", "n_local", "theta", "dense_until")


def evaluate_transformers(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """As ``runner.evaluate``, on ``transformers.AutoModelForCausalLM``: (records, Selection Cache counts)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    import tokenselect.hf as tshf

    from ..models.registry import home
    from ..policies import policy_kwargs
    from .metrics import score
    from .runner import make_samples, max_tokens, split_policy, use_chat

    if args.model is None:
        raise ValueError("--backend transformers needs --model (a transformers checkpoint folder)")
    specs = [s.strip() for s in args.attention.split(",") if s.strip()]
    for spec in specs:
        name, _, rope = split_policy(spec)
        if name not in BACKEND_POLICIES or rope:
            raise ValueError(f"--backend transformers runs {', '.join(BACKEND_POLICIES)} (no @scaling), not {spec!r}")
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    path = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", config)
    window = int(getattr(config, "max_position_embeddings", 2048))
    args.chat = "on" if use_chat(tokenizer, args.chat, path) else "off"
    cache_dir = None if args.prompt_cache == "none" else Path(args.prompt_cache or home() / "eval-prompts")
    cells = make_samples(tokenizer, window, tasks, lengths, args.samples, args.seed, args.chat == "on", cache_dir,
                         args.workers or 1)
    records, counts = [], {}
    if args.prompts_only:
        return records, counts
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device).eval()
    args.policy_settings = {}
    progress = tqdm(total=len(specs) * len(cells), desc="eval", unit="sample", file=sys.stderr)
    for spec in specs:
        name, own, _ = split_policy(spec)
        settings = {key: value for key, value in {**policy_kwargs(args, name, engine=False), **own}.items()
                    if key in CACHE_SETTINGS}
        args.policy_settings[spec] = settings if name == "tokenselect" else {}
        model.set_attn_implementation("tokenselect" if name == "tokenselect" else "sdpa")
        hits = misses = 0
        for cell in cells:
            cache = tshf.SelectionCache(config=model.config, **settings) if name == "tokenselect" else None
            first = []

            class FirstLogits(LogitsProcessor):
                def __call__(self, input_ids, scores):
                    if not first:
                        first.append(time.perf_counter())
                    return scores

            ids = torch.tensor([cell["prompt"]], device=device)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=max_tokens(cell["task"]), do_sample=False,
                                     logits_processor=LogitsProcessorList([FirstLogits()]),
                                     pad_token_id=tokenizer.eos_token_id,
                                     **({} if cache is None else {"cache": cache}))
            end = time.perf_counter()
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            if cache is not None:
                h, m = cache.hits_misses()
                hits, misses = hits + h, misses + m
            records.append({"policy": spec, "task": cell["task"], "length": cell["length"],
                            "target_tokens": cell["target_tokens"], "prompt_tokens": len(cell["prompt"]),
                            "sample": cell["sample"], "depth": cell["depth"], "answers": cell["answers"],
                            "prediction": text, "score": score(cell["task"], text, cell["answers"]),
                            "prefill_s": round(first[0] - start, 4), "decode_s": round(end - first[0], 4)})
            progress.update()
        if name == "tokenselect" and hits + misses:
            counts[spec] = {"hits": hits, "misses": misses, "hit_rate": round(hits / (hits + misses), 4)}
    progress.close()
    return records, counts
