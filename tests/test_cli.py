"""The tokenselect command as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from checkpoints import CORPUS
from tokenselect.cli import build_parser


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenselect.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("select_dtype", ["auto", "fp8"])  # fp8: selection scores an fp8 copy of the keys
def test_generate_prints_text_and_selection_cache_hit_rate(tiny_llama, tmp_path, select_dtype):
    prompt_file = tmp_path / "long.txt"
    prompt_file.write_text("".join(CORPUS) * 25)  # ~4x the tiny model's window
    res = run("generate", "--model", str(tiny_llama), "--prompt-file", str(prompt_file), "--attention", "tokenselect",
              "--k", "32", "--n-init", "4", "--n-local", "16", "--theta", "0.5", "--max-tokens", "8", "--chunk-size", "64",
              "--select-dtype", select_dtype)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "Selection Cache hit rate" in res.stderr
    assert "[tokenselect] prompt" in res.stderr


def test_generate_reads_settings_from_a_config_file(tiny_llama, tmp_path):
    cfg = tmp_path / "ts.yaml"
    cfg.write_text("k: 16\nn_init: 2\nn_local: 8\nselector: hard_vote\n")
    res = run("generate", "--model", str(tiny_llama), "--prompt", "The quick brown fox", "--attention", "tokenselect",
              "--config", str(cfg), "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
    # the file is read by the real command: a setting in it that cannot work is reported as such
    cfg.write_text("k: 16\nkv_cache_tokens: 8\n")
    res = run("generate", "--model", str(tiny_llama), "--prompt", "The quick brown fox", "--attention", "tokenselect",
              "--config", str(cfg), "--max-tokens", "4")
    assert res.returncode == 2 and "exceeds the context limit of 8 tokens" in res.stderr
    # (tests/test_cli_settings.py checks that each setting of the file reaches the policy)


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model"], "error: model not found: /nonexistent/model"),
    (["--k", "0", "--attention", "full"], "error: attention 'full' takes no setting k"),
    (["--kv-cache-tokens", "8"], "exceeds the context limit of 8 tokens"),
])
def test_bad_input_is_one_clear_line(tiny_llama, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_llama), *args]
    res = run("generate", "--prompt", "The quick brown fox jumps", *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_missing_prompt_file_is_an_error_not_a_traceback(tiny_llama, tmp_path):
    res = run("generate", "--model", str(tiny_llama), "--prompt-file", str(tmp_path / "missing.txt"))
    assert res.returncode == 2 and "missing.txt" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("command", [[], ["generate"]])
def test_help(command):
    res = run(*command, "--help")
    assert res.returncode == 0 and "usage: tokenselect" in res.stdout


def test_serve_refuses_an_address_in_use_before_loading_the_model():
    """The port is taken before the model loads (a model of minutes, a warm-up of more): a port in use is one line at
    once, naming the address, here before the missing model is even looked for. A port out of range is argparse's
    usage error."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = run("serve", "--model", "/nonexistent/model", "--port", str(port))
    assert res.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr
    assert "model not found" not in res.stderr and "Traceback" not in res.stderr
    res = run("serve", "--port", "70000")
    assert res.returncode == 2 and "a port is 0 to 65535, not 70000" in res.stderr


def every_option(parser: argparse.ArgumentParser, command: tuple[str, ...] = ()):
    """(command, argparse action) for every option of ``parser`` and of its subcommands, at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_option(sub, (*command, name))
        elif not isinstance(action, argparse._HelpAction):
            yield command, action


def test_every_option_of_every_command_says_what_it_does():
    """``--help`` explains: each option and positional argument of each subcommand (bench's and eval's included)
    carries a help text. A planted option without one fails this."""
    options = list(every_option(build_parser()))
    assert len(options) > 100 and {command[:1] for command, _ in options} >= {("generate",), ("serve",), ("bench",)}
    silent = [f"{' '.join(command)} {'/'.join(action.option_strings) or action.dest}" for command, action in options
              if not action.help]
    assert not silent, silent


def test_demo_finds_the_passkey_with_tokenselect_where_full_attention_fails():
    """The README's main job, shortened to 4x the shipped model's window."""
    res = run("demo", "--multiple", "4")
    assert res.returncode == 0, res.stderr
    verdicts = {name.strip(): rest.split()[-2] for name, rest in (line.split(":", 1) for line in res.stdout.splitlines())}
    assert verdicts == {"tokenselect": "correct", "full": "wrong"}
