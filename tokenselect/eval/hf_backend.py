"""``tokenselect eval --backend transformers``: the same cells, scored on a transformers model through
``tokenselect.hf`` (any architecture transformers has, e.g. ones our engine cannot load).

Policies: ``full`` (transformers' SDPA attention) and every policy of the engine (attn_implementation
"tokenselect" with a ``tokenselect.hf.PolicyCache`` of the policy and the settings of the flags it takes; left out:
the engine's defaults for the model's window). Prompts are prefilled in chunks of the engine's size
(``--chunk-size``, default 512 or a quarter of a small window: ``generate(prefill_chunk_size=...)``), so each
chunk selects as in the engine. Samples run one at a time. prefill_s is the time to the first token's logits,
decode_s the rest of ``generate``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from .. import hf as tshf
from ..models.loader import resolve_device
from ..policies import POLICIES, default_chunk, policy_kwargs, policy_settings
from .runner import Interrupted, Results, hit_counts, names, prompts, record, split_policy
from .tasks import MAX_NEW_TOKENS


def evaluate_transformers(args: argparse.Namespace, results: Results,
                          stop: threading.Event | None = None) -> tuple[list[dict], dict]:
    """As ``runner.evaluate``, on ``transformers.AutoModelForCausalLM``: (records, Selection Cache counts), gathered
    in ``results`` as samples finish; ``Interrupted`` between two samples once ``stop`` is set."""
    if args.model is None:
        raise ValueError("--backend transformers needs --model (a transformers checkpoint folder)")
    if (getattr(args, "tensor_parallel_size", None) or 1) > 1:  # None: not given
        raise ValueError("--backend transformers runs on one device: --tensor-parallel-size is the engine's "
                         "(--backend engine)")
    specs = names(args.attention)
    for spec in specs:
        name, _, rope = split_policy(spec)
        if name not in POLICIES or rope:
            raise ValueError(f"--backend transformers runs {', '.join(POLICIES)} (no @scaling), not {spec!r}")
    path = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", config)
    window = int(getattr(config, "max_position_embeddings", 2048))
    chunk = args.chunk_size or default_chunk(window)
    cells = prompts(args, tokenizer, window, path, args.workers or 1)
    if args.prompts_only:
        return results.records, results.selection_cache
    device = resolve_device(getattr(args, "device", None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device).eval()
    args.policy_settings = {}
    results.expected = len(specs) * len(cells)
    progress = tqdm(total=results.expected, desc="eval", unit="sample", file=sys.stderr)
    for spec_index, spec in enumerate(specs):
        name, own, _ = split_policy(spec)
        accepted = policy_settings(name)
        settings = {key: value for key, value in {**policy_kwargs(args, name, engine=False), **own}.items()
                    if key in accepted}
        args.policy_settings[spec] = settings
        model.set_attn_implementation("sdpa" if name == "full" else "tokenselect")
        hits = misses = 0
        for cell_index, cell in enumerate(cells):
            if stop is not None and stop.is_set():
                raise Interrupted
            cache = None if name == "full" else tshf.PolicyCache(name, chunk=chunk, config=model.config, **settings)
            first = []

            class FirstLogits(LogitsProcessor):
                def __call__(self, input_ids, scores):
                    if not first:
                        first.append(time.perf_counter())
                    return scores

            ids = torch.tensor([cell["prompt"]], device=device)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS[cell["task"]], do_sample=False,
                                     logits_processor=LogitsProcessorList([FirstLogits()]),
                                     pad_token_id=tokenizer.eos_token_id, prefill_chunk_size=chunk,
                                     **({} if cache is None else {"past_key_values": cache}))
            end = time.perf_counter()
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            if cache is not None:
                h, m = cache.hits_misses()
                hits, misses = hits + h, misses + m
            results.add(record(spec, cell, text, len(cell["prompt"]), first[0] - start, end - first[0]),
                        (spec_index, cell_index))
            progress.update()
            if name == "tokenselect" and hits + misses:
                results.selection_cache[spec] = hit_counts(hits, misses)
    progress.close()
    return results.ordered(), results.selection_cache
