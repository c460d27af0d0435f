"""The server reusing a shared prefix across requests and a chat's turns, spoken to over HTTP on 127.0.0.1:
``usage.prompt_tokens_details.cached_tokens``, /health's counters and ``--no-prefix-cache``."""

from __future__ import annotations

import httpx
import pytest

from test_prefix_cache import cached_prefix
from test_server import NAME, SETTINGS, checkpoint, running_server  # noqa: F401 (checkpoint: a fixture)
from tokenselect.cli import build_llm, build_parser
from tokenselect.engine import LLM

CHUNK = SETTINGS["chunk_size"]
DOCUMENT = "Clause {i}: the tenant pays the rent of month {i} on its first day. "
DOC = "".join(DOCUMENT.format(i=i) for i in range(24))


@pytest.fixture(scope="module")
def reusing(checkpoint):  # noqa: F811
    llm = LLM(checkpoint, **SETTINGS)
    with running_server(llm) as (url, app):
        yield url, llm


def chat(url: str, messages: list[dict]) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_questions_and_turns_over_one_document_report_their_cached_tokens(reusing):
    url, llm = reusing
    before = llm.stats()["prefix_cache_hit_tokens"]
    system = {"role": "system", "content": "Answer from this lease.\n" + DOC}
    asked, served = [], []
    for question in ("When is the rent due?", "Which clause names month 7?", "Who pays?"):
        messages = [system, {"role": "user", "content": question}]
        ids = llm.chat_prompt(messages)
        body = chat(url, messages)
        assert body["usage"]["prompt_tokens"] == len(ids)
        served.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        asked.append(ids)
    want = [cached_prefix(ids, asked[:i], CHUNK) for i, ids in enumerate(asked)]
    assert want[0] == 0 and min(want[1:]) >= len(llm.chat_prompt([system])) - 2 * CHUNK > 0
    assert served == want
    # the chat's next turn: the previous turn, its answer and a new question
    first = [system, {"role": "user", "content": "When is the rent due?"}]
    answer = chat(url, first)["choices"][0]["message"]["content"]
    turn = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in month 3?"}]
    ids = llm.chat_prompt(turn)
    assert chat(url, turn)["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_prefix(
        ids, asked + [llm.chat_prompt(first)], CHUNK) >= len(llm.chat_prompt(first)) - CHUNK
    health = httpx.get(url + "/health").json()
    assert health["prefix_cache_hit_tokens"] - before >= sum(want) and health["prefix_cache_tokens"] > 0
    assert health["prefix_cache_evicted_tokens"] == 0


def test_a_chats_next_turn_reuses_the_previous_answer_with_full_attention(checkpoint):  # noqa: F811
    """Full attention caches the answer too (a decode step computes the KV a prefill would): the next turn reuses
    the previous prompt and its answer but the answer's last token (whose KV was never computed). The chat template
    writes the answer's text back, and the tokenizer gives the generated ids again (checked: else fewer are
    reused)."""
    llm = LLM(checkpoint, **{**SETTINGS, "attention": "full"})
    with running_server(llm) as (url, _):
        first = [{"role": "system", "content": "Answer from this lease.\n" + DOC},
                 {"role": "user", "content": "When is the rent due?"}]
        body = chat(url, first)
        answer, generated = body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]
        turn = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in month 3?"}]
        ids, previous = llm.chat_prompt(turn), llm.chat_prompt(first)
        assert ids[:len(previous)] == previous and generated == 6
        assert llm.tokenizer(answer, add_special_tokens=False)["input_ids"] == ids[len(previous):len(previous) + 6]
        assert chat(url, turn)["usage"]["prompt_tokens_details"]["cached_tokens"] == len(previous) + generated - 1


def test_openai_client_sees_cached_tokens_and_streams_report_them(reusing):
    openai = pytest.importorskip("openai")
    url, llm = reusing
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt = DOC + "\nQuestion: what is due?"
    ids = llm.encode(prompt)
    first = api.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    again = api.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // CHUNK * CHUNK > 0
    stream = api.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // CHUNK * CHUNK


def test_no_prefix_cache_flag_computes_every_prompt(checkpoint):  # noqa: F811
    args = build_parser().parse_args(["serve", "--model", str(checkpoint), "--attention", "tokenselect",
                                      "--chunk-size", str(CHUNK), "--kv-cache-tokens", "4096", "--no-prefix-cache"])
    assert args.prefix_cache is False
    default = build_parser().parse_args(["serve", "--model", str(checkpoint), "--kv-cache-tokens", "4096"])
    assert default.prefix_cache is None and build_llm(default).scheduler.prefix is not None  # on by default
    llm = build_llm(args)
    assert llm.scheduler.prefix is None
    with running_server(llm) as (url, _):
        messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "When?"}]
        assert [chat(url, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)] == [0, 0]
        health = httpx.get(url + "/health").json()
        assert "prefix_cache_tokens" not in health and health["kv_slots_free"] == health["kv_slots"]
