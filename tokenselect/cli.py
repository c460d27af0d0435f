"""The ``tokenselect`` command: generate | demo | serve | eval | bench.

Errors a user can fix (a wrong model folder, a prompt too long, a bad setting) print one line,
``error: ...``, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import TokenSelectError
from .policies import POLICIES, add_policy_args, policy_kwargs
from .server_options import add_server_args


def add_model_args(parser: argparse.ArgumentParser, attention_default: str = "full") -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer); "
                             "default: the small model that ships with tokenselect")
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


def build_llm(args: argparse.Namespace):
    from .engine import LLM

    return LLM(args.model, args.attention, **policy_kwargs(args))


def print_stats(llm, n_prompt: int, n_new: int, seconds: float) -> None:
    stats = llm.stats()
    line = f"[{llm.attention}] prompt {n_prompt} tokens, generated {n_new} tokens in {seconds:.2f}s"
    if "selection_cache_hit_rate" in stats:
        line += (f"; Selection Cache hit rate {stats['selection_cache_hit_rate']:.1%} "
                 f"({stats['selection_cache_hits']} hits, {stats['selection_cache_misses']} misses)")
    print(line, file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from .sampling import SamplingParams

    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    llm = build_llm(args)
    if args.chat:
        if llm.tokenizer.chat_template is None:
            raise TokenSelectError(f"{llm.path} has no chat template; drop --chat")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=True)[0]
    print(out.text)
    print_stats(llm, len(out.prompt_token_ids), len(out.token_ids), time.perf_counter() - start)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A passkey hidden in a prompt ``--multiple`` times the model's window: TokenSelect finds it,
    full attention (positions past the window) does not."""
    import random

    from .eval.metrics import score
    from .eval.tasks import make_sample
    from .sampling import SamplingParams

    llm = build_llm(args)
    length = args.multiple * llm.window
    count = lambda text: len(llm.tokenizer(text)["input_ids"])  # noqa: E731
    sample = make_sample("passkey", length, args.depth, random.Random(args.seed), count)
    print(f"model {llm.path} (window {llm.window} tokens); passkey {sample.answers[0]} hidden at depth "
          f"{args.depth:.0%} of a {count(sample.input)}-token prompt ({args.multiple}x the window)", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    correct = {}
    for attention in [args.attention, *args.compare]:
        if attention != llm.attention:
            llm.set_attention(attention, **policy_kwargs(args, attention, engine=False))
        start = time.perf_counter()
        text = llm.generate([sample.input], params, use_tqdm=True)[0].text
        correct[attention] = score("passkey", text, sample.answers) == 1.0
        verdict = "correct" if correct[attention] else "wrong"
        print(f"{attention:>12}: {text.strip()!r:40} {verdict} ({time.perf_counter() - start:.1f}s)")
    return 0 if correct[args.attention] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve  # the web stack is imported only to serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenselect",
        description="Long-context LLM inference that attends only to the KV-cache tokens that matter "
                    "(TokenSelect, ReAttention and the baselines), on Hugging Face checkpoints.")
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

    demo = sub.add_parser("demo", help="passkey retrieval far past the model window, TokenSelect vs full",
                          description="Hide a passkey in a prompt MULTIPLE times the model's trained window "
                                      "and ask for it, with TokenSelect and then with full attention. "
                                      "Exit status 0 when the TokenSelect answer is correct.")
    demo.add_argument("--multiple", type=int, default=32,
                      help="prompt length in model windows (default 32; full attention takes minutes of it on a "
                           "CPU, --multiple 8 is quicker)")
    demo.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1 (default 0.5)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the passkey and its placement")
    demo.add_argument("--compare", nargs="*", default=["full"], help="policies to run after it (default: full)")
    demo.add_argument("--max-tokens", type=int, default=12)
    add_model_args(demo, attention_default="tokenselect")
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve the model over HTTP with the OpenAI API: /v1/completions, "
                                       "/v1/chat/completions (stream: true for server-sent events), "
                                       "/v1/models, /health. Requests are batched together by the engine.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model folder's name)")
    add_model_args(serve, attention_default="tokenselect")
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    from . import bench
    from .eval import cli as eval_cli

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
