"""The OpenAI-compatible server, started for real on 127.0.0.1 and spoken to over HTTP."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from tokenselect.engine import LLM
from tokenselect.errors import TokenSelectError
from tokenselect.sampling import SamplingParams
from tokenselect.cli import build_parser, cmd_serve
from tokenselect.server import create_app, uvicorn_config, warm_up_prompt
from tokenselect.server_options import ServerOptions

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SETTINGS = dict(attention="tokenselect", kv_cache_tokens=4096, chunk_size=32)
NAME = "tiny"
PROMPTS = [f"The quick brown fox {i} jumps over the lazy dog. " * (1 + i % 3) for i in range(32)]


def with_chat_template(source, path, template: str):
    """A copy of the checkpoint folder ``source`` at ``path`` whose tokenizer config holds ``template``."""
    shutil.copytree(source, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory):
    """The tiny checkpoint, copied, with a chat template in its tokenizer config."""
    return with_chat_template(tiny_llama, tmp_path_factory.mktemp("chat") / "model", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """A second engine on the same checkpoint: what ``LLM.generate`` gives, run in the test."""
    return LLM(checkpoint, **SETTINGS)


def start_server(app):
    """A real uvicorn server for ``app`` on a free port of 127.0.0.1, started in a thread -> (server, thread,
    base URL); the caller stops it (``server.should_exit``)."""
    server = uvicorn.Server(uvicorn_config(app, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@contextmanager
def running_server(llm, options=None):
    """(base URL, app) of a real uvicorn server for ``llm`` (with ``ServerOptions``) on a free port, in a thread."""
    app = create_app(llm, NAME, options)
    server, thread, url = start_server(app)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(checkpoint):
    """(base URL, the served LLM, the app)."""
    llm = LLM(checkpoint, **SETTINGS)
    with running_server(llm) as (url, app):
        yield url, llm, app


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served[0], timeout=60) as c:
        yield c


def expected(reference, prompt, **params) -> str:
    return reference.generate([prompt], SamplingParams(**params))[0].text


def stream_text(client, path: str, body: dict) -> tuple[str, list[dict]]:
    """POST with stream: true; returns the concatenated text and the parsed chunks."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") if "delta" in c["choices"][0] else c["choices"][0]["text"]
              for c in chunks]
    return "".join(pieces), chunks


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=7)])
def test_completion_equals_generate(client, reference, params):
    prompt = PROMPTS[1]
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 20, **params})
    assert r.status_code == 200
    body = r.json()
    out = reference.generate([prompt], SamplingParams(max_tokens=20, **params))[0]
    assert body["choices"][0]["text"] == out.text
    assert body["choices"][0]["finish_reason"] == out.finish_reason
    # asked again (the other parametrization, or another test): its prompt up to a chunk boundary (32) is reused
    reusable = (len(out.prompt_token_ids) - 1) // SETTINGS["chunk_size"] * SETTINGS["chunk_size"]
    assert body["usage"].pop("prompt_tokens_details")["cached_tokens"] in (0, reusable)
    assert body["usage"] == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                             "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}


def test_stream_concatenates_to_the_full_text(client, reference):
    prompt = PROMPTS[2]
    full = expected(reference, prompt, max_tokens=30, temperature=0)
    streamed, chunks = stream_text(client, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})
    assert streamed == full and len(chunks) > 1
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and "usage" in chunks[-1]
    # a stop string in the middle of the text: nothing past it is ever streamed
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = expected(reference, prompt, max_tokens=30, temperature=0, stop=[stop])
    streamed, _ = stream_text(client, "/v1/completions",
                              {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": stop})
    assert streamed == cut == full[:full.index(stop)]


def test_32_concurrent_requests_match_sequential_runs(served, reference, batch_invariant_matmuls):
    """Concurrent requests are batched together; each still gets its own TokenSelect selection."""
    url = served[0]
    want = [expected(reference, p, max_tokens=16, temperature=0) for p in PROMPTS]

    def ask(prompt: str) -> str:
        with httpx.Client(base_url=url, timeout=90) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, PROMPTS))
    print(f"32 concurrent completions in {time.perf_counter() - start:.2f}s")
    assert got == want


LONG = "The quick brown fox jumps over the lazy dog. " * 1000  # well past the 4096-token pool
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["end", ""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "policy": {"k": -3}}, 400, "policy.k"),
    ("/v1/completions", {"prompt": "hi", "policy": {"theta": 2.5}}, 400, "policy.theta"),
    ("/v1/completions", {"prompt": "hi", "policy": {"span": 3}}, 400, "policy.span"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_an_error_and_the_server_keeps_serving(client, path, body, status, param):
    r = (client.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
         else client.post(path, json=body))
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_per_request_policy_settings_equal_an_engine_started_with_them(client, checkpoint, reference):
    """``policy`` (extra_body) gives one request its own k / n_local / theta; the others keep the server's."""
    prompt, settings = PROMPTS[2] * 3, {"k": 8, "n_local": 4, "theta": 0.5}  # selection starts past 84 tokens
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    own = LLM(checkpoint, **{**SETTINGS, **settings}).generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                                                          ignore_eos=True))[0]
    r = client.post("/v1/completions", json={**body, "policy": settings})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == own.text
    default = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert default == expected(reference, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert default != own.text  # the setting changed what was attended


def wait_for_free_pool(llm, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while llm.scheduler.available != llm.cache.n_slots:
        assert time.monotonic() < deadline, "the KV slots of a departed client were not freed"
        time.sleep(0.05)


# Minutes of decoding on a CPU: a client that leaves does so long before the request would end.
LONG_RUN = {"prompt": PROMPTS[3], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def test_disconnecting_stream_frees_its_slots(served, client):
    llm, worker = served[1], served[2].state.worker
    with client.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the stream there and then
        assert next(lines).startswith("data: ")
        assert llm.cache.num_free < llm.cache.n_slots
        (job,) = worker.jobs.values()  # read-only peek at the engine thread's live table
    wait_for_free_pool(llm)
    assert job.seq.finish_reason == "abort" and len(job.seq.output_ids) < 2000
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_client_that_times_out_frees_its_slots(served, client):
    llm, worker = served[1], served[2].state.worker
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=LONG_RUN, timeout=httpx.Timeout(60, read=0.3))
    wait_for_free_pool(llm)
    assert not worker.jobs
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_full_pool_queues_newcomers(checkpoint):
    """A 256-slot pool holds one of these requests at a time: the others wait their turn, and
    every output equals a run alone. (Full attention here: TokenSelect's selection is not yet
    batch-invariant past the window, see docs/server.md.)"""
    llm = LLM(checkpoint, attention="full", kv_cache_tokens=256, chunk_size=32)
    params = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}
    prompts = PROMPTS[5:8]
    want = [expected(llm, p, **params) for p in prompts]
    with running_server(llm, ServerOptions(max_model_len=256)) as (url, _):  # one request may take the pool
        def ask(prompt: str) -> str:
            with httpx.Client(base_url=url, timeout=90) as c:
                return c.post("/v1/completions", json={"prompt": prompt, **params}).json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, prompts)) == want
        assert llm.scheduler.available == llm.cache.n_slots


def test_models_and_health(client, served):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["kv_slots"] == served[1].cache.n_slots


def test_chat_uses_the_template_and_streams(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the pass key?"}]
    prompt = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>")
    # the template writes its own special tokens: the tokenizer adds no BOS of its own to it
    ids = reference.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids == reference.chat_prompt(messages) and ids[0] != reference.tokenizer.bos_token_id
    want = expected(reference, ids, max_tokens=12, temperature=0)
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 12,
                                                   "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}
    streamed, chunks = stream_text(client, "/v1/chat/completions",
                                   {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert streamed == want and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_openai_client(served, reference):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
    want = expected(reference, PROMPTS[4], max_tokens=10, temperature=0)
    out = api.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=10, temperature=0)
    assert out.choices[0].text == want and out.usage.completion_tokens >= 1
    stream = api.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want
    chat = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, seed=3)
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=NAME, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_serve_command_line(checkpoint):
    args = build_parser().parse_args(["serve", "--model", str(checkpoint), "--port", "8123", "--served-model-name", "x",
                              "--k", "64", "--kv-cache-tokens", "2048"])
    assert args.func is cmd_serve and args.attention == "tokenselect" and args.host == "127.0.0.1"
    assert (args.port, args.served_model_name, args.k, args.kv_cache_tokens) == (8123, "x", 64, 2048)
    assert ServerOptions.from_args(args) == ServerOptions()  # loopback: the loopback names only
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k", "--enable-docs",
                                      "--max-model-len", "512", "--max-queued-requests", "5", "--shutdown-timeout", "2.5",
                                      "--warm-up-tokens", "300"])
    assert ServerOptions.from_args(args) == ServerOptions(api_key="k", allowed_hosts=("*",), enable_docs=True,
                                                          max_model_len=512, max_queued_requests=5, shutdown_timeout=2.5,
                                                          warm_up_tokens=300)
    args = build_parser().parse_args(["serve", "--allowed-hosts", "a.example", "*.b.example"])
    assert ServerOptions.from_args(args).allowed_hosts == ("a.example", "*.b.example")


def test_warm_up_runs_before_the_server_listens(checkpoint, reference, capsys):
    """--warm-up-tokens: the engine serves the warm-up (a prompt past TokenSelect's selection threshold, then two
    ending inside a chunk) before uvicorn listens; it leaves every KV slot free and no prompt in the prefix cache,
    and the requests after it get what ``LLM.generate`` gives. A warm-up the engine cannot serve is refused."""
    llm = LLM(checkpoint, **SETTINGS)
    assert llm.runner.passes == 0
    with running_server(llm, ServerOptions(warm_up_tokens=300)) as (url, _):
        passes = llm.runner.passes
        assert passes >= 300 // SETTINGS["chunk_size"] + 16  # the prompts' chunks and the decode steps, all run
        health = httpx.get(f"{url}/health").json()
        assert health["kv_slots_free"] == health["kv_slots"] and health.get("prefix_cache_tokens", 0) == 0, health
        assert health["selection_cache_hits"] + health["selection_cache_misses"] > 0, health  # it selected
        body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert got == expected(reference, PROMPTS[1], max_tokens=8, temperature=0)
    said = capsys.readouterr().err  # what the user sees while waiting, and after
    assert "warming up on a 300-token prompt" in said and "--warm-up-tokens 0" in said and "warmed up in" in said
    for bad in (-1, llm.max_model_len - 16):
        with pytest.raises(TokenSelectError, match="--warm-up-tokens"):
            create_app(llm, NAME, ServerOptions(warm_up_tokens=bad))


def test_the_default_warm_up_passes_the_selection_threshold_on_a_gpu_only(checkpoint):
    """Unset, --warm-up-tokens is ``LLM.default_warm_up_tokens`` on a GPU: two prefill chunks past the policy's
    selection threshold (two chunks for full attention), capped to what a request may hold; on a CPU none."""
    llm = LLM(checkpoint, **SETTINGS)
    threshold = llm.policy.selection_threshold
    assert threshold == llm.window == 256  # dense_until: the window, past TokenSelect's list of the tiny model
    assert llm.default_warm_up_tokens() == threshold + 2 * 32
    prompt = warm_up_prompt(llm, None)
    assert len(prompt) == (threshold + 64 if llm.device.type == "cuda" else 0)
    assert len(warm_up_prompt(llm, 0)) == 0 and len(warm_up_prompt(llm, 100)) == 100
    small = LLM(checkpoint, "tokenselect", kv_cache_tokens=300, chunk_size=32)
    assert small.default_warm_up_tokens() == small.max_model_len - 17  # the warm-up's 16 decode steps + 1 fit
    warm_up_prompt(small, small.default_warm_up_tokens())  # a request the engine takes
    full = LLM(checkpoint, "full", kv_cache_tokens=4096, chunk_size=32)
    assert full.default_warm_up_tokens() == 64
    from tokenselect.bench.e2e import CONFIGS  # an 8K window at the engine's defaults: the figure --help gives
    eight_k = LLM.random({**CONFIGS["tiny"], "max_position_embeddings": 8192}, "tokenselect", kv_cache_tokens=20000)
    assert (eight_k.chunk_size, eight_k.default_warm_up_tokens()) == (2048, 12288)
