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

Errors a client causes get OpenAI's error object, ``{"error": {"message", "type", "param",
"code"}}``, with a 4xx status; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from .errors import TokenSelectError
from .policies import policy_settings
from .sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; used for chat too
POLICY_OVERRIDES = ("k", "n_local", "theta")  # per-request settings the ``policy`` field may name
log = logging.getLogger("tokenselect.server")
# how pydantic names a union member in an error
UNION_TAG = re.compile(r"(constrained-)?(str|int|float|bool)|\w+\[.*\]")


# ---- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    """A request the server refuses, as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- request bodies -----------------------------------------------------------------------------

Number = Union[StrictInt, StrictFloat]
StopString = Annotated[StrictStr, Field(min_length=1)]


class _Request(BaseModel):
    """Fields shared by both endpoints. Unknown OpenAI fields (logprobs, user, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    stop: StopString | list[StopString] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)
    ignore_eos: StrictBool = False  # a vLLM extension (extra_body): generate max_tokens whatever comes
    policy: dict[StrictStr, Number] | None = None  # per-request k / n_local / theta (extra_body)

    def sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens or DEFAULT_MAX_TOKENS, temperature=float(self.temperature),
                              top_p=float(self.top_p), top_k=self.top_k, stop=stop, seed=self.seed,
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr


class ChatRequest(_Request):
    messages: list[Message]


# ---- the engine thread --------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A sequence's state after a step: the text so far, its token counts, why it ended (or None)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


@dataclass
class Job:
    """One request as the engine thread sees it; the prompt is text, token ids or chat messages.
    ``events`` (on the event loop) receives a ``Snapshot`` after each step that gave it a token, or
    an ``APIError`` if it was refused or the engine failed."""

    prompt: str | list[int] | list[Message]  # messages are templated on the engine thread
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    policy: dict | None = None  # the request's own policy settings (k, n_local, theta)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: object = None

    def send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class EngineWorker:
    """Owns the LLM on one thread; ``submit`` and ``abort`` are safe to call from any thread."""

    def __init__(self, llm):
        self.llm = llm
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # sequence id -> job, for live sequences
        self.thread = threading.Thread(target=self._run, name="tokenselect-engine", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()

    def submit(self, job: Job) -> None:
        self.inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        self.inbox.put(("abort", job))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.llm.scheduler.has_work())
            if not self.llm.scheduler.has_work():
                continue
            try:
                stepped = self.llm.step()
            except Exception as e:  # an engine bug: fail the live requests, keep serving new ones
                log.exception("engine step failed; aborting %d live requests", len(self.jobs))
                self._fail_all(e)
                continue
            for seq in stepped:
                self._publish(seq)

    def _drain(self, block: bool) -> None:
        try:
            command, job = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
            while True:
                self._handle(command, job)
                command, job = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, command: str, job: Job) -> None:
        if command == "add":
            try:
                prompt = job.prompt
                if prompt and isinstance(prompt[0], Message):  # the tokenizer is used by this thread only
                    prompt = chat_prompt(self.llm.tokenizer, prompt)
                job.seq = self.llm.add_request(prompt, job.params, job.policy)
            except (TokenSelectError, ValueError) as e:
                job.send(APIError(400, str(e), param="prompt", code="context_length_exceeded"
                                  if isinstance(e, TokenSelectError) else None))
                return
            self.jobs[job.seq.id] = job
        elif job.seq is not None and not job.seq.finished:
            self.llm.abort(job.seq)
            self.jobs.pop(job.seq.id, None)

    def _publish(self, seq) -> None:
        job = self.jobs[seq.id]
        if seq.finished:
            del self.jobs[seq.id]
        job.send(Snapshot(seq.text, len(seq.prompt_ids), len(seq.output_ids), seq.finish_reason))

    def _fail_all(self, error: Exception) -> None:
        for job in self.jobs.values():
            self.llm.abort(job.seq)
            job.send(APIError(500, f"engine error: {error}", type="server_error"))
        self.jobs.clear()


# ---- text streaming -----------------------------------------------------------------------------


def stable_prefix(text: str, stops: list[str]) -> str:
    """The part of an unfinished text that later tokens cannot change: without a trailing partial
    UTF-8 character (decoded as U+FFFD) or a tail that may be the start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - hold]


async def snapshots(worker: EngineWorker, job: Job):
    """Yield the job's snapshots until it finishes; abort it if the consumer stops early."""
    done = False
    try:
        while not done:
            item = await job.events.get()
            if isinstance(item, APIError):
                raise item
            done = item.finish_reason is not None
            yield item
    finally:
        if not done:
            worker.abort(job)


# ---- the app ------------------------------------------------------------------------------------


def chat_prompt(tokenizer, messages: list[Message]) -> str:
    """The model's chat template; without one, ``role: content`` lines then ``assistant:``."""
    turns = [m.model_dump() for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def check_policy_settings(attention: str, settings: dict) -> None:
    """APIError 400 for a per-request policy setting the running policy does not take or a bad value."""
    accepted = policy_settings(attention)
    for key, value in settings.items():
        if key not in POLICY_OVERRIDES or key not in accepted:
            takes = [k for k in POLICY_OVERRIDES if k in accepted]
            raise APIError(400, f"policy setting {key!r} is not a per-request setting of the {attention!r} policy "
                           f"(it takes: {', '.join(takes) or 'none'})", param=f"policy.{key}")
        if key == "theta" and not -1 <= value <= 1:
            raise APIError(400, f"policy.theta must be a cosine similarity in [-1, 1], not {value}", param="policy.theta")
        if key != "theta" and (not isinstance(value, int) or value < 0):
            raise APIError(400, f"policy.{key} must be a whole number >= 0, not {value}", param=f"policy.{key}")


def create_app(llm, served_model_name: str | None = None):
    """The FastAPI app serving ``llm``. The engine thread runs while the app is up (lifespan)."""
    name = served_model_name or (llm.path.name if llm.path is not None else "tokenselect")
    created = int(time.time())
    worker = EngineWorker(llm)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="tokenselect", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        loc = []
        for part in first["loc"][1:]:  # after "body"; a union member's tag ("str", "list[int]") ends the path
            if isinstance(part, str) and UNION_TAG.fullmatch(part):
                break
            loc.append(str(part))
        if first["type"] == "json_invalid":
            return await api_error(request, APIError(400, f"malformed JSON body: {first['msg']}", code="invalid_json"))
        param = ".".join(loc) or None
        return await api_error(request, APIError(400, f"{param or 'body'}: {first['msg']}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await api_error(request, APIError(e.status_code, str(e.detail), type="invalid_request_error"))

    def check(body: _Request) -> None:
        if body.model is not None and body.model != name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        check_policy_settings(llm.attention, body.policy or {})

    async def run(request: Request, body: _Request, prompt, kind: str):
        check(body)
        params = body.sampling()
        job = Job(prompt, params, asyncio.get_running_loop(), body.policy)
        worker.submit(job)
        events = snapshots(worker, job)
        try:
            first = await events.__anext__()  # a refused request raises here, before any response
        except BaseException:
            await events.aclose()
            raise
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(sse(rid, kind, first, events, params.stop), media_type="text/event-stream")
        last = first
        try:
            async for last in events:
                if await request.is_disconnected():  # the client gave up: abort (in aclose below)
                    break
        finally:
            await events.aclose()
        return response(rid, kind, last)

    def envelope(rid: str, kind: str, choice: dict, usage: Snapshot | None = None) -> dict:
        obj = {"id": rid, "object": ("chat.completion" if kind == "chat" else "text_completion"),
               "created": int(time.time()), "model": name, "choices": [{"index": 0, **choice}]}
        if usage is not None:
            obj["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return obj

    def response(rid: str, kind: str, snap: Snapshot) -> dict:
        body = ({"message": {"role": "assistant", "content": snap.text}} if kind == "chat"
                else {"text": snap.text, "logprobs": None})
        return envelope(rid, kind, {**body, "finish_reason": snap.finish_reason}, snap)

    async def sse(rid: str, kind: str, first: Snapshot, events, stops: list[str]):
        """Text deltas as ``data: {chunk}`` events; the last chunk carries finish_reason and usage."""
        def chunk(text: str, finish: str | None, usage: Snapshot | None = None, role: bool = False) -> str:
            body = ({"delta": {"role": "assistant", "content": text} if role else {"content": text}}
                    if kind == "chat" else {"text": text, "logprobs": None})
            obj = envelope(rid, kind, {**body, "finish_reason": finish}, usage)
            if kind == "chat":
                obj["object"] = "chat.completion.chunk"
            return f"data: {json.dumps(obj)}\n\n"

        sent = ""
        try:
            if kind == "chat":
                yield chunk("", None, role=True)
            snap = first
            while True:
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
                                            "owned_by": "tokenselect", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "running": len(worker.jobs), **llm.stats()}

    return app


# ---- the command --------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    """``tokenselect serve``: load the model and serve it until interrupted."""
    import uvicorn

    from .cli import build_llm

    llm = build_llm(args)
    if llm.tokenizer is None:
        raise TokenSelectError("the server needs a checkpoint with a tokenizer")
    uvicorn.run(create_app(llm, args.served_model_name), host=args.host, port=args.port, log_level="info")
    return 0
