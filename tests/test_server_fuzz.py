"""Random request bodies and random token-id lists thrown at a live server on 127.0.0.1. The generator is
seeded, so a failure replays. No answer may be a 500 or hang; afterwards the server still answers correctly,
and the count of free KV slots is back where it started."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from checkpoints import VOCAB
from test_server import PROMPTS, SETTINGS, checkpoint, expected, reference, running_server  # noqa: F401
from tokenselect.engine import LLM

SEED = 31
N_BODIES = 300
INTS = [-1, 0, 1, 2, 3, 7, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]  # valid sizes stay small: short runs
FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, 2.5, -1.0, 1e-300, 1e308, 3.3e-5]
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "n",
          "ignore_eos", "policy", "model", "logprobs", "echo", "best_of", "user", "logit_bias"]
ROLES = ["system", "user", "assistant", "tool", "wizard", ""]
ALLOWED = {200, 400, 404, 413}


def random_text(rng: random.Random) -> str:
    alphabet = "ab \n\t\"\\{}[]:é漢🙂\u0000\ufffd"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    if rng.random() < 0.15:
        text += rng.choice(["\ud800", "\udfff", "\ud83d"])  # a lone surrogate (JSON "\ud800")
    return text


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(INTS)
    if kind == 3:
        return rng.choice(FLOATS)
    if kind == 4:
        return random_text(rng)
    if kind == 5:
        return token_ids(rng)
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng) if rng.random() < 0.3 else rng.choice(FIELDS + ["k", "theta", "n_local"]):
            random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def token_ids(rng: random.Random) -> list[int]:
    pool = [lambda: rng.randrange(VOCAB), lambda: rng.randrange(VOCAB), lambda: rng.choice([-1, VOCAB, 8192]),
            lambda: rng.choice([2**63, -(2**63), 10**20])]
    return [rng.choice(pool)() for _ in range(rng.randint(0, 30))]


def random_request(rng: random.Random) -> tuple[str, bytes]:
    """(path, body): mostly near-valid bodies with a few fields made random, some random JSON, some garbage."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    kind = rng.random()
    if kind < 0.08:
        return path, bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    if kind < 0.16:
        return path, json.dumps(random_value(rng)).encode()
    body = {"max_tokens": rng.randint(1, 4), "temperature": 0}
    if path == "/v1/completions":
        body["prompt"] = token_ids(rng) if rng.random() < 0.5 else random_text(rng) or "hi"
    else:
        body["messages"] = [{"role": rng.choice(ROLES[:4]), "content": random_text(rng)}
                            for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.2:
            body["messages"].append({"role": rng.choice(ROLES), "content": random_value(rng)})
    for field in rng.sample(FIELDS, rng.randint(0, 3)):
        body[field] = random_value(rng)
    if rng.random() < 0.2:
        body["policy"] = {rng.choice(["k", "n_local", "theta", "span"]): rng.choice(INTS + FLOATS)}
    text = json.dumps(body)  # lone surrogates travel as JSON escapes, as a client's JSON encoder sends them
    if rng.random() < 0.05:
        text = text[:rng.randrange(len(text))]  # cut short
    return path, text.encode()


def check_answer(r: httpx.Response, streamed: bool) -> None:
    assert r.status_code in ALLOWED, (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif streamed:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_bodies_and_token_ids_leave_the_server_serving(checkpoint, reference):  # noqa: F811
    llm = LLM(checkpoint, **SETTINGS)
    rng = random.Random(SEED)
    requests = [random_request(rng) for _ in range(N_BODIES)]
    start = time.monotonic()
    with running_server(llm) as (url, app), httpx.Client(base_url=url, timeout=60) as client:
        free_at_start = llm.scheduler.available  # free, or held by the prefix cache alone

        def send(request: tuple[str, bytes]) -> int:
            path, body = request
            with httpx.Client(base_url=url, timeout=30) as c:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            check_answer(r, b'"stream": true' in body)
            return r.status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(send, requests))
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"{N_BODIES} fuzzed requests in {time.monotonic() - start:.1f}s: {counts}")
        assert counts.get(200, 0) >= 20 and counts.get(400, 0) >= 50  # both sides were exercised
        deadline = time.monotonic() + 20
        while llm.scheduler.available != free_at_start or app.state.worker.jobs:
            assert time.monotonic() < deadline, "fuzzed requests left KV slots taken"
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == expected(reference, PROMPTS[0], max_tokens=8, temperature=0)
        health = client.get("/health")
        assert health.status_code == 200 and (health.json()["kv_slots_free"]
                                              + health.json()["prefix_cache_tokens"] == free_at_start)
