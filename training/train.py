"""Train tokenselect's default model (a small Llama) from scratch, time-boxed, in one command.

    PYTHONUNBUFFERED=1 python training/train.py --out $OUT      # on the lent GPU (one H100)
    SMOKE=1 python training/train.py --out /tmp/smoke            # tiny CPU check of the whole pipeline

Steps: start a process pool that writes retrieval drills with the evaluation's own generators
(`drills.py`) for as long as training runs; gather text (this machine's Python stdlib source + the
vendored prose) and tokenize it with the tokenizer already shipped in
`tokenselect/data/default_model` (kept as it is); train LlamaForCausalLM with bf16 autocast for
TRAIN_SECONDS on rows that are part text, part drills, with the drills' answers weighted up; score
within-window retrieval on fresh samples of the same generators (other seeds); write the bf16
checkpoint shards plus `meta.tar` (config, generation config, shard index, tokenizer,
metrics.json, train.log) to --out, because the device returns at most 8 files of 16 MiB each.
"""
import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
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
TOKENIZER_DIR = ROOT / "tokenselect" / "data" / "default_model"   # tokenizer kept from the first model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 8192
WINDOW = 1024                      # trained window (tokens per row)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 384, 8, 6, 2, 64, 1024
ROPE_THETA = 10000.0
BATCH = 64                         # rows of WINDOW tokens per step
LR, WARMUP_S, WEIGHT_DECAY, MIN_LR_FRAC = 1.5e-3, 15.0, 0.1, 0.05
DRILL_FRAC = 0.6                   # fraction of rows that start at a drill
ANSWER_WEIGHT = 4.0                # loss weight of a drill's completion tokens and its </s> (others: 1)
TOTAL_BUDGET_S = 550.0             # whole script, from start, to stay inside a 600 s call
EVAL_RESERVE_S = 85.0              # kept back for evaluation + saving
TRAIN_SECONDS = 430.0              # upper bound on the training loop itself
STDLIB_MAX_CHARS = 24_000_000
MAX_DRILLS = 1_000_000             # drill numbers handed to the pool (it is stopped when training ends)
DRILL_CHUNK = 200                  # drills per pool task
MIN_DRILLS_TO_START = 3000         # training waits for this many
EVAL_PER_TASK = 24
EVAL_LENGTHS = (256, 512, 768, 1024)   # whole context: prompt + the task's answer budget, as `tokenselect eval`
SHARD = "12MB"
if SMOKE:
    HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
    BATCH, TRAIN_SECONDS, TOTAL_BUDGET_S, EVAL_RESERVE_S = 2, 15.0, 150.0, 40.0
    STDLIB_MAX_CHARS, MAX_DRILLS, DRILL_CHUNK, MIN_DRILLS_TO_START = 2_000_000, 2000, 50, 100
    EVAL_PER_TASK, WARMUP_S = 2, 2.0

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


def load_tokenizer():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok, tok.token_to_id("<s>"), tok.token_to_id("</s>")


# ---- drills (pool workers) ------------------------------------------------------------------
_WTOK = None


def _worker_init():
    global _WTOK
    from tokenizers import Tokenizer
    from tokenselect.eval.tasks.haystack import prose_words
    _WTOK = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    prose_words()  # load the essay haystack once per worker


def _drill_worker(arg):
    """Drills start..start+n-1 as (task, token ids int16, index where the completion starts).

    ids = encode(prompt) (with <s>, exactly as the engine encodes it) + encode(completion) + </s>."""
    start, n = arg
    count = lambda s: len(_WTOK.encode(s).ids)  # noqa: E731  (includes <s>, as the eval's count does)
    eos = _WTOK.token_to_id("</s>")
    out = []
    for k in range(start, start + n):
        d = drills.make_drill(k, count, WINDOW)
        p = _WTOK.encode(d.prompt).ids
        c = _WTOK.encode(d.completion, add_special_tokens=False).ids
        out.append((d.task, np.array(p + c + [eos], dtype=np.int16), len(p)))
    return out


class DrillStore:
    """Drills as they arrive from the pool; rows are packed from consecutive drills."""

    def __init__(self, it):
        self.it, self.done = it, False
        self.ids, self.ans, self.tasks = [], [], {}
        self.tokens = 0

    def absorb(self, block=False):
        while not self.done:
            try:
                part = self.it.next(timeout=None if block else 0)
            except mp.TimeoutError:
                return
            except StopIteration:
                self.done = True
                return
            for task, ids, a in part:
                self.ids.append(ids)
                self.ans.append(a)
                self.tasks[task] = self.tasks.get(task, 0) + 1
                self.tokens += len(ids)
            if block:
                return

    def row(self, rng):
        """WINDOW+1 tokens starting at a random drill, continuing into the next ones; and the loss
        weight of predicting each token (ANSWER_WEIGHT on completions and </s>)."""
        i = rng.randrange(len(self.ids))
        toks, ws, have = [], [], 0
        while have < WINDOW + 1:
            ids, a = self.ids[i], self.ans[i]
            w = np.ones(len(ids), dtype=np.float32)
            w[a:] = ANSWER_WEIGHT
            toks.append(ids)
            ws.append(w)
            have += len(ids)
            i = (i + 1) % len(self.ids)
        return (np.concatenate(toks)[:WINDOW + 1].astype(np.int64),
                np.concatenate(ws)[:WINDOW + 1])


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
    """Greedy answers to fresh samples of the eval generators (seeds "val/..."), scored by the eval's
    scorer, with the eval's answer budgets; lengths as `tokenselect eval` counts them."""
    from tokenselect.eval.metrics import score
    from tokenselect.eval.tasks import MAX_NEW_TOKENS, make_sample
    model.eval()
    count = lambda s: len(tok.encode(s).ids)  # noqa: E731  includes <s>
    eos = tok.token_to_id("</s>")
    results = {}
    for task in drills.TASKS:
        total, n, stopped, by_len = 0.0, 0, 0, {}
        budget = MAX_NEW_TOKENS[task]
        for i in range(EVAL_PER_TASK):
            if time.time() > deadline:
                break
            L = EVAL_LENGTHS[i % len(EVAL_LENGTHS)]
            depth = (i // len(EVAL_LENGTHS)) / max(1, EVAL_PER_TASK // len(EVAL_LENGTHS) - 1)
            try:
                s = make_sample(task, L - budget, min(1.0, depth), random.Random(f"val/{task}/{L}/{i}"), count)
            except ValueError:
                continue  # too short for this task (vt at 256)
            ids = tok.encode(s.input).ids
            x = torch.tensor([ids], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=budget, eos_token_id=eos, pad_token_id=eos)
            new = out[0, len(ids):].tolist()
            stopped += eos in new
            text = tok.decode(new, skip_special_tokens=True)
            sc = score(task, text, s.answers)
            total += sc
            n += 1
            b = by_len.setdefault(str(L), [0.0, 0])
            b[0] += sc
            b[1] += 1
            if i < 2 or (sc < 1 and n <= 8):
                log(f"  eval {task} L={L} prompt={len(ids)} want={s.answers} got={text!r} score={sc:.2f}")
        results[task] = {"score": round(total / max(1, n), 4), "n": n, "stopped_with_eos": stopped,
                         "by_length": {k: round(v[0] / v[1], 4) for k, v in by_len.items()}}
        log(f"eval {task}: {total:.1f}/{n} = {total / max(1, n):.3f} (eos {stopped}/{n}) "
            f"by length {results[task]['by_length']}")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = out.parent / (out.name + "_stage") if SMOKE else Path("/tmp/tokenselect_model_stage")
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    # drills: a pool writes them for the whole run (started before CUDA is touched: it forks)
    n_proc = max(1, (os.cpu_count() or 2) - 2)
    tasks = [(k, DRILL_CHUNK) for k in range(0, MAX_DRILLS, DRILL_CHUNK)]
    pool = mp.get_context("fork").Pool(n_proc, initializer=_worker_init)
    store = DrillStore(pool.imap(_drill_worker, tasks))
    log(f"drill pool: {n_proc} processes")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(f"device {device} torch {torch.__version__} python {sys.version.split()[0]}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tok, bos, eos = load_tokenizer()
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, stage / name)
    code_docs, stdlib_root = stdlib_texts(STDLIB_MAX_CHARS)
    prose = prose_docs()
    log(f"stdlib {len(code_docs)} files {sum(map(len, code_docs)):,} chars from {stdlib_root}; "
        f"prose {len(prose)} docs {sum(map(len, prose)):,} chars; tokenizer {TOKENIZER_DIR.name} (kept)")
    enc = tok.encode_batch(code_docs + prose)
    stream = np.concatenate([np.array(e.ids + [eos], dtype=np.int32) for e in enc])
    n_code = sum(len(e.ids) + 1 for e in enc[:len(code_docs)])
    log(f"corpus tokens {len(stream):,} (stdlib {n_code:,}, prose {len(stream) - n_code:,})")
    stream_t = torch.from_numpy(stream.astype(np.int64))

    while len(store.ids) < MIN_DRILLS_TO_START and not store.done:
        store.absorb(block=True)
    first = drills.make_drill(0, lambda s: len(tok.encode(s).ids), WINDOW)
    log(f"drills ready: {len(store.ids):,}; drill 0 ({first.task}):\n{first.prompt[:160]!r} ... "
        f"{first.prompt[-120:]!r} + {first.completion!r} + '</s>'")

    rng = random.Random(SEED)
    gen = torch.Generator().manual_seed(SEED)

    def batch():
        nd = int(round(BATCH * DRILL_FRAC))
        rows, weights = [], []
        for a in torch.randint(0, len(stream_t) - WINDOW - 1, (BATCH - nd,), generator=gen).tolist():
            rows.append(stream_t[a:a + WINDOW + 1])
            weights.append(torch.ones(WINDOW + 1))
        for _ in range(nd):
            r, w = store.row(rng)
            rows.append(torch.from_numpy(r))
            weights.append(torch.from_numpy(w))
        return torch.stack(rows), torch.stack(weights)

    from transformers import LlamaForCausalLM
    config = make_config(bos, eos)
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model params {n_params:,}: {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}/{KV_HEADS}x{HEAD_DIM}, "
        f"FFN {FFN}; rope {getattr(config, 'rope_parameters', None)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    t_start = time.time()
    train_s = min(TRAIN_SECONDS, T0 + TOTAL_BUDGET_S - EVAL_RESERVE_S - t_start)
    log(f"training for {train_s:.0f}s, batch {BATCH}x{WINDOW}, drill rows {DRILL_FRAC:.0%}, "
        f"answer weight {ANSWER_WEIGHT}")
    step, tokens, loss_ema, ans_ema = 0, 0, None, None
    model.train()
    nxt = batch()
    while True:
        el = time.time() - t_start
        frac = el / train_s
        if frac >= 1.0:
            break
        lr = LR * min(1.0, el / WARMUP_S) * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        xb, wb = (t.to(device, non_blocking=True) for t in nxt)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=xb[:, :-1]).logits
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), xb[:, 1:].reshape(-1),
                                               reduction="none")
        w = wb[:, 1:].reshape(-1)
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        store.absorb()
        nxt = batch()  # overlap CPU batch building with the GPU step
        step += 1
        tokens += xb.shape[0] * WINDOW
        if step % 50 == 0 or step == 1:
            with torch.no_grad():
                is_ans = (w > 1).float()
                ans = ((ce * is_ans).sum() / is_ans.sum().clamp(min=1)).item()
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            ans_ema = ans if ans_ema is None else 0.9 * ans_ema + 0.1 * ans
            log(f"step {step} loss {lv:.3f} answer-token loss {ans:.3f} lr {lr:.2e} tokens {tokens:,} "
                f"tok/s {tokens / (time.time() - t_start):,.0f} drills {len(store.ids):,}")
    train_time = time.time() - t_start
    pool.terminate()
    log(f"done: {step} steps, {tokens:,} tokens in {train_time:.0f}s; {len(store.ids):,} distinct drills "
        f"({store.tokens:,} tokens) by task {store.tasks}")

    deadline = T0 + TOTAL_BUDGET_S - 12
    scores = evaluate(model, tok, device, deadline)

    model = model.to(torch.bfloat16)
    model.save_pretrained(stage, max_shard_size=SHARD)
    metrics = {"params": n_params, "steps": step, "tokens_seen": tokens, "train_seconds": round(train_time, 1),
               "batch": BATCH, "window": WINDOW, "final_loss_ema": loss_ema, "final_answer_loss_ema": ans_ema,
               "validation": scores,
               "corpus_tokens": int(len(stream)), "stdlib_tokens": int(n_code),
               "drills": len(store.ids), "drill_tokens": int(store.tokens), "drills_by_task": store.tasks,
               "stdlib_root": stdlib_root, "python": sys.version.split()[0], "torch": torch.__version__,
               "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "settings": {"lr": LR, "drill_frac": DRILL_FRAC, "answer_weight": ANSWER_WEIGHT,
                            "task_weights": drills.TASK_WEIGHTS, "seed": SEED}}
    (stage / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"saved; total {time.time() - T0:.0f}s")
    (stage / "train.log").write_text("\n".join(LOG_LINES) + "\n")
    # shards go out as they are; everything else in one tar (the device returns at most 8 files)
    with tarfile.open(out / "meta.tar", "w") as tar:
        for p in sorted(stage.iterdir()):
            if p.suffix == ".safetensors":
                shutil.copy(p, out / p.name)
            else:
                tar.add(p, arcname=p.name)
    print(sorted(p.name for p in out.iterdir()), flush=True)


if __name__ == "__main__":
    main()
