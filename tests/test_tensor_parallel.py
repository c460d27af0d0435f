"""Tensor parallelism on a CPU: 2 ranks in processes of their own over gloo, against one process.

The engine with ``tensor_parallel_size=2`` spawns its second rank itself; the greedy tokens of every policy
(their selections' votes summed over both ranks' heads) equal one process's. A policy's choice with rank-local
votes is checked by hand in two processes started here, the command line and the server as a user runs them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoints import distinct_tokens
from policy_steps import cache_with_keys, step
from tokenselect import parallel
from tokenselect.cli import build_parser
from tokenselect.engine import LLM
from tokenselect.kernels import get_kernels
from tokenselect.parallel import NO_REDUCE, HeadReduce
from tokenselect.policies import policy_kwargs
from tokenselect.policies.tokenselect import TokenSelect
from tokenselect.sampling import SamplingParams

ENGINE = dict(kv_cache_tokens=1024, chunk_size=32, device="cpu")
# sizes at which a 2-layer model of window 256 selects in a prompt of a few hundred tokens (as ``small_sizes``)
SETTINGS = {
    "full": {},
    "streaming": dict(n_init=4, n_local=16, dense_until=0),
    "tokenselect": dict(n_init=4, n_local=16, k=16, dense_until=0, theta=0.6),
    "reattention": dict(n_init=4, n_local=16, span=4, n_spans=4, dense_until=0),
    "quest": dict(n_init=4, n_local=16, k=16, page_size=4, dense_until=0),
    "infllm": dict(n_init=4, n_local=16, k=16, block_size=4, repr_keys=2, dense_until=0),
}
PROMPTS = [distinct_tokens(200, seed) for seed in range(2)]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    """The tiny Llama (4 heads, 2 kv heads) with every bias: q/k/v's split by heads, o_proj's and the MLP's added
    once."""
    return checkpoint_factory("llama", attention_bias=True, mlp_bias=True)


def test_rank_local_votes_run_in_lockstep(checkpoint):
    """(First: one tensor-parallel engine per process at a time, and the module's pair lives to the end.) With
    CUDA graphs' step functions (run eagerly on a CPU); closing drops them before the group is left, as NCCL needs
    (a graph that captured a collective keeps the communicator whose teardown waits for it)."""
    llm = LLM(checkpoint, "tokenselect", tensor_parallel_size=2, tp_selection="local", cuda_graphs=True, **ENGINE,
              **SETTINGS["tokenselect"])
    try:
        assert llm.settings.tp_selection == "local" and llm.heads is NO_REDUCE and llm.policy.heads is NO_REDUCE
        out = tokens(llm)
        assert [len(t) for t in out] == [PARAMS.max_tokens] * 2
        with pytest.raises(RuntimeError, match="one at a time per process"):
            LLM(checkpoint, "full", tensor_parallel_size=2, **ENGINE)
        # each rank chooses by its own heads: not what one process chooses over all four (so the global votes'
        # equality below has teeth), here from the first token on
        assert out != tokens(LLM(checkpoint, "tokenselect", **ENGINE, **SETTINGS["tokenselect"]))
        assert llm.runner.graphs.whole_steps > 0
    finally:
        llm.close()
    assert llm.runner.graphs is None and not dist.is_initialized()
    assert all(child.poll() is not None for child in llm.tp.children)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(one process, 2 ranks) on the checkpoint, full attention to start with."""
    one = LLM(checkpoint, "full", **ENGINE)
    two = LLM(checkpoint, "full", tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.close()
    assert all(child.poll() is not None for child in two.tp.children)


def tokens(llm, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("attention", list(SETTINGS))
def test_greedy_tokens_of_two_ranks_equal_one_process(engines, attention):
    one, two = engines
    for llm in engines:
        llm.set_attention(attention, **SETTINGS[attention])  # the ranks replay it (``LLM._replay``)
    assert two.tp.world == 2 and two.heads.spans_ranks and two.model.config.n_heads == 2
    # two sequences batched, then one alone: both in lockstep on both ranks
    assert tokens(two) == tokens(one)
    assert tokens(two, PROMPTS[:1]) == tokens(one, PROMPTS[:1])
    if attention == "tokenselect":  # the Selection Cache decides on the cosine over every rank's heads
        counts = [{key: llm.stats()[key] for key in ("selection_cache_hits", "selection_cache_misses")}
                  for llm in engines]
        assert counts[0] == counts[1] and min(counts[0].values()) > 0


def test_sampled_tokens_logprobs_aborts_and_prompt_logits_follow_rank_zero(engines):
    one, two = engines
    for llm in engines:
        llm.set_attention("tokenselect", **SETTINGS["tokenselect"])
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=2)
    outs = [llm.generate(PROMPTS[:1], sampled)[0] for llm in engines]
    assert outs[0].token_ids == outs[1].token_ids  # rank 0 samples and sends the tokens
    a = two.add_request(PROMPTS[0], PARAMS)
    b = two.add_request(PROMPTS[1], PARAMS)
    two.step()
    two.abort(a)  # replayed by the other rank before its next step
    while not b.finished:
        two.step()
    assert b.output_ids == tokens(one, PROMPTS[1:])[0] and a.finish_reason == "abort"
    assert torch.allclose(two.prompt_logits(PROMPTS[0][:80]), one.prompt_logits(PROMPTS[0][:80]), atol=1e-4)
    assert two.cache.num_free + two.stats()["prefix_cache_tokens"] == two.cache.n_slots


# ---- a policy's choice across two ranks, by hand ------------------------------------------------

def _choices(rank: int, port: int, out) -> None:
    """Rank ``rank`` of 2: TokenSelect's choice for one query over keys whose kv head 0 favours the first half of
    the middle and kv head 1 the second, with the votes summed over the ranks and with each rank's own."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    t, d = 96, 8
    keys = torch.randn(t, 2, d) * 0.1
    keys[8:40, 0, 0] += 3.0  # head 0's tokens
    keys[48:80, 1, 1] += 3.0  # head 1's
    q = torch.zeros(1, 4, d)
    q[:, :2, 0] = 1.0  # query heads 0, 1 read kv head 0, heads 2, 3 kv head 1
    q[:, 2:, 1] = 0.9
    settings = dict(k=16, n_init=4, n_local=8, theta=None, dense_until=0)
    got = {}
    for name, heads in (("global", HeadReduce(dist.group.WORLD, 2)), ("local", NO_REDUCE)):
        torch.manual_seed(1)
        cache, slots = cache_with_keys(keys[:, rank:rank + 1].contiguous())
        policy = TokenSelect(cache, get_kernels("torch"), **settings)
        policy.across_ranks(heads)
        got[name] = step(policy, slots, q[:, 2 * rank:2 * rank + 2], decode=True).order(slots)
    torch.manual_seed(1)
    cache, slots = cache_with_keys(keys)
    got["one process"] = step(TokenSelect(cache, get_kernels("torch"), **settings), slots, q, decode=True).order(slots)
    out.put((rank, got))
    dist.destroy_process_group()


def test_global_votes_choose_as_one_process_and_local_votes_by_the_rank_heads():
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = mp.start_processes(_choices, args=(parallel.free_port(), out), nprocs=2, join=False, start_method="spawn")
    results = dict(out.get(timeout=120) for _ in range(2))
    procs.join(timeout=60)
    one = results[0]["one process"]
    assert results[0]["global"] == results[1]["global"] == one
    middle = [i for i in one if 4 <= i < 96 - 8]
    assert len(middle) == 16
    local = [[i for i in results[r]["local"] if 4 <= i < 96 - 8] for r in range(2)]
    assert all(8 <= i < 40 for i in local[0]) and all(48 <= i < 80 for i in local[1])  # each rank's own heads
    assert local[0] != local[1]


def test_shards_put_back_together_give_the_checkpoint_tensors():
    w = torch.arange(6 * 4.0).view(6, 4)
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.mlp.up_proj.bias", 0),
                      ("model.layers.0.self_attn.o_proj.weight", 1), ("model.layers.0.mlp.down_proj.weight", 1)):
        t = w if name.endswith("weight") else w[:, 0]
        assert torch.equal(torch.cat([parallel.shard_tensor(name, t, r, 2) for r in range(2)], dim=dim), t)
    bias = torch.ones(4)  # a row-parallel bias is added once: rank 0's, the others' zero
    assert [float(parallel.shard_tensor("model.layers.0.self_attn.o_proj.bias", bias, r, 2).sum()) for r in range(2)] \
        == [4.0, 0.0]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 6 rows over 4 ranks: 2, 2, 2 and 0, zero-padded
        parts = [parallel.shard_tensor(name, w, r, 4) for r in range(4)]
        assert all(p.shape == (2, 4) for p in parts) and torch.equal(torch.cat(parts)[:6], w)
        assert not parts[3].any()
    norm = w[0]
    assert parallel.shard_tensor("model.norm.weight", norm, 1, 2) is norm  # every rank holds it whole
    with pytest.raises(ValueError, match="does not split evenly"):
        parallel.shard_tensor("model.layers.0.self_attn.k_proj.weight", w[:5], 0, 2)


# ---- bad input --------------------------------------------------------------------------------------

def test_bad_sizes_are_clear_errors_before_any_process_starts(tiny_llama):
    before = set(psutil.Process().children())  # (multiprocessing's resource tracker, once a test spawned)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(tiny_llama, tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(tiny_llama, tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="tp_selection must be one of global, local"):
        LLM(tiny_llama, tensor_parallel_size=2, tp_selection="both", device="cpu")
    with pytest.raises(ValueError, match="takes no setting"):
        LLM(tiny_llama, "full", tensor_parallel_size=2, k=4, device="cpu")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="exceeds the .* GPU"):
            parallel.start(64, "cuda", None)
    assert set(psutil.Process().children()) <= before  # no rank was started


def test_flags_reach_the_engine():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2",
                                      "--tp-selection", "local"])
    assert policy_kwargs(args) == {"tensor_parallel_size": 2, "tp_selection": "local"}
    for command in (["serve"], ["eval", "--task", "passkey"], ["demo"]):
        args = build_parser().parse_args([*command, "--tensor-parallel-size", "2"])
        assert policy_kwargs(args)["tensor_parallel_size"] == 2


# ---- as a user runs it ------------------------------------------------------------------------------

def cli(*args: str, **kwargs):
    return subprocess.run([sys.executable, "-m", "tokenselect.cli", *args], capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_generate_command_with_two_ranks_prints_what_one_process_prints_spawned_or_under_torchrun():
    args = ["generate", "--prompt", "Once upon a time there was a little fox who", "--max-tokens", "10",
            "--device", "cpu", "--attention", "tokenselect", "--k", "8", "--n-init", "2", "--n-local", "4",
            "--dense-until", "0"]
    two = cli(*args, "--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr
    one = cli(*args)
    assert one.returncode == 0, one.stderr
    assert two.stdout == one.stdout and two.stdout.strip()
    # the same ranks started by torchrun (one host here; several hosts: docs/tensor_parallel.md): every process runs
    # the command, rank 1 serves rank 0 inside LLM(...) and exits when it closes
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(parallel.free_port()), "-m", "tokenselect.cli", *args, "--tensor-parallel-size", "2"],
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == one.stdout


def test_rank_zero_leads_whether_started_by_hand_or_by_torchrun(monkeypatch):
    """``parallel.leads``: the process a user started leads (it spawns the others); under torchrun, rank 0 of the
    same world leads and the other ranks do not (so only rank 0 of ``tokenselect serve`` takes the port)."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert parallel.leads(1) and parallel.leads(2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not parallel.leads(2)
    assert parallel.leads(4)  # torchrun's world is not this engine's: the process starts its own ranks
    monkeypatch.setenv("RANK", "0")
    assert parallel.leads(2)


def test_server_with_two_ranks_answers_and_leaves_no_process(checkpoint):
    pytest.importorskip("uvicorn")  # the server's stack (absent on the GPU machine, which runs the other tests here)
    port = parallel.free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenselect.cli", "serve", "--model", str(checkpoint),
                               "--port", str(port), "--device", "cpu", "--tensor-parallel-size", "2",
                               "--attention", "tokenselect", "--kv-cache-tokens", "1024", "--chunk-size", "32",
                               *[f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS["tokenselect"].items()]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        ranks = psutil.Process(server.pid).children(recursive=True)
        assert ranks, "no rank process"
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        reference = LLM(checkpoint, "tokenselect", **ENGINE, **SETTINGS["tokenselect"])
        assert r.json()["choices"][0]["text"] == reference.generate([prompt], SamplingParams(max_tokens=8,
                                                                                           temperature=0))[0].text
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
        log = server.stdout.read()
        assert code in (0, 130), log  # 130: uvicorn re-raises the interrupt once it has shut down
        assert "attention tokenselect, KV pool of 1,024 tokens (fp32; " in log  # said at the start
        assert "terminating" not in log and "Traceback" not in log, log  # the rank stopped on rank 0's message
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"rank processes left: {alive}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
