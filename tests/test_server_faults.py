"""Hostile and careless clients (issue #31): each defect an outside tester found, reproduced against a
real server on 127.0.0.1, and what it does now. Every loop here is bounded; every request has a timeout."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from checkpoints import VOCAB
from test_server import (NAME, PROMPTS, SETTINGS, checkpoint, expected, running_server,  # noqa: F401
                         start_server, wait_for_free_pool, with_chat_template)
from tokenselect.engine import LLM, MAX_IDLE_POLICIES
from tokenselect.sampling import SamplingParams
from tokenselect.sequence import Sequence
from tokenselect.server import INTERNAL_ERROR, create_app
from tokenselect.server_options import ServerOptions

# Mistral's template: roles must alternate, or it raises (jinja2's TemplateError)
STRICT_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                   "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
OK = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
# Minutes of decoding on a CPU: anything that must happen while it runs happens long before it would end.
LONG_RUN = {"prompt": PROMPTS[3], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def strict_checkpoint(checkpoint, tmp_path_factory):
    return with_chat_template(checkpoint, tmp_path_factory.mktemp("strict") / "model", STRICT_TEMPLATE)


@pytest.fixture(scope="module")
def served(strict_checkpoint):
    """(base URL, LLM, app) of a TokenSelect server with default options and the strict chat template."""
    llm = LLM(strict_checkpoint, **SETTINGS)
    with running_server(llm) as (url, app):
        yield url, llm, app


@pytest.fixture(scope="module")
def reference(strict_checkpoint):
    return LLM(strict_checkpoint, **SETTINGS)


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served[0], timeout=30) as c:
        yield c


def post_raw(client, path: str, text: str, **kwargs) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"}, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    return error


def assert_serving(client, reference) -> None:
    """A plain request gets the text ``LLM.generate`` gives, and /health says ok."""
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=20)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(reference, PROMPTS[0], max_tokens=8,
                                                                                temperature=0)
    health = client.get("/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok"


class Stream:
    """A streamed request read on a thread: its text pieces and when each came."""

    def __init__(self, url: str, body: dict, path: str = "/v1/completions"):
        self.times, self.lines, self.error = [], [], None
        self.thread = threading.Thread(target=self._read, args=(url, path, body), daemon=True)
        self.thread.start()

    def _read(self, url, path, body):
        try:
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.times.append(time.monotonic())
        except httpx.HTTPError as e:  # e.g. the server closed it
            self.error = e

    def text(self) -> str:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in self.lines[:-1])

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


# ---- 1: one request killed the engine thread for good -------------------------------------------


def test_lone_surrogate_and_a_refusing_chat_template_get_400_and_the_engine_lives(client, reference):
    """``"abc\\ud800def"`` made the tokenizer raise a TypeError on the engine thread, and a template that raises
    (two user turns in a row) a TemplateError there: the thread died, later requests hung, /health said ok."""
    assert_error(post_raw(client, "/v1/completions", '{"prompt": "abc\\ud800def", "max_tokens": 2}'), 400, "prompt")
    assert_serving(client, reference)
    body = '{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'
    assert_error(post_raw(client, "/v1/chat/completions", body), 400, "messages.0.content")
    twice = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    error = assert_error(client.post("/v1/chat/completions", json={"messages": twice, "max_tokens": 2}), 400,
                         "messages", "chat_template_error")
    assert "alternate" in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": twice[:1], "max_tokens": 2}).status_code == 200
    assert_serving(client, reference)


def test_health_is_503_with_the_reason_when_the_engine_is_not_running(strict_checkpoint):
    llm = LLM(strict_checkpoint, **SETTINGS)
    with running_server(llm) as (url, app), httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        app.state.worker.stop(timeout=10)  # the engine thread ends; the HTTP server goes on
        health = c.get("/health")
        assert health.status_code == 503 and "shutting down" in health.json()["reason"]
        assert_error(c.post("/v1/completions", json=OK), 503, code="engine_unavailable")  # at once, not a hang


# ---- 2: a token id outside the vocabulary failed the whole step and leaked its slots -------------


def test_token_ids_outside_the_vocabulary_get_400_and_leak_nothing(served, client, reference):
    """``[8192]`` / ``[-1]`` failed the engine step: every request in it got a 500 and its KV slots were never
    returned (513 such requests exhausted a 131,072-slot pool). Now: a 400 each, beside an untouched stream."""
    llm = served[1]
    stream = Stream(served[0], {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    bad = [[8192], [-1], [VOCAB], [1, 2, 10**30], [5, -7, 9]]

    def ask(i: int) -> int:
        with httpx.Client(base_url=served[0], timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": bad[i % len(bad)], "max_tokens": 4})
            assert_error(r, 400, "prompt")
            return r.status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(ask, range(600))) == {400}
    assert stream.text() == expected(reference, PROMPTS[1], max_tokens=40, temperature=0, ignore_eos=True)
    wait_for_free_pool(llm)
    assert_serving(client, reference)


def test_a_sequence_whose_step_fails_ends_alone_and_returns_its_slots(strict_checkpoint):
    """The engine itself: a token id the model cannot embed (added past the checks) fails its batch's pass;
    the engine runs the batch's sequences one at a time, ends that one with finish_reason "error", and the
    other one's output equals a run alone. Every slot comes back."""
    llm = LLM(strict_checkpoint, attention="full", kv_cache_tokens=512, chunk_size=32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = llm.generate([PROMPTS[2]], params)[0].text
    good = llm.add_request(PROMPTS[2], params)
    bad = Sequence(10**6, [1, 2, VOCAB + 5], params, llm.device, llm.policy, llm.tokenizer)
    llm.scheduler.add(bad)
    for _ in range(100):
        if good.finished and bad.finished:
            break
        llm.step()
    assert bad.finish_reason == "error" and isinstance(bad.error, IndexError)
    assert good.finish_reason == "length" and good.text == want
    assert llm.scheduler.available == llm.cache.n_slots and not llm.scheduler.running
    with pytest.raises(ValueError, match="outside the vocabulary"):  # checked before it is queued
        llm.generate([[1, 2, VOCAB + 5]], params)
    llm.config = dataclasses.replace(llm.config, vocab_size=VOCAB + 100)  # a config that overstates the embedding
    with pytest.raises(RuntimeError) as failed:  # the batch API raises rather than return a silent "error"
        llm.generate([PROMPTS[2], [1, 2, VOCAB + 5]], params)
    assert isinstance(failed.value.__cause__, IndexError)
    assert llm.scheduler.available == llm.cache.n_slots


def test_an_engine_failure_is_a_generic_500_for_its_request_only(strict_checkpoint, reference):
    """A checkpoint whose config names more tokens than its embedding holds: an id past the embedding passes
    the checks and fails its step. Only that request gets a 500, whose text names no internals; a stream running
    beside it finishes with the right text and every slot comes back."""
    llm = LLM(strict_checkpoint, **SETTINGS)
    llm.config = dataclasses.replace(llm.config, vocab_size=VOCAB + 100)
    with running_server(llm) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        stream = Stream(url, {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        for _ in range(3):
            error = assert_error(c.post("/v1/completions", json={"prompt": [3, VOCAB + 50], "max_tokens": 4}), 500)
            assert error["message"] == INTERNAL_ERROR and "index" not in error["message"]
        assert stream.text() == expected(reference, PROMPTS[1], max_tokens=40, temperature=0, ignore_eos=True)
        wait_for_free_pool(llm)
        assert c.post("/v1/completions", json=OK).status_code == 200


# ---- 3: per-request policy settings were unbounded ----------------------------------------------


def test_per_request_policy_settings_are_bounded(strict_checkpoint):
    """With InfLLM, each distinct ``k`` kept a policy instance for good (k ~ 2e6: 367 MB each), and k = 1e12 gave
    a 500 that also killed an innocent stream. Now sizes above the reservation cap get a 400 and at most
    ``MAX_IDLE_POLICIES`` instances that no live request uses are kept."""
    llm = LLM(strict_checkpoint, attention="infllm", kv_cache_tokens=4096, chunk_size=32)
    with running_server(llm) as (url, app), httpx.Client(base_url=url, timeout=30) as c:
        cap = app.state.options.max_model_len
        stream = Stream(url, {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True})
        for k in (10**12, 2 * 10**6, cap + 1):
            assert_error(c.post("/v1/completions", json={**OK, "policy": {"k": k}}), 400, "policy.k")
        assert_error(c.post("/v1/completions", json={**OK, "policy": {"n_local": 10**9}}), 400, "policy.n_local")
        stream.text()  # it ran to its end
        for k in range(8, 8 + 12 * 4, 4):
            assert c.post("/v1/completions", json={**OK, "policy": {"k": k}}).status_code == 200
        assert len(llm._policies) <= 1 + MAX_IDLE_POLICIES  # read-only peek: () + the idle ones kept
        wait_for_free_pool(llm)


# ---- 4: no size limits ---------------------------------------------------------------------------


def test_size_limits_answer_at_once_and_never_stall_a_stream(served, client, reference):
    """A 20 MB body was tokenized on the engine thread before the length check (every stream stalled 28 s), and
    5,000 stop strings of 1,000 characters blocked the event loop for 9.7 s."""
    options = served[2].state.options
    stream = Stream(served[0], {"prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0, "ignore_eos": True})
    time.sleep(0.3)
    start = time.monotonic()
    huge = json.dumps({"prompt": "word " * (4 << 20), "max_tokens": 4})  # 20 MiB
    assert_error(post_raw(client, "/v1/completions", huge), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it comes
        for _ in range(40):
            yield b" " * (1 << 20)

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    over = "x" * (options.max_prompt_chars + 1)  # under the body limit, over the prompt's
    assert_error(client.post("/v1/completions", json={"prompt": over, "max_tokens": 2}), 400, "prompt",
                 "context_length_exceeded")
    many = ["s" * 1000] * 5000
    assert_error(client.post("/v1/completions", json={**OK, "stop": many}), 400, "stop")
    assert_error(client.post("/v1/completions", json={**OK, "stop": ["s"] * (options.max_stop_strings + 1)}),
                 400, "stop")
    assert_error(client.post("/v1/completions", json={**OK, "stop": "s" * (options.max_stop_chars + 1)}), 400, "stop")
    assert time.monotonic() - start < 10
    assert stream.text() == expected(reference, PROMPTS[1], max_tokens=60, temperature=0, ignore_eos=True)
    assert stream.longest_gap() < 2.0
    assert_serving(client, reference)


# ---- 5: no API key, no Host check, /docs public --------------------------------------------------


def test_api_key_host_check_and_docs(strict_checkpoint, served, client):
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    rebound = client.post("/v1/completions", json=OK, headers={"host": "attacker.example:8000"})
    assert_error(rebound, 400, code="invalid_host")
    assert client.post("/v1/completions", json=OK, headers={"host": "localhost:1234"}).status_code == 200
    llm = LLM(strict_checkpoint, **SETTINGS)
    options = ServerOptions(api_key="s3cret", enable_docs=True, allowed_hosts=("*.example.com", "127.0.0.1"))
    with running_server(llm, options) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        assert_error(c.post("/v1/completions", json=OK), 401, code="invalid_api_key")
        assert_error(c.post("/v1/completions", json=OK, headers={"authorization": "Bearer s3cre"}), 401,
                     code="invalid_api_key")
        assert c.get("/docs").status_code == 401 and c.get("/health").status_code == 200
        key = {"authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=OK, headers=key).status_code == 200
        assert c.get("/docs", headers=key).status_code == 200
        assert c.get("/v1/models", headers={**key, "host": "api.example.com"}).status_code == 200
        assert c.get("/v1/models", headers={**key, "host": "localhost"}).status_code == 400
        openai = pytest.importorskip("openai")
        api = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert api.completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---- 6: fairness ---------------------------------------------------------------------------------


def test_one_request_cannot_reserve_the_whole_pool(served, client, reference):
    """``max_tokens`` = the pool size was admitted and held every slot while it ran, so a 4-token request
    waited for minutes. Now a request may reserve half the pool by default (``--max-model-len``)."""
    n_slots = served[1].cache.n_slots
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": n_slots - 8, "ignore_eos": True}, timeout=10)
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == n_slots // 2
    start = time.monotonic()
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10).status_code == 200
    assert time.monotonic() - start < 5


@pytest.fixture(scope="module")
def small_pool(strict_checkpoint):
    """A 1024-slot pool that one request may fill, and room for 3 waiting requests."""
    llm = LLM(strict_checkpoint, attention="full", kv_cache_tokens=1024, chunk_size=32)
    with running_server(llm, ServerOptions(max_model_len=1024, max_queued_requests=3, retry_after=2)) as (url, app):
        yield url, llm, app


def test_queued_requests_whose_clients_left_are_dropped_before_prefill(small_pool):
    """Requests whose clients left while they were still queued were prefilled anyway (a 4-token request waited
    16.8 s behind six of them). Now they leave the queue as soon as their client goes."""
    url, llm, _ = small_pool
    blocker = {"prompt": "hi", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/v1/completions", json=blocker) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the stream
        assert next(lines).startswith("data: ")  # it runs, holding the whole pool

        def leave(i: int) -> None:
            with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url) as c2:
                c2.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 100},
                        timeout=httpx.Timeout(10, read=0.5))

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(leave, range(3)))
        deadline = time.monotonic() + 5
        while llm.scheduler.waiting:  # read-only peek
            assert time.monotonic() < deadline, "queued requests of departed clients stayed in the queue"
            time.sleep(0.05)
        assert len(llm.scheduler.running) == 1
    wait_for_free_pool(llm)


def test_a_full_queue_answers_429_with_retry_after(small_pool):
    url, llm, _ = small_pool
    blocker = {"prompt": "hi", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    queued = {"prompt": "hi", "max_tokens": 100, "temperature": 0}
    with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/v1/completions", json=blocker) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        pool = ThreadPoolExecutor(3)
        waiting = [pool.submit(httpx.post, url + "/v1/completions", json=queued, timeout=60) for _ in range(3)]
        deadline = time.monotonic() + 10
        while c.get("/health").json()["waiting"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        full = c.post("/v1/completions", json=queued)
        assert_error(full, 429, code="queue_full")
        assert full.headers["retry-after"] == "2"
        health = c.get("/health")
        assert health.status_code == 503 and "queue" in health.json()["reason"]
    # the blocker's stream closed: its slots free up and the three queued requests run
    assert [f.result().status_code for f in waiting] == [200] * 3
    pool.shutdown()
    wait_for_free_pool(llm)
    assert httpx.get(url + "/health").status_code == 200


# ---- 7: shutdown, 500 text, parameter checks ------------------------------------------------------


def test_shutdown_waits_at_most_its_timeout_then_aborts(strict_checkpoint):
    """Shutdown waited for every running request however long: a stream of minutes held SIGTERM for minutes."""
    llm = LLM(strict_checkpoint, **SETTINGS)
    app = create_app(llm, NAME, ServerOptions(shutdown_timeout=1))
    server, thread, url = start_server(app)
    deadline = time.monotonic() + 30
    stream = Stream(url, LONG_RUN)
    while not stream.lines:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.monotonic()
    server.should_exit = True
    thread.join(timeout=15)
    assert not thread.is_alive(), "shutdown did not finish"
    print(f"shutdown with a running stream took {time.monotonic() - start:.1f} s")
    stream.thread.join(timeout=10)
    assert not stream.thread.is_alive() and isinstance(stream.error, httpx.RemoteProtocolError)
    assert len(stream.lines) < 2000
    assert llm.scheduler.available == llm.cache.n_slots and not app.state.worker.thread.is_alive()


PARAMS = [
    ('{"prompt": "hi", "seed": 18446744073709551616}', "seed"),  # 2**64 was reported as param: prompt
    ('{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "temperature": 2.5}', "temperature"),
    ('{"prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"prompt": "hi", "logprobs": 6}', "logprobs"),  # OpenAI's limit is 5
    ('{"prompt": "hi", "logprobs": true}', "logprobs"),
    ('{"prompt": "hi", "echo": true}', "echo"),  # these were silently ignored
    ('{"prompt": "hi", "best_of": 3}', "best_of"),
    ('{"prompt": "hi", "logit_bias": {"5": 100}}', "logit_bias"),
    ('{"prompt": "hi", "presence_penalty": 1.5}', "presence_penalty"),
    ('{"prompt": "hi", "policy": {"theta": NaN}}', "policy.theta"),
]


@pytest.mark.parametrize("body,param", PARAMS)
def test_out_of_range_and_unsupported_parameters_get_400(client, body, param):
    assert_error(post_raw(client, "/v1/completions", body), 400, param)


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    messages = [{"role": "user", "content": "hi"}]
    assert_error(client.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 3}), 400,
                 "top_logprobs")  # without logprobs: true
    assert_error(client.post("/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 21}),
                 400, "top_logprobs")
    neutral = {"logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
               "logit_bias": {}, "user": "me", "seed": 2**64 - 1, "temperature": 1e-300}
    assert client.post("/v1/completions", json={**OK, **neutral}).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "logprobs": False,
                                                      "seed": -(2**63)}).status_code == 200


def test_logprobs_are_the_models_and_stream_as_they_come(client, reference):
    """``logprobs`` was silently ignored: now each generated token's log-probability and its likeliest
    alternatives', from the model's distribution (the first token's equals the prompt's last logits')."""
    prompt = PROMPTS[2]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    out = client.post("/v1/completions", json=body).json()
    lp, n = out["choices"][0]["logprobs"], out["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the likeliest (a dict: alternatives that decode alike, such as partial characters, merge)
        assert chosen <= 0 and 1 <= len(top) <= 3 and chosen >= max(top.values()) - 1e-5
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    first = torch.log_softmax(reference.prompt_logits(prompt)[-1], dim=-1)
    assert lp["token_logprobs"][0] == pytest.approx(float(first.max()), abs=1e-4)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["token_logprobs"] for s in streamed), []) == pytest.approx(lp["token_logprobs"], abs=1e-5)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 4
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"])
               and t["bytes"] == list(t["token"].encode()) for t in content)
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == out["choices"][0]["text"]
