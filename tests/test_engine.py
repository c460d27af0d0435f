"""Engine behaviour: the KV pool, batching, sampling, stop conditions, and errors for bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tokenselect import LLM, CheckpointError, ContextTooLong, KVPoolFull, SamplingParams
from tokenselect.kv_cache import KVCache
from tokenselect.transfer import to_device

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_allocator_hands_out_distinct_slots_and_takes_them_back():
    cache = KVCache(1, 10, 1, 4, torch.float32, torch.device("cpu"))
    a, b = cache.allocate(6), cache.allocate(3)
    assert len(set(a.tolist()) | set(b.tolist())) == 9 and cache.num_free == 1
    with pytest.raises(KVPoolFull, match="2 slots requested, 1 of 10 free"):
        cache.allocate(2)
    assert cache.num_free == 1  # the failed request took nothing
    cache.free(a)
    c = cache.allocate(7)
    assert set(c.tolist()).isdisjoint(b.tolist())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_to_device_copies_flat_and_nested_lists(device):
    """Step inputs: token ids, and the rows of a graph step's metadata (on a GPU through pinned memory)."""
    flat, nested = to_device([3, 1, 2], torch.device(device)), to_device([[1, 2], [5, 7]], torch.device(device))
    assert flat.device.type == nested.device.type == device and flat.dtype == nested.dtype == torch.int64
    assert flat.tolist() == [3, 1, 2] and nested.tolist() == [[1, 2], [5, 7]]
    assert to_device([], torch.device(device)).numel() == 0


def test_keys_are_cached_before_rope(tiny_llama):
    """What sits in the cache is k_proj(x) itself (read from the checkpoint): no position has been applied to it."""
    llm = LLM(tiny_llama)
    ids = prompt(20, 0)
    llm.prompt_logits(ids)
    layer0 = llm.model.model.layers[0]
    x = layer0.input_layernorm(llm.model.model.embed_tokens(torch.tensor(ids, device=llm.device)))
    from safetensors.torch import load_file

    k_proj = load_file(Path(tiny_llama) / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"]
    k = (x @ k_proj.to(x).T).view(20, 2, -1)
    slots = torch.arange(20, device=llm.device)  # a fresh pool hands out slots 0.. in order
    torch.testing.assert_close(llm.cache.k[0, slots], k.to(llm.cache.k.dtype))


@pytest.mark.parametrize("attention", ["full", "tokenselect", "reattention", "quest"])
def test_several_prompts_in_one_call_equal_one_at_a_time(tiny_llama, batch_invariant_matmuls, attention):
    """Each sequence's chunks, selections and Selection Cache are its own: batching changes nothing.
    (Selection kicks in past 84 tokens for this window-256 model: 4 sinks + 64 chosen + 16 local.)"""
    llm = LLM(tiny_llama, attention, chunk_size=32)
    prompts = [prompt(n, n) for n in (5, 70, 33, 130, 200)]
    together = llm.generate(prompts, GREEDY)
    alone = [LLM(tiny_llama, attention, chunk_size=32).generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert llm.scheduler.available == llm.cache.n_slots


def test_full_pool_queues_requests_and_never_touches_running_ones(tiny_llama):
    # room for one request at a time: the second waits until the first is done
    small = LLM(tiny_llama, chunk_size=32, kv_cache_tokens=160)
    outs = small.generate([prompt(100, 1), prompt(100, 2)], GREEDY)
    big = LLM(tiny_llama, chunk_size=32)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big.generate([prompt(100, 1), prompt(100, 2)], GREEDY)]


def test_prompt_longer_than_the_pool_is_rejected_cleanly(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_tokens=128)
    with pytest.raises(ContextTooLong, match="120 tokens \\+ max_tokens 12 = 132 exceeds the context limit of 128"):
        llm.generate([prompt(120, 0)], GREEDY)
    assert not llm.scheduler.has_work() and llm.cache.num_free == 128
    assert len(llm.generate([prompt(100, 0)], GREEDY)[0].token_ids) == 12  # still serving


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy(tiny_llama):
    llm = LLM(tiny_llama)
    p = prompt(40, 3)
    sampled = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True)
    a, b = llm.generate([p], sampled)[0], llm.generate([p], sampled)[0]
    other = llm.generate([p], SamplingParams(max_tokens=16, temperature=1.5, top_p=0.9, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids != other.token_ids
    top1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=1, ignore_eos=True)
    assert llm.generate([p], top1)[0].token_ids == llm.generate([p], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids


def test_a_steps_greedy_tokens_come_from_one_argmax_and_a_failed_sample_ends_only_its_own(monkeypatch):
    """sample_rows: greedy rows (temperature 0, or under GREEDY_BELOW) and unseeded sampled rows are drawn together
    on the device (one argmax over them all, one more over the sampled rows' draws, one read); a seeded row gets what
    ``sample`` alone gives it (same seed); a row of NaN logits gets an exception, and the rows beside it their
    tokens."""
    from tokenselect import sampling

    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(50, generator=gen) for _ in range(5)]
    rows[1][17] = 9.0
    rows[4][3] = 11.0
    rows[2] = torch.full((50,), float("nan"))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=sampling.GREEDY_BELOW / 2)]
    argmaxes = []
    real_argmax = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda t, *a, **k: argmaxes.append(t.shape) or real_argmax(t, *a, **k))
    tokens = sampling.sample_rows(rows, params, [None, None, torch.Generator().manual_seed(1),
                                                 torch.Generator().manual_seed(5), None])
    assert argmaxes == [(4, 50), (1, 50)]  # the three greedy rows and the unseeded one, then its draw
    assert tokens[0] == int(torch.argmax(rows[0])) and tokens[1] == 17 and tokens[4] == 3
    assert isinstance(tokens[2], RuntimeError) and "NaN" in str(tokens[2])
    assert tokens[3] == sampling.sample(rows[3], params[3], torch.Generator().manual_seed(5))


def test_stop_string_and_eos_end_generation(tiny_llama):
    llm = LLM(tiny_llama)
    p = prompt(30, 4)
    free = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    cut = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.text.startswith(cut.text)
    llm.eos_ids = {free.token_ids[3]}
    ended = llm.generate([p], SamplingParams(max_tokens=20, temperature=0))[0]
    assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[:ended.token_ids.__len__()]
    assert len(ended.token_ids) <= 4


def test_text_prompts_are_tokenized_with_bos(tiny_llama):
    llm = LLM(tiny_llama)
    out = llm.generate("The pass key is", SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("bad,message", [
    ("no_folder", "model not found"),
    ("no_config", "no config.json"),
    ("bad_arch", "unsupported architecture"),
    ("no_tokenizer", "no tokenizer files"),
    ("no_weights", "no model.safetensors"),
    ("missing_shard", "shard(s) listed in the index are missing"),
    ("missing_tensor", "weights missing from the checkpoint: model.layers.1.mlp.up_proj.weight"),
    ("wrong_shape", "model.layers.0.self_attn.k_proj.weight has shape (33, 64), config says (32, 64)"),
])
def test_broken_checkpoints_are_named(tiny_llama, tmp_path, bad, message):
    path = tmp_path / "m"
    shutil.copytree(tiny_llama, path)
    if bad == "no_folder":
        path = tmp_path / "nowhere"
    elif bad == "no_config":
        (path / "config.json").unlink()
    elif bad == "bad_arch":
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = ["GPT2LMHeadModel"]
        (path / "config.json").write_text(json.dumps(cfg))
    elif bad == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    elif bad == "no_weights":
        (path / "model.safetensors").unlink()
    elif bad == "missing_shard":
        (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    elif bad in ("missing_tensor", "wrong_shape"):  # the message names the checkpoint's tensors, not the stack's
        from safetensors.torch import load_file, save_file

        state = load_file(path / "model.safetensors")
        if bad == "missing_tensor":
            del state["model.layers.1.mlp.up_proj.weight"]
        else:
            name = "model.layers.0.self_attn.k_proj.weight"
            state[name] = torch.cat([state[name], state[name][:1]])
        save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        LLM(path)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "sharded"
    shutil.copytree(tiny_llama, path)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, path / file)
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = prompt(50, 5)
    torch.testing.assert_close(LLM(path).prompt_logits(ids), LLM(tiny_llama).prompt_logits(ids), atol=0, rtol=0)


def test_bad_sampling_settings_are_rejected():
    for kwargs in (dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1), dict(top_p=0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_fp8_kv_storage_halves_the_pool_and_stays_close(tiny_llama):
    ids = prompt(120, 6)
    exact = LLM(tiny_llama, kv_cache_tokens=512, dtype="float32")
    fp8 = LLM(tiny_llama, kv_cache_tokens=512, kv_dtype="fp8", dtype="float32")
    assert fp8.cache.k.dtype == torch.float8_e4m3fn
    assert fp8.cache.k.nbytes * 4 == exact.cache.k.nbytes  # fp32 model: 4 bytes -> 1 byte
    a, b = exact.prompt_logits(ids), fp8.prompt_logits(ids)
    # e4m3 keeps ~2 significant digits: measured max |a - b| 0.105 of max |a| 2.74 (0.038 of it); was < 0.1 of it
    assert (a - b).abs().max() < 0.06 * a.abs().max()
    # (tests/test_precision.py: exactly the fp32 engine over fp8-rounded keys and values)


@pytest.mark.parametrize("setting, attention, kv_dtype, device, offload, copy", [
    ("auto", "tokenselect", torch.bfloat16, "cuda", "none", True),  # the default where it was measured
    ("auto", "tokenselect", torch.float16, "cuda", "none", True),
    ("auto", "reattention", torch.bfloat16, "cuda", "none", False),  # not measured on the real models
    ("auto", "full", torch.bfloat16, "cuda", "none", False),
    ("auto", "tokenselect", torch.bfloat16, "cpu", "none", False),
    ("auto", "tokenselect", torch.float32, "cuda", "none", False),
    ("auto", "tokenselect", torch.float8_e4m3fn, "cuda", "none", False),  # an fp8 pool is its own copy
    ("auto", "tokenselect", torch.bfloat16, "cuda", "values", False),  # offload saves memory the copy would spend
    ("auto", "tokenselekt", torch.bfloat16, "cuda", "none", False),  # make_policy refuses the name afterwards
    ("kv", "tokenselect", torch.bfloat16, "cuda", "none", False),
    ("fp8", "full", torch.float32, "cpu", "values", True),  # asked for: always
])
def test_auto_selection_keys_are_fp8_only_where_measured(setting, attention, kv_dtype, device, offload, copy):
    from tokenselect.engine import selection_keys_dtype

    got = selection_keys_dtype(setting, attention, kv_dtype, torch.device(device), offload)
    assert got == (torch.float8_e4m3fn if copy else kv_dtype)


def test_the_summary_names_the_pool_as_it_was_built(tiny_llama):
    """What a server prints at its start: the pool's tokens, how they are stored and their bytes, K's, V's and the
    selection keys' copy's (the tiny model stores 2 layers x 2 KV heads x 16 = 64 elements a token a pool)."""
    llm = LLM(tiny_llama, "tokenselect", kv_cache_tokens=1000, select_dtype="fp8", dtype="float32")
    cfg = llm.config
    assert cfg.n_layers * cfg.n_kv_heads * cfg.head_dim == 64
    assert llm.summary() == (f"{tiny_llama} (window 256 tokens), attention tokenselect, KV pool of 1,000 tokens "
                             f"(fp32, fp8 selection keys; 0.00 GB)")  # 1,000 x 64 x (4 + 4 + 1) bytes
    big = LLM(tiny_llama, "full", kv_cache_tokens=200_000, dtype="float32", kv_offload="values")
    assert big.summary().endswith("KV pool of 200,000 tokens (fp32, V on host; 0.10 GB)")  # 200K x 64 x 8 bytes


def test_fp8_selection_keys_are_a_copy_written_beside_the_keys(tiny_llama, monkeypatch):
    """select_dtype="fp8": every key is written to an e4m3 copy as well (one byte an element, counted when the
    pool is sized); attention reads the model-dtype pool, so with the budget covering the context the logits
    are full attention's exactly. An fp8 pool is its own copy."""
    from tokenselect import engine

    ids = prompt(200, 8)
    llm = LLM(tiny_llama, "tokenselect", kv_cache_tokens=512, select_dtype="fp8", chunk_size=32, k=4096, n_init=4,
              n_local=32, dtype="float32")
    cache = llm.cache
    assert cache.k.dtype == torch.float32 and cache.k_select.dtype == torch.float8_e4m3fn
    assert cache.k_select.nbytes * 4 == cache.k.nbytes and len(cache.pools) == 3
    logits = llm.prompt_logits(ids)
    full = LLM(tiny_llama, kv_cache_tokens=512, chunk_size=32, dtype="float32")
    torch.testing.assert_close(logits, full.prompt_logits(ids), atol=0, rtol=0)
    written = slice(0, len(ids))  # a fresh pool hands out slots 0, 1, ... first
    assert cache.k[:, written].abs().sum() > 0
    assert torch.equal(cache.k_select[:, written].view(torch.uint8),
                       cache.k[:, written].to(torch.float8_e4m3fn).view(torch.uint8))
    fp8_pool = LLM(tiny_llama, kv_cache_tokens=64, kv_dtype="fp8", select_dtype="fp8")
    assert fp8_pool.cache.k_select is fp8_pool.cache.k and len(fp8_pool.cache.pools) == 2
    monkeypatch.setattr(engine, "CPU_POOL_BYTES", 1 << 20)  # a pool sized by memory: K + V + the copy per token
    cfg = llm.config
    per_pool = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    sized = [LLM(tiny_llama, dtype="float32", device="cpu", **extra).cache.n_slots
             for extra in ({"select_dtype": "fp8"}, {})]
    assert sized == [(1 << 20) // (2 * per_pool + per_pool // 4), (1 << 20) // (2 * per_pool)]
    with pytest.raises(ValueError, match="select_dtype"):
        LLM(tiny_llama, select_dtype="int4")


def test_set_attention_switches_policy_on_a_loaded_model(tiny_llama):
    llm = LLM(tiny_llama, chunk_size=32)
    ids = prompt(400, 7)
    full = llm.generate([ids], GREEDY)[0].token_ids
    llm.set_attention("tokenselect", k=16, n_init=2, n_local=8)
    assert llm.policy.name == "tokenselect"
    sparse = llm.generate([ids], GREEDY)[0].token_ids
    llm.set_attention("full")
    assert llm.generate([ids], GREEDY)[0].token_ids == full
    assert len(sparse) == len(full)
    # the tokens, against an engine started with those settings (ignore_eos makes the lengths equal anyway) and the
    # same selection keys: an engine keeps those of the policy it started with (full: the pool's, where
    # TokenSelect's own on a GPU would be an fp8 copy, ``selection_keys_dtype``)
    assert sparse == LLM(tiny_llama, "tokenselect", chunk_size=32, k=16, n_init=2, n_local=8,
                         select_dtype="kv").generate([ids], GREEDY)[0].token_ids
    assert sparse != full  # 26 attended of 400: the selection shows in the tokens


def test_random_engine_runs_on_token_ids():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "max_position_embeddings": 128}
    llm = LLM.random(config, "tokenselect", k=8, n_init=2, n_local=4, chunk_size=16, kv_cache_tokens=256)
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", GREEDY)


def test_a_request_with_its_own_policy_settings_runs_as_an_engine_started_with_them(tiny_llama,
                                                                                    batch_invariant_matmuls):
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, dense_until=0)  # select inside the tiny model's window
    long = prompt(200, 7)
    own = llm.add_request(long, GREEDY, {"k": 8, "n_local": 4, "theta": 0.5})
    shared = llm.add_request(long, GREEDY)
    while llm.scheduler.has_work():
        llm.step()
    assert own.policy is not shared.policy is llm.policy
    assert own.output_ids == LLM(tiny_llama, "tokenselect", chunk_size=32, k=8, n_local=4, theta=0.5,
                                 dense_until=0).generate(
        [long], GREEDY)[0].token_ids
    assert shared.output_ids == LLM(tiny_llama, "tokenselect", chunk_size=32, dense_until=0).generate(
        [long], GREEDY)[0].token_ids
    assert own.output_ids != shared.output_ids
    stats = llm.stats()  # counters of both instances
    assert stats["selection_cache_hits"] + stats["selection_cache_misses"] == 2 * 2 * (GREEDY.max_tokens - 1)
    with pytest.raises(ValueError, match="takes no setting span"):
        llm.add_request(long, GREEDY, {"span": 3})
