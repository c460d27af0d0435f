"""The server's request checks one by one, without a model or a socket: the Host / API key / body size guard
called as the ASGI app it is, and the field, stop-string, prompt and per-request policy checks on request
objects. Each limit is tried at its value (accepted) and one past it (refused), with the error OpenAI's clients
read (status, param, code). The served-model tests (test_server*.py) check the same refusals end to end."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenselect import server
from tokenselect.errors import TokenSelectError
from tokenselect.server import (APIError, ChatRequest, CompletionRequest, Guard, Message, check_fields,
                                check_policy_settings, check_text, prompt_ids, resolve_options)
from tokenselect.server_options import ServerOptions


def guarded(options: ServerOptions, headers: dict, chunks=(b"{}",), method: str = "POST", path: str = "/v1/completions",
            length: bool = True, messages: list | None = None, response_headers: list | None = None):
    """(status, error object or None, the body the app behind the guard read) of one request through ``Guard``.
    A header given as None is left out; ``messages``: the ASGI messages the client sends, instead of ``chunks``';
    ``response_headers``: a list that gets the response's headers."""
    read = []

    async def app(scope, receive, send):
        message = await receive()
        read.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    if messages is None:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    headers = {"host": "127.0.0.1:8000", **headers}
    if length and method == "POST" and "content-length" not in headers:
        headers["content-length"] = str(sum(map(len, chunks)))
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if v is not None]}
    asyncio.run(Guard(app, options)(scope, receive, send))
    if not sent:
        return None, None, read[0] if read else None
    status = sent[0]["status"]
    if response_headers is not None:
        response_headers.extend(sent[0]["headers"])
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(body)["error"] if status != 200 else None), (read[0] if read else None)


def test_the_guard_checks_the_host_header():
    default = ServerOptions()
    for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:80", "[::1]:8000", "[::1]"):
        assert guarded(default, {"host": host})[0] == 200, host
    for host in ("attacker.example:8000", "localhost.attacker.example", "", "[::2]:8000", "127.0.0.2", "[::1]evil",
                 "[::1]]:8000", "[::1", "localhost:1:8000", "127.0.0.1:evil:8000"):  # only the last ':port' goes
        status, error, read = guarded(default, {"host": host})
        assert (status, error["code"], read) == (400, "invalid_host", None), host
        assert error["message"] == f"host {host.lower()!r} is not served here (--allowed-hosts)"
    wild = ServerOptions(allowed_hosts=("*.Example.com", "10.0.0.1"))
    assert guarded(wild, {"host": "api.example.com:443"})[0] == 200
    assert guarded(wild, {"host": "a.b.EXAMPLE.com"})[0] == 200
    assert guarded(wild, {"host": "10.0.0.1:8000"})[0] == 200
    assert guarded(wild, {"host": "example.com"})[0] == 400  # the subdomains only
    assert guarded(wild, {"host": "evilexample.com"})[0] == 400
    assert guarded(wild, {"host": "localhost"})[0] == 400  # the loopback names are the default only
    assert guarded(ServerOptions(allowed_hosts=("*",)), {"host": "anything.at.all:1"})[0] == 200
    # refused before the body is read, whatever the method
    assert guarded(default, {"host": "evil"}, method="GET", path="/v1/models")[0] == 400
    # no Host header at all (HTTP/1.0): the empty name, refused unless every host is allowed
    status, error, read = guarded(default, {"host": None})
    assert (status, error["code"], read) == (400, "invalid_host", None)
    assert error["message"] == "host '' is not served here (--allowed-hosts)"
    assert guarded(ServerOptions(allowed_hosts=("*",)), {"host": None})[0] == 200


def test_the_guard_checks_the_api_key_except_for_health():
    options = ServerOptions(api_key="s3cret")
    assert guarded(options, {"authorization": "Bearer s3cret"})[0] == 200
    assert guarded(options, {"authorization": "bearer  s3cret "})[0] == 200  # the scheme in any case, spaces around
    for auth in ("", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret", "Bearer"):
        status, error, read = guarded(options, {"authorization": auth} if auth else {})
        assert (status, error["code"], error["type"], read) == (401, "invalid_api_key", "invalid_request_error", None)
        assert error["message"] == "missing or wrong API key: send 'Authorization: Bearer <key>'"
    headers = []
    assert guarded(options, {}, response_headers=headers)[0] == 401
    assert (b"www-authenticate", b"Bearer") in headers  # RFC 9110: a 401 names its scheme
    assert guarded(options, {}, method="GET", path="/health")[0] == 200
    assert guarded(options, {}, method="GET", path="/v1/models")[0] == 401
    assert guarded(ServerOptions(), {})[0] == 200  # no key set: none asked


def test_the_guard_refuses_a_body_past_its_limit_and_passes_the_rest_whole():
    options = ServerOptions(max_body_bytes=10)
    status, error, read = guarded(options, {}, chunks=(b"0123456789",))
    assert (status, read) == (200, b"0123456789")
    status, error, read = guarded(options, {}, chunks=(b"0123", b"45", b"6789"))  # sent in pieces: joined
    assert (status, read) == (200, b"0123456789")
    status, error, read = guarded(options, {}, chunks=(b"0123456789a",))
    assert (status, error["code"], read) == (413, "request_too_large", None)
    assert error["message"] == "the request body exceeds 10 bytes (--max-body-bytes)"
    # a Content-Length that under-states the body: counted as it comes
    status, error, read = guarded(options, {"content-length": "4"}, chunks=(b"012345", b"6789", b"a"))
    assert (status, error["code"], read) == (413, "request_too_large", None)
    assert guarded(options, {"content-length": "10"}, chunks=(b"0123", b"456789"))[0] == 200
    status, error, read = guarded(options, {"content-length": "11"}, chunks=(b"0",))  # refused before it is read
    assert (status, error["code"]) == (413, "request_too_large")
    status, error, read = guarded(options, {"content-length": "12a"})
    assert (status, error["message"], read) == (400, "bad Content-Length header", None)
    assert guarded(options, {}, chunks=(b"01234",), length=False)[0] == 200  # no Content-Length: counted
    assert guarded(options, {}, chunks=(b"0123456789ab",), length=False)[0] == 413
    # a GET's body is not the guard's business; a PUT's and a PATCH's are, as a POST's
    assert guarded(options, {"content-length": "x"}, method="GET", path="/v1/models")[0] == 200
    for method in ("PUT", "PATCH"):
        status, error, read = guarded(options, {}, chunks=(b"0123456789a",), method=method)
        assert (status, error["code"], read) == (413, "request_too_large", None), method
        assert guarded(options, {}, chunks=(b"0123456789",), method=method)[:3:2] == (200, b"0123456789")
    # ASGI's defaults: a message without "body" is an empty one, without "more_body" the last one
    assert guarded(options, {}, messages=[{"type": "http.request"}]) == (200, None, b"")
    assert guarded(options, {}, messages=[{"type": "http.request", "body": b"01"}]) == (200, None, b"01")
    # a client gone before its body: the app is never called and nothing is sent
    assert guarded(options, {}, chunks=()) == (None, None, None)


def test_the_guard_passes_other_scopes_with_their_own_channels():
    """A lifespan or websocket scope goes to the app with the very receive and send it came with: the app's
    lifespan starts and stops the engine thread."""
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], receive, send))

    async def receive():
        return {}

    async def send(message):
        pass

    for kind in ("lifespan", "websocket"):
        asyncio.run(Guard(app, ServerOptions())({"type": kind}, receive, send))
    assert seen == [("lifespan", receive, send), ("websocket", receive, send)]


def test_unsupported_fields_are_refused_unless_their_value_changes_nothing():
    options = ServerOptions()
    neutral = {"echo": False, "best_of": 1, "suffix": "", "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "tools": [], "functions": [], "response_format": {"type": "text"},
               "user": "someone", "metadata": {"a": 1}}
    check_fields(CompletionRequest(prompt="hi", **neutral), options)
    for key, value in (("echo", True), ("best_of", 2), ("best_of", True), ("echo", 0), ("suffix", "x"),
                       ("presence_penalty", 0.5), ("frequency_penalty", False), ("logit_bias", {"1": 2}),
                       ("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"})):
        with pytest.raises(APIError) as e:
            check_fields(CompletionRequest(prompt="hi", **{key: value}), options)
        assert (e.value.status, e.value.param, e.value.code) == (400, key, "unsupported_parameter")
        assert e.value.message == f"{key} is not supported by this server"


def test_stop_strings_up_to_the_limits_pass_and_one_more_is_refused():
    options = ServerOptions(max_stop_strings=3, max_stop_chars=5)
    check_fields(CompletionRequest(prompt="hi", stop=["a", "bb", "ccccc"]), options)
    check_fields(CompletionRequest(prompt="hi", stop="ccccc"), options)
    with pytest.raises(APIError) as e:
        check_fields(CompletionRequest(prompt="hi", stop=["a", "b", "c", "d"]), options)
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "stop", "at most 3 stop strings (--max-stop-strings), not 4")
    with pytest.raises(APIError) as e:
        check_fields(CompletionRequest(prompt="hi", stop=["a", "cccccc"]), options)
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "stop", "a stop string of 6 characters; at most 5 (--max-stop-chars)")
    with pytest.raises(APIError) as e:
        # JSON's "\ud800" reaches the check (pydantic refuses it only when the model is made from Python strings)
        check_fields(CompletionRequest.model_construct(prompt="hi", stop=["a", "x\ud800"]), options)
    assert (e.value.status, e.value.param) == (400, "stop")


def test_text_that_is_not_unicode_is_refused_where_it_is():
    check_text("héllo ✓", "prompt")
    with pytest.raises(APIError) as e:
        check_text("ab\udc00c", "messages.1.content")
    assert (e.value.status, e.value.param) == (400, "messages.1.content")
    assert e.value.message == "messages.1.content holds a lone surrogate ('\\udc00') at character 2: not Unicode text"


def test_per_request_policy_settings_are_those_the_policy_declares_and_within_the_cap():
    check_policy_settings("tokenselect", {"k": 100, "n_local": 100, "theta": -1.0}, max_size=100)
    check_policy_settings("tokenselect", {"theta": None}, max_size=100)  # None: the Selection Cache off
    check_policy_settings("full", {}, max_size=100)
    refusals = [("tokenselect", {"k": 101}, "policy.k", "policy.k must be in [0, 100], not 101"),
                ("tokenselect", {"n_local": -1}, "policy.n_local", "policy.n_local must be in [0, 100], not -1"),
                ("tokenselect", {"theta": 1.01}, "policy.theta", "policy.theta must be in [-1.0, 1.0], not 1.01"),
                ("tokenselect", {"k": 1.5}, "policy.k", "policy.k must be a whole number, not 1.5"),
                ("tokenselect", {"n_init": 4}, "policy.n_init",
                 "policy setting 'n_init' is not a per-request setting of the 'tokenselect' policy (it takes: k, "
                 "n_local, theta)"),
                ("full", {"k": 4}, "policy.k",
                 "policy setting 'k' is not a per-request setting of the 'full' policy (it takes: none)")]
    for attention, settings, param, message in refusals:
        with pytest.raises(APIError) as e:
            check_policy_settings(attention, settings, max_size=100)
        assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


class FakeLLM:
    """What ``prompt_ids`` and ``resolve_options`` read of an engine."""

    class cache:
        n_slots = 1000

    max_model_len = 300

    def __init__(self):
        self.checked = []

    def check_request(self, ids, max_tokens, cap):
        self.checked.append((list(ids), max_tokens, cap))
        if len(ids) + max_tokens > cap:
            raise TokenSelectError(f"{len(ids)} + {max_tokens} tokens exceed {cap}")
        if any(i >= 50 for i in ids):
            raise ValueError("token id 50 is outside the vocabulary")


class FakeTokenizer:
    chat_template = None

    def __call__(self, text):
        if text == "boom":
            raise RuntimeError("the tokenizer broke")
        return {"input_ids": [ord(c) % 50 for c in text]}


def test_prompt_ids_checks_length_text_and_the_engines_limits(monkeypatch, caplog):
    llm, tok = FakeLLM(), FakeTokenizer()
    options = ServerOptions(max_model_len=20, max_prompt_chars=6)
    assert prompt_ids(llm, tok, "abcdef", 4, options) == [ord(c) % 50 for c in "abcdef"]
    assert llm.checked[-1] == ([ord(c) % 50 for c in "abcdef"], 4, 20)
    assert prompt_ids(llm, tok, [1, 2, 3], 4, options) == [1, 2, 3]  # token ids go straight to the engine's check
    cases = [("abcdefg", "prompt", "context_length_exceeded", "the prompt exceeds 6 characters (--max-prompt-chars)"),
             ("a\ud800", "prompt", None, None), ("boom", "prompt", None, "the tokenizer could not encode this prompt"),
             ([1] * 17, "prompt", "context_length_exceeded", "17 + 4 tokens exceed 20"),
             ([1, 50], "prompt", None, "token id 50 is outside the vocabulary")]
    for prompt, param, code, message in cases:
        with pytest.raises(APIError) as e:
            prompt_ids(llm, tok, prompt, 4, options)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, code), prompt
        assert message is None or e.value.message == message
    # the client gets a 400 without internals; the operator's log gets what the tokenizer raised, once
    failures = [r for r in caplog.records if r.getMessage() == "the tokenizer failed on a prompt"]
    assert len(failures) == 1 and failures[0].levelname == "ERROR" and failures[0].exc_info is not None
    assert prompt_ids(llm, tok, [1] * 16, 4, options) == [1] * 16  # prompt + max_tokens == the cap: accepted
    chat = [Message(role="user", content="abc"), Message(role="assistant", content="de")]
    assert prompt_ids(llm, tok, chat, 1, ServerOptions(max_model_len=100, max_prompt_chars=40)) == [
        ord(c) % 50 for c in "user: abc\nassistant: de\nassistant:"]  # without a chat template: role: text lines
    with pytest.raises(APIError) as e:  # the lines are a prompt of 32 characters
        prompt_ids(llm, tok, chat, 1, ServerOptions(max_model_len=100, max_prompt_chars=31))
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    # with a chat template the messages' characters are counted, before templating
    monkeypatch.setattr(server, "chat_token_ids", lambda tokenizer, turns: [len(t["content"]) for t in turns])
    tok.chat_template = "{{ messages }}"
    assert prompt_ids(llm, tok, chat, 1, ServerOptions(max_model_len=100, max_prompt_chars=5)) == [3, 2]
    with pytest.raises(APIError) as e:
        prompt_ids(llm, tok, chat, 1, ServerOptions(max_model_len=100, max_prompt_chars=4))
    assert (e.value.status, e.value.param, e.value.code, e.value.message) == (
        400, "messages", "context_length_exceeded", "the messages exceed 4 characters (--max-prompt-chars)")
    monkeypatch.setattr(server, "chat_token_ids", lambda tokenizer, turns: 1 / 0)
    with pytest.raises(APIError) as e:
        prompt_ids(llm, tok, chat, 1, ServerOptions(max_model_len=100, max_prompt_chars=5))
    assert (e.value.status, e.value.param, e.value.code, e.value.message) == (
        400, "messages", "chat_template_error", "the model's chat template refused these messages: division by zero")
    with pytest.raises(APIError) as e:
        prompt_ids(llm, tok, [Message(role="user", content="ok"), Message(role="user", content="x\udfff")], 1,
                   ServerOptions(max_model_len=100, max_prompt_chars=50))
    assert (e.value.status, e.value.param) == (400, "messages.1.content")


def test_resolve_options_caps_a_request_at_half_the_pool_and_the_models_length():
    llm = FakeLLM()
    options = resolve_options(ServerOptions(), llm)
    assert (options.max_model_len, options.max_prompt_chars) == (300, 16 * 300)  # half the pool (500) > 300
    llm.cache.n_slots = 400
    try:
        assert resolve_options(ServerOptions(), llm).max_model_len == 200
        llm.cache.n_slots = 401  # half of an odd pool: a whole number of tokens
        assert type(resolve_options(ServerOptions(), llm).max_model_len) is int
        assert resolve_options(ServerOptions(), llm).max_prompt_chars == 16 * 200
        llm.cache.n_slots = 400
        assert resolve_options(ServerOptions(max_model_len=250, max_prompt_chars=7), llm).max_model_len == 250
        assert resolve_options(ServerOptions(max_model_len=250, max_prompt_chars=7), llm).max_prompt_chars == 7
        assert resolve_options(ServerOptions(max_model_len=999), llm).max_model_len == 300
        llm.cache.n_slots = 1
        assert resolve_options(ServerOptions(), llm).max_model_len == 1  # at least one token
    finally:
        llm.cache.n_slots = 1000


def test_a_requests_sampling_and_logprobs_are_its_fields():
    params = CompletionRequest(prompt="hi", max_tokens=7, temperature=0, top_p=0.5, top_k=3, stop="x", seed=9,
                               ignore_eos=True, logprobs=2).sampling()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop, params.seed,
            params.ignore_eos, params.logprobs) == (7, 0.0, 0.5, 3, ["x"], 9, True, 2)
    assert type(params.temperature) is float and type(params.top_p) is float
    default = CompletionRequest(prompt="hi").sampling()
    assert (default.max_tokens, default.temperature, default.top_p, default.top_k, default.stop, default.seed,
            default.ignore_eos, default.logprobs) == (16, 1.0, 1.0, 0, [], None, False, None)
    assert CompletionRequest(prompt="hi", stop=["a", "b"]).stops == ["a", "b"]
    messages = [Message(role="user", content="hi")]
    assert ChatRequest(messages=messages).logprob_alternatives() is None
    assert ChatRequest(messages=messages, logprobs=True).logprob_alternatives() == 0
    assert ChatRequest(messages=messages, logprobs=True, top_logprobs=3).logprob_alternatives() == 3
    assert ChatRequest(messages=messages, logprobs=False).logprob_alternatives() is None
    with pytest.raises(APIError) as e:
        ChatRequest(messages=messages, top_logprobs=3).logprob_alternatives()
    assert (e.value.status, e.value.param, e.value.message) == (400, "top_logprobs", "top_logprobs needs logprobs: true")
    with pytest.raises(APIError):
        ChatRequest(messages=messages, logprobs=False, top_logprobs=0).logprob_alternatives()
