"""The settings a user gives the ``tokenselect`` command reach the engine and its policy: a flag, a ``--config``
file, a flag over the file, fp8 selection keys. The command runs in this process (``cli.main``) with the engine
recorded as it is built, so the test reads the very policy that generated."""

from __future__ import annotations

import json

import pytest
import torch

from tokenselect import cli, engine
from tokenselect.kernels.cudnn_attention import PlanBudget


@pytest.fixture
def built(monkeypatch):
    """The engines the command builds, in order."""
    made = []

    class Recorded(engine.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(engine, "LLM", Recorded)
    return made


def generate(tiny_llama, *args):
    return cli.main(["generate", "--model", str(tiny_llama), "--prompt", "The quick brown fox", "--max-tokens", "2",
                     *args])


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_sets_the_policy(tiny_llama, tmp_path, built, suffix):
    settings = {"k": 16, "n_init": 2, "n_local": 8, "selector": "hard_vote", "theta": 0.25}
    cfg = tmp_path / f"ts{suffix}"
    cfg.write_text(json.dumps(settings) if suffix == ".json" else "".join(f"{k}: {v}\n" for k, v in settings.items()))
    assert generate(tiny_llama, "--attention", "tokenselect", "--config", str(cfg)) == 0
    (llm,) = built
    policy = llm.policy
    assert policy.name == "tokenselect" and llm.policy_settings == settings
    assert (policy.k, policy.n_init, policy.n_local, policy.selector, policy.selection_cache.theta) == (
        16, 2, 8, "hard_vote", 0.25)


def test_flags_override_the_config_file_and_engine_settings_come_from_it(tiny_llama, tmp_path, built):
    cfg = tmp_path / "ts.yaml"
    cfg.write_text("k: 16\nn_init: 2\nn_local: 8\nkv_cache_tokens: 640\nchunk_size: 48\n")
    assert generate(tiny_llama, "--attention", "tokenselect", "--config", str(cfg), "--k", "24", "--n-local", "4") == 0
    (llm,) = built
    assert (llm.policy.k, llm.policy.n_init, llm.policy.n_local) == (24, 2, 4)
    assert llm.cache.n_slots == 640 and llm.chunk_size == 48


@pytest.mark.parametrize("select_dtype, want", [("auto", None), ("kv", None), ("fp8", torch.float8_e4m3fn)])
def test_select_dtype_reaches_the_cache_the_policy_scores(tiny_llama, built, select_dtype, want):
    assert generate(tiny_llama, "--attention", "tokenselect", "--k", "8", "--n-init", "2", "--n-local", "4",
                    "--select-dtype", select_dtype) == 0
    (llm,) = built
    if select_dtype == "auto" and llm.device.type == "cuda":  # TokenSelect's default on a GPU: an fp8 copy
        want = torch.float8_e4m3fn
    want = want or llm.dtype  # auto on a CPU, kv: the keys of the KV pool itself, in the model's dtype
    assert llm.select_dtype == want and llm.cache.k_select.dtype == want
    assert llm.policy.cache is llm.cache
    assert (llm.cache.k_select is llm.cache.k) is (want == llm.dtype)


def test_weight_dtype_reaches_the_model(tiny_llama, built):
    from tokenselect.models.fp8 import Fp8Linear

    assert generate(tiny_llama, "--weight-dtype", "fp8") == 0
    (llm,) = built
    assert llm.settings.weight_dtype == "fp8" and isinstance(llm.model.model.layers[1].self_attn.o_proj, Fp8Linear)


def test_chunk_attention_reaches_the_kernels_the_policy_attends_with(tiny_llama, built, capsys):
    """--chunk-attention: auto is cuDNN's path on a Hopper GPU (the Triton kernels with
    ``sparse_attention(cudnn=PlanBudget())``), the Triton kernel elsewhere; triton names the kernel; cudnn where
    it cannot run is refused with the reason, and no engine is made."""
    assert generate(tiny_llama, "--attention", "tokenselect", "--k", "8", "--n-init", "2", "--n-local", "4") == 0
    assert generate(tiny_llama, "--attention", "tokenselect", "--chunk-attention", "triton") == 0
    auto, named = built
    hopper = auto.device.type == "cuda" and auto.dtype != torch.float32 and torch.cuda.get_device_capability()[0] == 9
    assert auto.chunk_attention == ("cudnn" if hopper else "triton") and named.chunk_attention == "triton"
    assert auto.kernels.name == ("triton+cudnn" if hopper else "triton" if auto.device.type == "cuda" else "torch")
    assert named.kernels.name == ("triton" if named.device.type == "cuda" else "torch")
    if hopper:
        assert isinstance(auto.kernels.sparse_attention.keywords["cudnn"], PlanBudget)
    if auto.device.type == "cpu":
        capsys.readouterr()
        assert generate(tiny_llama, "--chunk-attention", "cudnn") != 0
        assert "error: chunk_attention=cudnn runs with the triton kernels on CUDA" in capsys.readouterr().err
        assert len(built) == 2


def test_defaults_fit_the_window_when_nothing_is_set(tiny_llama, built):
    """No flags and no file: the paper's defaults scaled to the 256-token window (k 2048 -> 64, ...)."""
    assert generate(tiny_llama, "--attention", "tokenselect") == 0
    (llm,) = built
    assert llm.policy_settings == {} and (llm.policy.k, llm.policy.n_init, llm.policy.n_local) == (64, 4, 16)


def test_every_policy_and_engine_flag_parses_to_its_setting(tmp_path):
    """Each flag's name, type and choices, as policy_kwargs hands them to the engine (no model needed)."""
    import argparse

    from tokenselect.policies import add_policy_args, policy_kwargs

    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    args = parser.parse_args(
        "--k 5 --n-init 1 --n-local 2 --theta 0.5 --selector topk --score-scale sqrt_d --span 3 --n-spans 4 "
        "--block-size 8 --repr-keys 2 --page-size 4 --positions original --kernels torch --rope-scaling dynamic:4 "
        "--chunk-size 48 --dtype float32 --device cpu --kv-cache-tokens 640 --kv-dtype fp8 --kv-offload values "
        "--select-dtype fp8 --no-cuda-graphs --chunk-attention triton".split())
    want = {"k": 5, "n_init": 1, "n_local": 2, "theta": 0.5, "selector": "topk", "score_scale": "sqrt_d", "span": 3,
            "n_spans": 4, "positions": "original", "block_size": 8, "repr_keys": 2, "page_size": 4,
            "kernels": "torch", "rope_scaling": "dynamic:4", "chunk_size": 48, "dtype": "float32", "device": "cpu",
            "kv_cache_tokens": 640, "kv_dtype": "fp8", "kv_offload": "values", "select_dtype": "fp8",
            "cuda_graphs": False, "chunk_attention": "triton"}
    got = policy_kwargs(args)
    assert got == want and all(type(got[key]) is type(value) for key, value in want.items())
    assert policy_kwargs(args, "tokenselect", engine=False) == {
        "k": 5, "n_init": 1, "n_local": 2, "theta": 0.5, "selector": "topk", "score_scale": "sqrt_d",
        "positions": "original"}
    for choice, values in (("--selector", ("soft_vote", "hard_vote", "topk")),
                           ("--positions", ("reindex", "original", "fixed")),
                           ("--kernels", ("triton", "torch")), ("--kv-dtype", ("auto", "fp8", "bf16", "fp16", "fp32")),
                           ("--kv-offload", ("none", "values")), ("--select-dtype", ("auto", "fp8", "kv")),
                           ("--chunk-attention", ("auto", "triton", "cudnn"))):
        for value in values:
            assert getattr(parser.parse_args([choice, value]), choice[2:].replace("-", "_")) == value
        with pytest.raises(SystemExit):
            parser.parse_args([choice, "nope"])
    defaults = parser.parse_args([])
    assert policy_kwargs(defaults) == {} and defaults.cuda_graphs is None  # unset: the declared defaults apply
    cfg = tmp_path / "s.json"
    cfg.write_text('{"n-local": 3, "k": 7}')  # dashes or underscores
    assert policy_kwargs(parser.parse_args(["--config", str(cfg), "--k", "9"])) == {"n_local": 3, "k": 9}
    yml = tmp_path / "s.yml"
    yml.write_text("n_local: 5\nselector: hard_vote\n")  # .yml is YAML too
    assert policy_kwargs(parser.parse_args(["--config", str(yml)])) == {"n_local": 5, "selector": "hard_vote"}
    assert policy_kwargs(argparse.Namespace(k=3, theta=None)) == {"k": 3}  # flags a command does not have: left out
    cfg.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a mapping of settings"):
        policy_kwargs(parser.parse_args(["--config", str(cfg)]))


def test_the_settings_describe_themselves(capsys):
    """Flags, help, the settings document and the per-request settings come from the settings dataclasses: the help
    says which defaults shrink with the window, docs/settings.md is what the dataclasses generate, and a setting's
    range is checked where it is given."""
    from pathlib import Path

    from tokenselect.policies import POLICIES, fitted_settings, settings_markdown
    from tokenselect.settings import EngineSettings, specs

    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--k K tokens selected from the middle of the cache (default: tokenselect 2048 tokens x min(1, " \
           "window/8192);" in text
    assert "--top TOP" in text and "--max-num-seqs" in text  # every declared setting has its flag
    assert "attention policy settings (unset: the paper's defaults; defaults marked 'x min(1, window/8192)' shrink " \
           "with a model window under 8192 tokens):" in text  # the scaling, said once where the flags are listed
    assert "--config CONFIG JSON or YAML file of settings (flags override it)" in text and "engine settings:" in text
    docs = Path(__file__).parent.parent / "docs" / "settings.md"
    assert docs.read_text() == settings_markdown(), "regenerate: python -m tokenselect.policies > docs/settings.md"
    assert {spec.name for spec in specs(POLICIES["tokenselect"].Settings) if spec.per_request} == {"k", "n_local",
                                                                                                  "theta"}
    fitted = fitted_settings("tokenselect", {"k": 100}, 256)  # a given value stays; defaults shrink by 256/8192
    assert (fitted["k"], fitted["n_init"], fitted["n_local"], fitted["dense_until"]) == (100, 4, 16, 256)
    assert fitted_settings("tokenselect", {}, 16384)["k"] == 2048  # never grown past the paper's
    for bad, match in (({"theta": 1.5}, "theta must be in"), ({"k": -1}, "k must be >= 0"),
                       ({"selector": "x"}, "selector must be one of"), ({"span": 3}, "takes no setting span")):
        with pytest.raises(ValueError, match=match):
            fitted_settings("tokenselect", bad, 256)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineSettings(max_num_seqs=0)


def test_results_record_the_settings_fitted_to_the_window(tiny_llama):
    from tokenselect import LLM

    llm = LLM(tiny_llama, "tokenselect", k=40)
    assert llm.policy_config["fitted_to_window"] == ["n_init", "n_local"] and llm.policy_config["window"] == 256
    assert (llm.policy_config["k"], llm.policy_config["n_init"]) == (40, 4)


def test_a_settings_range_includes_its_ends_and_a_tighter_bound_applies():
    """``problem``, the one check behind a policy's, the engine's and a request's settings: the ends of a range are
    valid values, one step past them is not, a tighter upper bound (the server's largest size) wins only where it
    is tighter, and the message names the setting, the range and the value."""
    from tokenselect.policies.tokenselect import TokenSelectSettings
    from tokenselect.settings import EngineSettings, problem, specs

    ts = {spec.name: spec for spec in specs(TokenSelectSettings)}
    engine_specs = {spec.name: spec for spec in specs(EngineSettings)}
    theta, k = ts["theta"], ts["k"]
    assert [problem(theta, v) for v in (-1.0, -1, 0.25, 1, 1.0)] == [None] * 5
    assert problem(theta, 1.0001) == "theta must be in [-1.0, 1.0], not 1.0001"
    assert problem(theta, -1.0001) == "theta must be in [-1.0, 1.0], not -1.0001"
    assert problem(k, 0) is None and problem(k, 10**9) is None
    assert problem(k, -1) == "k must be >= 0, not -1"
    assert problem(k, 100, high=100) is None
    assert problem(k, 101, high=100) == "k must be in [0, 100], not 101"
    assert problem(theta, 0.5, high=0.5) is None and problem(theta, 0.6, high=0.5) == \
        "theta must be in [-1.0, 0.5], not 0.6"
    assert problem(theta, 1.0, high=5) is None and problem(theta, 1.5, high=5) == \
        "theta must be in [-1.0, 1.0], not 1.5"
    assert problem(engine_specs["max_num_seqs"], 1) is None
    assert problem(engine_specs["max_num_seqs"], 0) == "max_num_seqs must be >= 1, not 0"
    # types: a whole number for a count, a number (not a bool, not a string, not NaN) for a float
    assert problem(k, 2.0) == "k must be a whole number, not 2.0"
    assert problem(k, True) == "k must be a whole number, not True"
    assert problem(theta, False) == "theta must be a number, not False"
    assert problem(theta, "0.5") == "theta must be a number, not '0.5'"
    assert problem(theta, float("nan")) == "theta must be a number, not nan"
    # None: valid where the default is None or None has a declared meaning, else "must be set"
    assert problem(theta, None) is None and problem(ts["dense_until"], None) is None
    assert problem(k, None) == "k must be set"
    assert problem(ts["selector"], "topk") is None
    assert problem(ts["selector"], "top") == "selector must be one of soft_vote, hard_vote, topk, not 'top'"
    assert problem(engine_specs["dtype"], "bfloat16") is None  # a free-form string: no range to check
    with pytest.raises(ValueError, match=r"^k must be >= 0, not -1$"):
        TokenSelectSettings(k=-1)
    with pytest.raises(ValueError, match=r"^theta must be in \[-1.0, 1.0\], not 2$"):
        TokenSelectSettings(theta=2)


def test_check_names_the_settings_a_kind_takes_and_fitted_keeps_a_zero_default():
    from tokenselect.policies.quest import QuestSettings
    from tokenselect.policies.tokenselect import TokenSelectSettings
    from tokenselect.settings import PAPER_WINDOW, NoSettings, check, fitted, scaled

    with pytest.raises(ValueError, match=r"^attention 'x' takes no setting a, b \(it takes: k, n_init, n_local, theta, "
                                         r"selector, neighbours, prefill_group, score_scale, positions, dense_until\)$"):
        check(TokenSelectSettings, {"b": 1, "a": 2, "k": 3}, "attention 'x'")
    with pytest.raises(ValueError, match=r"^attention 'full' takes no setting k \(it takes: none\)$"):
        check(NoSettings, {"k": 1}, "attention 'full'")
    with pytest.raises(ValueError, match="^k must be >= 0, not -2$"):
        check(TokenSelectSettings, {"n_init": 0, "k": -2}, "attention 'x'")
    check(TokenSelectSettings, {"k": 0, "theta": -1.0}, "attention 'x'")
    assert fitted(QuestSettings, {}, 1024)["n_init"] == 0  # a zero default is not raised to the floor of 1
    small = fitted(TokenSelectSettings, {"n_local": 7}, 16)  # 2048 * 16 / 8192 = 4; 128 * 16 / 8192 = 0.25 -> 1
    assert (small["k"], small["n_init"], small["n_local"], small["theta"]) == (4, 1, 7, 0.9)
    assert type(small["k"]) is int
    at_paper = fitted(TokenSelectSettings, {}, PAPER_WINDOW)
    assert (at_paper["k"], at_paper["n_init"], at_paper["n_local"]) == (2048, 128, 512)
    assert scaled(TokenSelectSettings, {}, PAPER_WINDOW) == [] and scaled(TokenSelectSettings, {}, 2 * PAPER_WINDOW) == []
    assert scaled(TokenSelectSettings, {"k": 5}, PAPER_WINDOW - 1) == ["n_init", "n_local"]
    assert scaled(QuestSettings, {}, 1024) == ["k", "n_local"]  # n_init's default 0 is not shrunk


def test_a_declared_setting_describes_its_default_unit_scaling_and_range():
    """``setting`` and ``Spec`` on a settings class made here (the shipped ones declare a meaning for every None)."""
    from dataclasses import dataclass

    from tokenselect.settings import Validated, setting, specs

    @dataclass(frozen=True)
    class Example(Validated):
        a: int | None = setting(None, "plain")
        b: int = setting(4, "a size", unit="tokens", low=1, scales=True, per_request=True)
        c: float = setting(0.5, "a fraction", high=1.0)
        d: str = setting("x", "a choice", choices=("x", "y"))
        e: str = setting("free", "free text")
        f_g: int | None = setting(None, "off by default", unit="tokens", low=0, kind=int, none="off")

    a, b, c, d, e, fg = specs(Example)
    assert (a.name, a.default, a.help, a.kind, a.describe_default(), a.describe_range()) == (
        "a", None, "plain", str, "none", "")
    assert (b.kind, b.unit, b.scales, b.per_request, b.low, b.high) == (int, "tokens", True, True, 1, None)
    assert b.describe_default() == "4 tokens x min(1, window/8192)" and b.describe_range() == "[1, inf] tokens"
    assert (c.kind, c.describe_default(), c.describe_range(), c.scales, c.per_request) == (
        float, "0.5", "[-inf, 1.0]", False, False)
    assert (d.choices, d.describe_range(), e.describe_range(), e.kind) == (("x", "y"), "x, y", "", str)
    assert (fg.flag, fg.kind, fg.none, fg.describe_default(), fg.describe_range()) == (
        "--f-g", int, "off", "off", "[0, inf] tokens")  # a None default's unit: in the range
    assert Example(b=1, c=-3.0, d="y", f_g=None).b == 1
    for bad, match in (({"b": 0}, "b must be >= 1, not 0"), ({"c": 1.5}, r"c must be in \[.*, 1.0\], not 1.5"),
                       ({"d": "z"}, "d must be one of x, y, not 'z'"), ({"f_g": -1}, "f_g must be >= 0, not -1")):
        with pytest.raises(ValueError, match=f"^{match}$"):
            Example(**bad)


def test_engine_flags_help_carries_each_settings_help_default_and_range():
    """``add_flags`` writes every engine flag's help from its setting: the text, the default, and the range or the
    choices where there is one (a boolean flag's too), exactly."""
    import argparse

    from tokenselect.settings import EngineSettings, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, EngineSettings)
    helps = {a.option_strings[0]: a.help for a in parser._actions}
    assert helps["--chunk-size"] == ("prefill chunk (default 512, or window/4 if smaller; 4 times that for TokenSelect, "
                                     "whose groups of prefill_group queries choose as chunks of that size would; "
                                     "[1, inf] tokens)")
    assert helps["--kv-offload"].startswith("values: keep the V pool") and \
        helps["--kv-offload"].endswith("(default none; none, values)")
    assert helps["--dtype"].endswith("bfloat16, float16 (default auto)")  # no range: closed after the default
    assert helps["--cuda-graphs"].startswith("run decode steps") and \
        helps["--cuda-graphs"].endswith("(default on with CUDA)")
