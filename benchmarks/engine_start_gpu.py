"""How long an engine takes to start, step by step (where a stalled eval waits): torch's CUDA init (on a GPU
machine), the package import, the checkpoint's config and tokenizer, then the LLM itself. Every 30 s without an end,
faulthandler prints every thread's stack to stderr.

    python benchmarks/engine_start_gpu.py MODEL POLICY [KV_TOKENS] [--fresh]

--fresh: the GGUF's saved tokenizer ($TOKENSELECT_HOME/tokenizers) is removed first, so the tokenizer step converts
it from the file's metadata as a first start does; without it a saved one is loaded.
"""

import argparse
import faulthandler
import shutil
import time

# parsed first: --help (or a wrong command line) answers before torch or CUDA start
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model", metavar="MODEL", help="a registry name, a GGUF file or a checkpoint folder")
parser.add_argument("policy", metavar="POLICY", help="the attention policy the engine runs, e.g. tokenselect")
parser.add_argument("kv_tokens", type=int, nargs="?", default=140000, metavar="KV_TOKENS",
                    help="tokens of KV cache the engine holds (default 140000)")
parser.add_argument("--fresh", action="store_true", help="remove the GGUF's saved tokenizer first")
args = parser.parse_intermixed_args()  # --fresh may stand anywhere on the line

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
from tokenselect.models.gguf import tokenizer_folder  # noqa: E402
from tokenselect.models.registry import resolve_model  # noqa: E402

mark("tokenselect imported")
path = resolve_model(args.model)
if args.fresh and path.is_file():
    shutil.rmtree(tokenizer_folder(path), ignore_errors=True)
checkpoint = Checkpoint(path)
mark(f"config of {path.name}")
checkpoint.tokenizer()
mark("tokenizer" + (" (converted from the file)" if args.fresh else " (the saved one, where there is one)"))
llm = LLM(checkpoint, args.policy, kv_cache_tokens=args.kv_tokens, max_num_seqs=1)
mark("engine started (from the open checkpoint)")
