"""The server's limits and access settings, apart from the web stack so that the command line can
build its flags without importing it: ``ServerOptions`` declares each setting once, with its default
and help; ``add_server_args`` makes them flags of ``tokenselect serve``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
PROMPT_CHARS_PER_TOKEN = 16  # the default character limit of a prompt: this many per token of the cap
API_KEY_VARIABLE = "TOKENSELECT_API_KEY"


def _option(default, help: str, **flag):
    """A field of ``ServerOptions``; ``flag``: argparse keywords of its flag (type, nargs, action)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ServerOptions:
    """Limits and access settings of the server. Each field is the flag ``--field-name`` of
    ``tokenselect serve`` (``add_server_args``); None means the default the help text names."""

    api_key: str | None = _option(None, "clients must send 'Authorization: Bearer KEY' (every path but /health); "
                                        f"default: ${API_KEY_VARIABLE} if set (kept out of the process list), "
                                        "else no key", type=str, metavar="KEY")
    allowed_hosts: tuple[str, ...] | None = _option(
        None, "Host header values served (names or addresses; '*' any, '*.example.com' its subdomains), against "
              "DNS rebinding; default: the loopback names when listening on a loopback address, else any",
        nargs="+", type=str, metavar="HOST")
    enable_docs: bool = _option(False, "serve the interactive API docs (/docs, /redoc, /openapi.json)",
                                action="store_true")
    max_model_len: int | None = _option(
        None, "most KV slots one request may reserve (prompt + max_tokens), so that one request cannot hold the "
              "whole pool; default: half the KV pool", type=int, metavar="N")
    max_body_bytes: int = _option(16 << 20, "largest request body in bytes; larger ones get 413", type=int, metavar="N")
    max_prompt_chars: int | None = _option(
        None, f"longest prompt in characters (chat: all messages), checked before tokenizing; default: "
              f"{PROMPT_CHARS_PER_TOKEN} per token of --max-model-len", type=int, metavar="N")
    max_stop_strings: int = _option(16, "most stop strings per request", type=int, metavar="N")
    max_stop_chars: int = _option(256, "longest stop string in characters", type=int, metavar="N")
    max_queued_requests: int = _option(
        256, "requests waiting for their first token at most (being tokenized, queued or prefilling); more get "
             "429 with Retry-After", type=int, metavar="N")
    retry_after: int = _option(1, "seconds a 429 tells the client to wait (Retry-After)", type=int, metavar="SECONDS")
    shutdown_timeout: float = _option(30.0, "seconds running requests get to finish on shutdown (SIGTERM, "
                                            "Ctrl-C); then they are aborted", type=float, metavar="SECONDS")
    warm_up_tokens: int | None = _option(
        None, "before taking requests, serve a prompt of this many tokens and two a few shorter that end inside a "
              "chunk (LLM.warm_up), so that the first requests do not wait for kernel compiles and CUDA graph "
              "captures; 0: none; default: on a GPU two prefill chunks past the policy's selection threshold "
              "(LLM.default_warm_up_tokens: 12,288 for TokenSelect on a model of an 8K window), none on a CPU",
        type=int, metavar="N")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOptions":
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
        if "api_key" not in given and os.environ.get(API_KEY_VARIABLE):
            given["api_key"] = os.environ[API_KEY_VARIABLE]
        if "allowed_hosts" in given:
            given["allowed_hosts"] = tuple(given["allowed_hosts"])
        elif getattr(args, "host", "127.0.0.1") not in LOOPBACK_HOSTS:
            given["allowed_hosts"] = ("*",)
        return cls(**given)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ServerOptions`` (unset: None, the field's default)."""
    g = parser.add_argument_group("limits and access")
    for f in dataclasses.fields(ServerOptions):
        flag = {key: value for key, value in f.metadata.items() if key != "help"}
        shown = f" (default {f.default})" if f.default not in (None, False) else ""  # else the help names it
        g.add_argument("--" + f.name.replace("_", "-"), default=None, help=f.metadata["help"] + shown, **flag)
