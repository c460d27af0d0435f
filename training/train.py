"""Train tokenselect's default model (a small Llama) from scratch, time-boxed, in one command.

    PYTHONUNBUFFERED=1 python training/train.py --out $OUT      # on the lent GPU
    SMOKE=1 python training/train.py --out /tmp/smoke            # tiny CPU check

Steps: gather text (this machine's Python stdlib source + the vendored prose), train a
byte-level BPE tokenizer on it, pre-generate retrieval drills, train LlamaForCausalLM with
bf16 autocast for TRAIN_SECONDS, evaluate within-window retrieval, and write the bf16
checkpoint shards plus `meta.tar` (config, tokenizer, index, metrics.json, train.log) to --out.
"""
import argparse
import io
import json
import math
import os
import random
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))
import drills  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"

# ---- settings -------------------------------------------------------------------------------
SEED = 1234
VOCAB = 8192
WINDOW = 1024                      # trained window (tokens per row)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 512, 8, 8, 2, 64, 1536
ROPE_THETA = 10000.0
BATCH = 64                         # rows of WINDOW tokens per step
LR, WARMUP_S, WEIGHT_DECAY, MIN_LR_FRAC = 1e-3, 20.0, 0.1, 0.05
DRILL_FRAC = 0.5                   # fraction of rows that start at a retrieval drill
TOTAL_BUDGET_S = 555.0             # whole script, from start, to stay inside a 600 s call
EVAL_RESERVE_S = 100.0              # kept back for evaluation + saving
TRAIN_SECONDS = 420.0              # upper bound on the training loop itself (7 min)
STDLIB_MAX_CHARS = 24_000_000
N_DRILLS = 48000
EVAL_PER_TASK = 50
EVAL_LENGTHS = (256, 512, 768, 1024)
SHARD = "12MB"
if SMOKE:
    HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
    BATCH, TRAIN_SECONDS, TOTAL_BUDGET_S, EVAL_RESERVE_S = 2, 15.0, 120.0, 30.0
    STDLIB_MAX_CHARS, N_DRILLS, EVAL_PER_TASK, WARMUP_S = 2_000_000, 200, 4, 2.0

T0 = time.time()
LOG_LINES = []


def log(msg):
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    LOG_LINES.append(line)


# ---- corpus ---------------------------------------------------------------------------------
def stdlib_texts(max_chars):
    """The stdlib's .py files (code + docstrings), sorted, tests and site-packages skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if ("site-packages" in rel or "dist-packages" in rel or rel.startswith("test/")
                or "/test" in rel or "idle_test" in rel or rel.startswith("lib2to3/tests")):
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(t) < 200:
            continue
        out.append(f"# file: {rel}\n{t}")
        total += len(out[-1])
        if total >= max_chars:
            break
    return out, str(root)


def prose_docs():
    from tokenselect.data import prose_text
    return [d.strip() for d in prose_text().split("\f") if d.strip()]


# ---- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(docs, folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", unk_token=None, model_max_length=WINDOW)
    fast.save_pretrained(folder)
    return tok, bos, eos


# ---- model ----------------------------------------------------------------------------------
def make_config(bos, eos):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=WINDOW, rms_norm_eps=1e-5, hidden_act="silu",
        rope_theta=ROPE_THETA, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
        attention_bias=False, mlp_bias=False, initializer_range=0.02)


# ---- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tok, device, deadline):
    model.eval()
    count = lambda s: len(tok.encode(s).ids)  # includes <s>
    rng = random.Random(777)
    results = {}
    for task in ("passkey", "number_string", "kv_retrieval", "needle"):
        hits, n, by_len = 0, 0, {}
        for i in range(EVAL_PER_TASK):
            if time.time() > deadline:
                break
            L = EVAL_LENGTHS[i % len(EVAL_LENGTHS)]
            d = drills.GENERATORS[task](L, rng.random(), rng, count)
            ids = tok.encode(d.input).ids
            ans_ids = tok.encode(d.answers[0], add_special_tokens=False).ids
            x = torch.tensor([ids], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=len(ans_ids) + 2, pad_token_id=tok.token_to_id("</s>"))
            text = tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
            ok = text.strip().startswith(d.answers[0].strip())
            hits += ok
            n += 1
            b = by_len.setdefault(str(L), [0, 0])
            b[0] += ok
            b[1] += 1
            if i < 2:
                log(f"  eval {task} L={L} len={len(ids) + len(ans_ids)} want={d.answers[0]!r} got={text!r}")
        results[task] = {"accuracy": hits / max(1, n), "n": n,
                         "by_length": {k: v[0] / v[1] for k, v in by_len.items()}}
        log(f"eval {task}: {hits}/{n} = {hits / max(1, n):.3f}  by length {results[task]['by_length']}")
    return results


_SENTENCES, _TOK_JSON = None, None


def _drill_worker(arg):
    """Generate `n` drills with their own RNG (run in a forked pool)."""
    seed, n = arg
    from tokenizers import Tokenizer
    wt = Tokenizer.from_str(_TOK_JSON)
    count = lambda s: len(wt.encode(s).ids)
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        task = drills.TASKS[i % len(drills.TASKS)]
        L = rng.randint(128, WINDOW)
        kw = {"haystack_sentences": _SENTENCES} if (task == "needle" and rng.random() < 0.5) else {}
        texts.append(drills.GENERATORS[task](L, rng.random(), rng, count, **kw).text())
    return texts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = out.parent / (out.name + "_stage") if SMOKE else Path("/tmp/tokenselect_model_stage")
    stage.mkdir(parents=True, exist_ok=True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(f"device {device} torch {torch.__version__} python {sys.version.split()[0]}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    code_docs, stdlib_root = stdlib_texts(STDLIB_MAX_CHARS)
    prose = prose_docs()
    log(f"stdlib {len(code_docs)} files {sum(map(len, code_docs)):,} chars from {stdlib_root}; "
        f"prose {len(prose)} docs {sum(map(len, prose)):,} chars")

    tok, bos, eos = train_tokenizer(code_docs + prose, stage)
    log(f"tokenizer trained: vocab {tok.get_vocab_size()}")

    # corpus token stream (documents separated by </s> <s>)
    enc = tok.encode_batch(code_docs + prose)
    stream = np.concatenate([np.array(e.ids + [eos], dtype=np.int32) for e in enc])
    n_code = sum(len(e.ids) + 1 for e in enc[:len(code_docs)])
    log(f"corpus tokens {len(stream):,} (stdlib {n_code:,}, prose {len(stream) - n_code:,})")

    # drills: pre-generated, each a row start
    global _SENTENCES, _TOK_JSON
    _SENTENCES = [s.strip() + "." for d in prose for s in d.replace("\n", " ").split(". ") if len(s) > 20]
    _TOK_JSON = tok.to_str()
    import multiprocessing as mp
    n_proc = max(1, min(16, (os.cpu_count() or 2) - 1))
    chunks = [(SEED + 1 + k, N_DRILLS // n_proc + (k < N_DRILLS % n_proc)) for k in range(n_proc)]
    with mp.get_context("fork").Pool(n_proc) as pool:
        dr_texts = [t for part in pool.map(_drill_worker, chunks) for t in part]
    denc = tok.encode_batch(dr_texts)
    dstream = np.concatenate([np.array(e.ids + [eos], dtype=np.int32) for e in denc])
    dstarts = np.cumsum([0] + [len(e.ids) + 1 for e in denc[:-1]])
    dstarts = dstarts[dstarts + WINDOW + 1 <= len(dstream)]
    log(f"drills {len(dr_texts)} -> {len(dstream):,} tokens; example:\n{dr_texts[0][:200]} ... {dr_texts[0][-120:]}")

    stream_t = torch.from_numpy(stream.astype(np.int64))
    dstream_t = torch.from_numpy(dstream.astype(np.int64))
    dstarts_t = torch.from_numpy(dstarts.astype(np.int64))

    def batch(gen):
        nd = int(round(BATCH * DRILL_FRAC))
        rows = []
        s = torch.randint(0, len(stream_t) - WINDOW - 1, (BATCH - nd,), generator=gen)
        for a in s.tolist():
            rows.append(stream_t[a:a + WINDOW + 1])
        idx = torch.randint(0, len(dstarts_t), (nd,), generator=gen)
        for a in dstarts_t[idx].tolist():
            rows.append(dstream_t[a:a + WINDOW + 1])
        return torch.stack(rows)

    from transformers import LlamaForCausalLM
    config = make_config(bos, eos)
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model params {n_params:,}; config rope {getattr(config, 'rope_parameters', None)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    gen = torch.Generator().manual_seed(SEED)
    t_start = time.time()
    train_s = min(TRAIN_SECONDS, T0 + TOTAL_BUDGET_S - EVAL_RESERVE_S - t_start)
    log(f"training for {train_s:.0f}s, batch {BATCH}x{WINDOW}")
    step, tokens, loss_ema = 0, 0, None
    model.train()
    nxt = batch(gen)
    while True:
        frac = (time.time() - t_start) / train_s
        if frac >= 1.0:
            break
        el = time.time() - t_start
        lr = LR * min(1.0, el / WARMUP_S) * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        xb = nxt.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=xb[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        nxt = batch(gen)  # overlap CPU batch building with the GPU step
        step += 1
        tokens += xb.shape[0] * WINDOW
        if step % 50 == 0 or step == 1:
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            log(f"step {step} loss {lv:.3f} lr {lr:.2e} tokens {tokens:,} "
                f"tok/s {tokens / (time.time() - t_start):,.0f}")
    train_time = time.time() - t_start
    log(f"done: {step} steps, {tokens:,} tokens in {train_time:.0f}s")

    deadline = T0 + TOTAL_BUDGET_S - 10
    scores = evaluate(model, tok, device, deadline)

    model = model.to(torch.bfloat16)
    model.save_pretrained(stage, max_shard_size=SHARD)
    metrics = {"params": n_params, "steps": step, "tokens_seen": tokens, "train_seconds": round(train_time, 1),
               "batch": BATCH, "window": WINDOW, "final_loss_ema": loss_ema, "scores": scores,
               "corpus_tokens": int(len(stream)), "stdlib_tokens": int(n_code), "drill_tokens": int(len(dstream)),
               "stdlib_root": stdlib_root, "python": sys.version.split()[0], "torch": torch.__version__,
               "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "settings": {"lr": LR, "drill_frac": DRILL_FRAC, "n_drills": N_DRILLS, "seed": SEED}}
    (stage / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"saved; total {time.time() - T0:.0f}s")
    (stage / "train.log").write_text("\n".join(LOG_LINES) + "\n")
    # shards go out as they are; everything else in one tar (the device returns at most 8 files)
    with tarfile.open(out / "meta.tar", "w") as tar:
        for p in sorted(stage.iterdir()):
            if p.suffix == ".safetensors":
                (out / p.name).write_bytes(p.read_bytes())
            else:
                tar.add(p, arcname=p.name)
    print(sorted(p.name for p in out.iterdir()), flush=True)


if __name__ == "__main__":
    main()
