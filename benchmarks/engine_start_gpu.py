"""How long an engine takes to start on the GPU machine, step by step (where a stalled eval waits): torch's CUDA
init, the package import, the checkpoint's config and tokenizer, then the LLM itself. Every 30 s without an end,
faulthandler prints every thread's stack to stderr.

    python benchmarks/engine_start_gpu.py MODEL POLICY [KV_TOKENS]
"""

import faulthandler
import sys
import time

faulthandler.dump_traceback_later(30, repeat=True)
start = time.perf_counter()


def mark(what: str) -> None:
    print(f"{time.perf_counter() - start:7.1f} s  {what}", flush=True)


import torch  # noqa: E402

if torch.cuda.is_available():
    torch.cuda.init()
mark(f"torch {torch.__version__}, CUDA init, {torch.cuda.device_count()} GPUs")
from tokenselect.engine import LLM  # noqa: E402
from tokenselect.models.loader import Checkpoint  # noqa: E402
from tokenselect.models.registry import resolve_model  # noqa: E402

mark("tokenselect imported")
path = resolve_model(sys.argv[1])
checkpoint = Checkpoint(path)
mark(f"config of {path.name}")
checkpoint.tokenizer()
mark("tokenizer")
llm = LLM(sys.argv[1], sys.argv[2], kv_cache_tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 140000,
          max_num_seqs=1)
mark("engine started")
