"""An OpenAI-compatible HTTP server: ``tokenselect serve``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives
server-sent events), ``GET /v1/models``, ``GET /health``.

The engine is not thread-safe, so one thread (``EngineWorker``) owns it: HTTP handlers hand it
"add" and "abort" commands through a queue, it runs ``llm.step()`` while any request is live
(continuous batching: every running sequence advances in the same forward pass) and sends each
request a snapshot of its sequence back to the event loop with ``loop.call_soon_threadsafe``.
The scheduler admits a request only when its whole reservation fits the KV pool, so newcomers
queue while the pool is full and running sequences are never disturbed. A client that goes away
(a closed stream or a cancelled request) has its sequence aborted and its KV slots freed.

Everything about a request that can fail (size limits, templating, tokenizing, token-id and
setting checks, admission) is done before it reaches the engine thread, the templating and
tokenizing on a thread of their own; a step that fails ends only the sequence that made it fail.
Errors a client causes get OpenAI's error object, ``{"error": {"message", "type", "param",
"code"}}``, with a 4xx status; the server keeps serving. A 500's text is generic: the details go
to the log.

``ServerOptions`` holds the limits and the access settings (``--api-key``, ``--allowed-hosts``, ...);
each of its fields is a flag of ``tokenselect serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import hmac
import itertools
import json
import logging
import queue
import re
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from .engine import WARMUP_DECODE_STEPS
from .errors import TokenSelectError
from .models.loader import chat_token_ids
from .policies import POLICIES
from .sampling import MAX_LOGPROBS, SamplingParams
from .server_options import LOOPBACK_HOSTS, PROMPT_CHARS_PER_TOKEN, ServerOptions
from .settings import problem, specs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; used for chat too
# OpenAI fields that would change the output, which the server does not implement, with the values that
# change nothing (a client may send those); any other value is a 400 rather than a silently different answer
UNSUPPORTED_FIELDS = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
                      "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                      "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"})}
INTERNAL_ERROR = "internal server error; the server log has the details"
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs (chat's top_logprobs: MAX_LOGPROBS)
log = logging.getLogger("tokenselect.server")
# how pydantic names a union member in an error
UNION_TAG = re.compile(r"(constrained-)?(str|int|float|bool)|\w+\[.*\]")


# ---- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    """A request the server refuses, as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error() -> APIError:
    return APIError(500, INTERNAL_ERROR, type="server_error")


def unavailable_error(why: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {why}", type="server_error", code="engine_unavailable")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


# ---- request bodies -----------------------------------------------------------------------------

Number = Union[StrictInt, StrictFloat]
StopString = Annotated[StrictStr, Field(min_length=1)]


class _Request(BaseModel):
    """Fields shared by both endpoints. Other OpenAI fields (user, ...) are ignored, except those in
    ``UNSUPPORTED_FIELDS`` with a value that would change the output (a 400)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)  # OpenAI's range
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    stop: StopString | list[StopString] | None = None
    seed: StrictInt | None = Field(default=None, ge=-2**63, le=2**64 - 1)  # what torch's generator takes
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)
    ignore_eos: StrictBool = False  # a vLLM extension (extra_body): generate max_tokens whatever comes
    policy: dict[StrictStr, Number] | None = None  # per-request k / n_local / theta (extra_body)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or DEFAULT_MAX_TOKENS, temperature=float(self.temperature),
                              top_p=float(self.top_p), top_k=self.top_k, stop=self.stops, seed=self.seed,
                              ignore_eos=self.ignore_eos, logprobs=self.logprob_alternatives())


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def logprob_alternatives(self) -> int | None:
        """None: no logprobs; n: each token's logprob and the n likeliest alternatives'."""
        return self.logprobs


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr


class ChatRequest(_Request):
    messages: list[Message]
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- the engine thread --------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A sequence's state after a step: the text so far, its token counts, why it ended (or None), and
    with logprobs asked for, the tokens generated since the previous snapshot as
    ``(text, logprob, [(text, logprob)] of the likeliest)``."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (usage.prompt_tokens_details)


@dataclass
class Job:
    """One request as the engine thread sees it: its prompt already tokenized and checked.
    ``events`` (on the event loop) receives a ``Snapshot`` after each step that gave it a token, or
    an ``APIError`` if it was refused or failed."""

    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    ids: list[int] = field(default_factory=list)
    policy: dict | None = None  # the request's own policy settings (k, n_local, theta)
    # completes when the client disconnects, while the handler watches for that (``wait_for_disconnect``);
    # None once a stream answers: the stream notices a closed connection itself
    gone: asyncio.Future | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: object = None
    logprobs_sent: int = 0  # entries of seq.logprobs already sent (engine thread only)

    def send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class EngineWorker:
    """Owns the LLM on one thread; ``submit`` and ``abort`` are safe to call from any thread.

    No request can end the thread: a request the engine refuses gets a 400, one whose step fails a
    500, and an error in the loop itself ends the requests then live and the loop goes on. Should the
    thread end anyway (or stop, at shutdown), ``unavailable`` says why and every request still
    waiting gets a 503 instead of waiting for ever."""

    def __init__(self, llm):
        self.llm = llm
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # sequence id -> job, for live sequences
        self.thread = threading.Thread(target=self._run, name="tokenselect-engine", daemon=True)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # orders ``submit`` against the thread's closing
        self._closed: str | None = None  # why the thread takes no more requests

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step (waiting ``timeout`` seconds at most); live requests get a 503."""
        self._stop.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.error("the engine thread did not stop within %s s; leaving it (a daemon thread)", timeout)

    def unavailable(self) -> str | None:
        """Why no request can be served now, or None."""
        if self._closed is None and not self.thread.is_alive():
            return "the engine thread is not running"
        return self._closed

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed is None:
                self.inbox.put(("add", job))
                return
        job.send(unavailable_error(self._closed))

    def abort(self, job: Job) -> None:
        self.inbox.put(("abort", job))

    def _run(self) -> None:
        closed = "the server is shutting down"
        try:
            while not self._stop.is_set():
                try:
                    for command, job in self._commands(wait=0 if self.llm.scheduler.has_work() else 0.1):
                        self._handle(command, job)
                    if self.llm.scheduler.has_work():
                        for seq in self.llm.step():
                            self._publish(seq)
                except Exception:  # a bug outside any one request: end the live ones, keep serving
                    log.exception("engine loop error; ending %d live requests", len(self.jobs))
                    self._fail_all(internal_error())
        except BaseException:
            closed = "the engine thread stopped on an error"
            log.exception("the engine thread is stopping")
            raise
        finally:
            with self._lock:
                self._closed = closed
            self._fail_all(unavailable_error(closed))

    def _commands(self, wait: float = 0):
        """The inbox's commands until it is empty, waiting up to ``wait`` seconds for the first."""
        try:
            yield self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
            while True:
                yield self.inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, command: str, job: Job) -> None:
        if command == "add":
            try:
                job.seq = self.llm.add_request(job.ids, job.params, job.policy)
            except (TokenSelectError, ValueError) as e:  # checked before, so: a policy setting it cannot build
                job.send(APIError(400, str(e), param="policy" if job.policy else "prompt"))
            except Exception:
                log.exception("adding a request failed")
                job.send(internal_error())
            else:
                self.jobs[job.seq.id] = job
        elif job.seq is not None and not job.seq.finished:
            self.llm.abort(job.seq)
            self.jobs.pop(job.seq.id, None)

    def _publish(self, seq) -> None:
        job = self.jobs.get(seq.id)
        if job is None:
            return
        if seq.finished:
            del self.jobs[seq.id]
        if seq.finish_reason == "error":  # the engine logged its exception
            job.send(internal_error())
        else:
            job.send(Snapshot(seq.text, len(seq.prompt_ids), len(seq.output_ids), seq.finish_reason,
                              self._new_logprobs(job), seq.cached_tokens))

    def _new_logprobs(self, job: Job) -> list:
        """The job's logprob entries since its last snapshot, the token ids decoded (by this thread's tokenizer)."""
        seq = job.seq
        if seq.logprobs is None:
            return []
        start, job.logprobs_sent = job.logprobs_sent, len(seq.logprobs)
        decode = self.llm.tokenizer.decode
        return [(decode([token]), logprob, [(decode([i]), lp) for i, lp in top])
                for token, (logprob, top) in zip(seq.output_ids[start:], seq.logprobs[start:])]

    def _fail_all(self, error: APIError) -> None:
        """End every live request and every one still in the inbox with ``error``."""
        for job in self.jobs.values():
            try:
                self.llm.abort(job.seq)
            except Exception:
                log.exception("aborting sequence %s failed", job.seq.id)
            job.send(error)
        self.jobs.clear()
        if self._closed is not None:  # nothing will read the inbox again
            for command, job in self._commands():
                if command == "add":
                    job.send(error)


# ---- text streaming -----------------------------------------------------------------------------


def stable_prefix(text: str, stops: list[str]) -> str:
    """The part of an unfinished text that later tokens cannot change: without a trailing partial
    UTF-8 character (decoded as U+FFFD) or a tail that may be the start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - hold]


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes its connection (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def snapshots(worker: EngineWorker, job: Job):
    """Yield the job's snapshots until it finishes; raise ClientGone if ``job.gone`` completes first;
    abort the job if it did not finish."""
    done = False
    try:
        while not done:
            if job.gone is not None:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, job.gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    raise ClientGone
                item = get.result()
            else:
                item = await job.events.get()
            if isinstance(item, APIError):
                raise item
            done = item.finish_reason is not None
            yield item
    finally:
        if not done:
            worker.abort(job)


# ---- before the engine: checks, templating, tokenizing ----------------------------------------


class Guard:
    """ASGI middleware in front of the app: the Host header (against DNS rebinding), the API key, and
    the body size, each refused with OpenAI's error object before any of the request is parsed."""

    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self.refusal(scope["path"], headers)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds {self.options.max_body_bytes} bytes "
                                  f"(--max-body-bytes)", code="request_too_large")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return await APIError(400, "bad Content-Length header").response()(scope, receive, send)
        if int(length) > self.options.max_body_bytes:
            return await too_large.response()(scope, receive, send)
        chunks, size = [], 0  # read it here, counting, for bodies sent without (or with a false) length
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.options.max_body_bytes:
                return await too_large.response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():  # the body once, then the connection's own messages (its disconnect)
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    def refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        allowed = self.options.allowed_hosts or LOOPBACK_HOSTS
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if host.startswith("["):  # an IPv6 literal, then at most ":port"; anything else is no name of ours
            inside, closed, rest = host[1:].partition("]")
            name = inside if closed and (rest == "" or rest.startswith(":")) else host
        else:
            name = host.rsplit(":", 1)[0]
        if not any(a == "*" or name == a.lower() or (a.startswith("*.") and name.endswith(a[1:].lower()))
                   for a in allowed):
            return APIError(400, f"host {host!r} is not served here (--allowed-hosts)", code="invalid_host")
        key = self.options.api_key
        if key is not None and path != "/health":
            scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
                return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None


def chat_prompt(tokenizer, messages: list[Message]) -> str | list[int]:
    """The token ids of the model's chat template (which writes its own special tokens, so none is added);
    without one, the text of ``role: content`` lines then ``assistant:``."""
    turns = [m.model_dump() for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return chat_token_ids(tokenizer, turns)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def check_text(text: str, param: str) -> None:
    """APIError 400 for text a tokenizer cannot take: a lone UTF-16 surrogate (JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone surrogate ({text[e.start]!r}) at character {e.start}: "
                            f"not Unicode text", param=param) from None


def prompt_ids(llm, tokenizer, prompt: str | list[int] | list[Message], max_tokens: int,
               options: ServerOptions) -> list[int]:
    """The checked token ids of a prompt (text, token ids, or chat messages): APIError 400 for a prompt
    over ``max_prompt_chars``, text that is not Unicode, messages the chat template refuses, a token id
    outside the vocabulary, or prompt + max_tokens over ``max_model_len``. Runs on the tokenizer
    thread, with a tokenizer of its own (the engine thread detokenizes with the engine's)."""
    param = "prompt"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], Message):
        param = "messages"
        if sum(len(m.content) for m in prompt) > options.max_prompt_chars:
            raise APIError(400, f"the messages exceed {options.max_prompt_chars} characters (--max-prompt-chars)",
                           param=param, code="context_length_exceeded")
        for i, m in enumerate(prompt):
            check_text(m.content, f"messages.{i}.content")
        try:
            prompt = chat_prompt(tokenizer, prompt)
        except Exception as e:  # jinja2's TemplateError, e.g. "roles must alternate user/assistant"
            raise APIError(400, f"the model's chat template refused these messages: {e}", param=param,
                           code="chat_template_error") from None
    if isinstance(prompt, str):
        if len(prompt) > options.max_prompt_chars:
            raise APIError(400, f"the prompt exceeds {options.max_prompt_chars} characters (--max-prompt-chars)",
                           param=param, code="context_length_exceeded")
        check_text(prompt, param)
        try:
            ids = tokenizer(prompt)["input_ids"]
        except Exception:
            log.exception("the tokenizer failed on a prompt")
            raise APIError(400, "the tokenizer could not encode this prompt", param=param) from None
    else:
        ids = prompt
    try:
        llm.check_request(ids, max_tokens, options.max_model_len)
    except TokenSelectError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    return ids


def check_policy_settings(attention: str, settings: dict, max_size: int) -> None:
    """APIError 400 for a setting the running policy does not take per request (those its settings declare
    ``per_request``: k, n_local, theta) or a value out of its range; sizes (in tokens) are at most ``max_size``."""
    takes = {spec.name: spec for spec in specs(POLICIES[attention].Settings) if spec.per_request}
    for key, value in settings.items():
        if key not in takes:
            raise APIError(400, f"policy setting {key!r} is not a per-request setting of the {attention!r} policy "
                           f"(it takes: {', '.join(takes) or 'none'})", param=f"policy.{key}")
        why = problem(takes[key], value, high=max_size if takes[key].unit == "tokens" else None)
        if why is not None:
            raise APIError(400, f"policy.{why}", param=f"policy.{key}")


def check_fields(body: _Request, options: ServerOptions) -> None:
    """APIError 400 for an OpenAI field the server does not implement with a value that would change the
    output, and for stop strings over the limits."""
    for key, value in (body.model_extra or {}).items():
        # the type too: 0 is not False
        if key in UNSUPPORTED_FIELDS and not any(type(value) is type(n) and value == n for n in UNSUPPORTED_FIELDS[key]):
            raise APIError(400, f"{key} is not supported by this server", param=key, code="unsupported_parameter")
    stops = body.stops
    if len(stops) > options.max_stop_strings:
        raise APIError(400, f"at most {options.max_stop_strings} stop strings (--max-stop-strings), not {len(stops)}",
                       param="stop")
    for s in stops:
        if len(s) > options.max_stop_chars:
            raise APIError(400, f"a stop string of {len(s)} characters; at most {options.max_stop_chars} "
                                f"(--max-stop-chars)", param="stop")
        check_text(s, "stop")


def warm_up_prompt(llm, tokens: int | None) -> list[int]:
    """``--warm-up-tokens``' prompt for ``LLM.warm_up``: the vocabulary's ids in turn ([] for none; None: on a GPU
    ``LLM.default_warm_up_tokens``, none on a CPU), checked as a request of the warm-up's first prompt;
    TokenSelectError naming the flag for one the engine cannot serve."""
    if tokens is None:
        return warm_up_prompt(llm, llm.default_warm_up_tokens() if llm.device.type == "cuda" else 0)
    prompt = [i % llm.config.vocab_size for i in range(max(tokens, 0))]
    try:
        if tokens < 0:
            raise ValueError("a count of tokens, 0 for none")
        if prompt:
            llm.check_request(prompt, WARMUP_DECODE_STEPS + 1)
    except (ValueError, TokenSelectError) as e:
        raise TokenSelectError(f"--warm-up-tokens {tokens}: {e}") from e
    return prompt


def resolve_options(options: ServerOptions, llm) -> ServerOptions:
    """``options`` with the defaults that depend on the engine filled in."""
    cap = min(options.max_model_len or max(1, llm.cache.n_slots // 2), llm.max_model_len)
    return dataclasses.replace(options, max_model_len=cap,
                               max_prompt_chars=options.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * cap)


# ---- the app ------------------------------------------------------------------------------------


def create_app(llm, served_model_name: str | None = None, options: ServerOptions | None = None):
    """The FastAPI app serving ``llm``. The engine thread, and the tokenizer's, run while the app is
    up (lifespan)."""
    name = served_model_name or (llm.path.name if llm.path is not None else "tokenselect")
    options = resolve_options(options or ServerOptions(), llm)
    warm_up = warm_up_prompt(llm, options.warm_up_tokens)
    created = int(time.time())
    worker = EngineWorker(llm)
    tokenizer = copy.deepcopy(llm.tokenizer)  # the tokenizer thread's own
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenselect-tokenizer")
    # requests that have not yet got their first token (being tokenized, queued, or prefilling), counted on the
    # event loop only; at --max-queued-requests newcomers are turned away
    waiting = 0

    @asynccontextmanager
    async def lifespan(app):
        if warm_up:  # before the engine thread takes it, and before uvicorn listens
            print(f"tokenselect: warming up on a {len(warm_up):,}-token prompt before listening (--warm-up-tokens 0 "
                  f"skips it)", file=sys.stderr, flush=True)
            started = time.perf_counter()
            await asyncio.to_thread(llm.warm_up, warm_up)
            print(f"tokenselect: warmed up in {time.perf_counter() - started:.1f} s ({len(warm_up)} prompt tokens)",
                  file=sys.stderr, flush=True)
        worker.thread.start()
        yield
        worker.stop(timeout=options.shutdown_timeout)
        tokenizing.shutdown(wait=False, cancel_futures=True)

    docs = {} if options.enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="tokenselect", lifespan=lifespan, **docs)
    app.add_middleware(Guard, options=options)
    app.state.worker, app.state.options = worker, options

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(400, f"malformed JSON body: {first['msg']}", code="invalid_json").response()
        # the path after "body"; a union member's tag ("str", "list[int]") ends it
        loc = itertools.takewhile(lambda part: not (isinstance(part, str) and UNION_TAG.fullmatch(part)),
                                  first["loc"][1:])
        param = ".".join(map(str, loc)) or None
        return APIError(400, f"{param or 'body'}: {first['msg']}", param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return internal_error().response()

    async def run(request: Request, body: _Request, prompt, kind: str):
        if body.model is not None and body.model != name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        check_fields(body, options)
        check_policy_settings(llm.attention, body.policy or {}, options.max_model_len)
        if waiting >= options.max_queued_requests:
            raise APIError(429, f"{waiting} requests are waiting already (--max-queued-requests); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(options.retry_after)})
        job = Job(body.sampling(), asyncio.get_running_loop(), policy=body.policy,
                  gone=asyncio.ensure_future(wait_for_disconnect(request)))
        try:
            return await answer(job, body, prompt, kind)
        except ClientGone:  # its job was aborted on the way out of ``snapshots``
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            job.gone.cancel()
            job.gone = None

    async def answer(job: Job, body: _Request, prompt, kind: str):
        nonlocal waiting
        waiting += 1
        try:
            job.ids = await job.loop.run_in_executor(tokenizing, prompt_ids, llm, tokenizer, prompt,
                                                     job.params.max_tokens, options)
            if job.gone.done():  # it left while its prompt was tokenized: it never reaches the engine
                raise ClientGone
            worker.submit(job)
            events = snapshots(worker, job)
            try:
                first = await events.__anext__()  # a refused request raises here, before any response
            except BaseException:
                await events.aclose()
                raise
        finally:
            waiting -= 1
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(sse(rid, kind, first, events, job.params), media_type="text/event-stream")
        last, logprobs = first, list(first.logprobs)
        try:
            async for last in events:
                logprobs += last.logprobs
        finally:
            await events.aclose()
        return response(rid, kind, last, logprobs if job.params.logprobs is not None else None)

    def envelope(rid: str, kind: str, choice: dict, usage: Snapshot | None = None) -> dict:
        obj = {"id": rid, "object": ("chat.completion" if kind == "chat" else "text_completion"),
               "created": int(time.time()), "model": name, "choices": [{"index": 0, **choice}]}
        if usage is not None:
            obj["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
        return obj

    def logprobs_object(kind: str, entries: list | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs of ``entries`` (``Snapshot.logprobs``): chat's ``content`` list, or the
        completions' parallel lists with each token's character offset from ``offset``."""
        if entries is None:
            return None
        if kind == "chat":
            def item(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
            return {"content": [{**item(text, logprob), "top_logprobs": [item(*alt) for alt in top]}
                                for text, logprob, top in entries]}
        offsets = list(itertools.accumulate((len(text) for text, _, _ in entries), initial=offset))[:-1]
        return {"tokens": [text for text, _, _ in entries], "token_logprobs": [logprob for _, logprob, _ in entries],
                "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}

    def response(rid: str, kind: str, snap: Snapshot, logprobs: list | None) -> dict:
        body = {"message": {"role": "assistant", "content": snap.text}} if kind == "chat" else {"text": snap.text}
        return envelope(rid, kind, {**body, "logprobs": logprobs_object(kind, logprobs),
                                    "finish_reason": snap.finish_reason}, snap)

    async def sse(rid: str, kind: str, first: Snapshot, events, params: SamplingParams):
        """Text deltas as ``data: {chunk}`` events; the last chunk carries finish_reason and usage. With
        logprobs, a chunk carries those of the tokens generated since the previous chunk (a chunk's text
        and its tokens may differ by a held-back tail)."""
        stops, pending = params.stop, []  # pending: logprob entries not sent yet

        def chunk(text: str, finish: str | None, usage: Snapshot | None = None, role: bool = False) -> str:
            logprobs = logprobs_object(kind, list(pending) if params.logprobs is not None and not role else None,
                                       len(sent))
            pending.clear()
            body = ({"delta": {"role": "assistant", "content": text} if role else {"content": text}}
                    if kind == "chat" else {"text": text})
            obj = envelope(rid, kind, {**body, "logprobs": logprobs, "finish_reason": finish}, usage)
            if kind == "chat":
                obj["object"] = "chat.completion.chunk"
            return f"data: {json.dumps(obj)}\n\n"

        sent = ""
        try:
            if kind == "chat":
                yield chunk("", None, role=True)
            snap = first
            while True:
                pending += snap.logprobs
                final = snap.finish_reason is not None
                text = snap.text if final else stable_prefix(snap.text, stops)
                if text.startswith(sent) and (len(text) > len(sent) or final):
                    yield chunk(text[len(sent):], snap.finish_reason, snap if final else None)
                    sent = text
                if final:
                    break
                snap = await events.__anext__()
        except APIError as e:  # the engine failed mid-stream: tell the client in the stream itself
            yield f"data: {json.dumps(e.body())}\n\n"
        else:
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        if not body.prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return await run(request, body, body.prompt, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        if not body.messages:
            raise APIError(400, "messages is empty", param="messages")
        return await run(request, body, body.messages, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "tokenselect", "max_model_len": options.max_model_len}]}

    @app.get("/health")
    async def health():
        """200 while the server can take requests; 503, with the reason, while it cannot."""
        reason = worker.unavailable() or (waiting >= options.max_queued_requests
                                          and f"{waiting} requests are waiting: the queue is full")
        body = {"status": "unavailable" if reason else "ok", "model": name, "running": len(worker.jobs),
                "waiting": waiting, **llm.stats()}
        if reason:
            body["reason"] = reason
        return JSONResponse(body, status_code=503 if reason else 200)

    return app


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """uvicorn's configuration for an app of ``create_app``: on shutdown, running requests get the app's
    ``shutdown_timeout`` to finish, then they are cancelled (aborted)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=app.state.options.shutdown_timeout)


# ---- the command --------------------------------------------------------------------------------


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (as uvicorn binds one), taken before the model loads, so that an address
    in use is told at once rather than after minutes of loading and warming up; OSError saying which address."""
    # uvicorn's rule (``Config.bind_socket``): IPv6 for an address with a colon, else IPv4 (so "localhost" is
    # 127.0.0.1, as a client expects, wherever the resolver lists ::1 first)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(llm, args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """``tokenselect serve``: serve ``llm`` (built by the CLI from ``args``) until interrupted, on ``sock``
    (``listening_socket``; None: bound now to --host and --port)."""
    if llm.tokenizer is None:
        raise TokenSelectError("the server needs a checkpoint with a tokenizer")
    options = ServerOptions.from_args(args)
    print(f"tokenselect: {llm.summary()}", file=sys.stderr, flush=True)
    if "*" in (options.allowed_hosts or ()):
        log.warning("listening on %s with any Host header accepted: pass --allowed-hosts to guard against "
                    "DNS rebinding", args.host)
    sock = sock or listening_socket(args.host, args.port)
    config = uvicorn_config(create_app(llm, args.served_model_name, options), args.host, args.port)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
