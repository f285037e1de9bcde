"""POST /v1/chat/completions: the body read and checked, the request queued, the answer sent as
JSON or as server-sent events while the pipeline makes it. (Imported with the app: needs the
server's extra dependencies.)"""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from litevlm.errors import LiteVLMError
from litevlm.serve.metrics import Metrics
from litevlm.serve.parse import ChatRequest, Limits, parse_chat_request
from litevlm.serve.protocol import (
    APIError,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    Choice,
    DeltaMessage,
    StreamChoice,
    Usage,
    short,
)
from litevlm.serve.worker import Job, Worker

# Status recorded for a request whose client left before its answer (nginx's "client closed request").
CLIENT_CLOSED = 499


# ------------------------------------------------------------------------------------------------
# Reading the request
# ------------------------------------------------------------------------------------------------
def check_content_type(headers) -> None:
    """415 unless the body is declared plain JSON: `Content-Type: application/json` and no Content-Encoding."""
    kind = headers.get("content-type")
    if kind is None or kind.split(";", 1)[0].strip().lower() != "application/json":
        got = "no Content-Type" if kind is None else f"Content-Type {short(kind)!r}"
        raise APIError(415, f"the body must be JSON sent as application/json; got {got}", code="unsupported_media_type")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            415,
            f"Content-Encoding {short(encoding)!r} is not supported: send the body uncompressed",
            code="unsupported_media_type",
        )


async def read_body(request, limit: int, timeout_s: float) -> bytes:
    """The body, at most `limit` bytes (413), arrived whole within `timeout_s` (408)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, f"invalid Content-Length header {short(length)!r}", code="invalid_request")
        if int(length) > limit:
            raise APIError(413, f"the request body is {int(length)} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:  # nobody will read the answer
        raise APIError(
            CLIENT_CLOSED, "the client disconnected before sending the whole body", code="client_disconnected"
        ) from None
    return b"".join(chunks)


async def watch_disconnect(request, job: Job) -> None:
    """Drop `job` when the client goes (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.drop("disconnected")
            job.events.put_nowait(
                ("cancelled", "disconnected")
            )  # answer the handler now, not when the model gets there
            return


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------
def finish_reason(pipe, ans) -> str:
    eos = getattr(getattr(pipe, "tokenizer", None), "eos_id", None)
    return "stop" if eos in ans.tokens else "length"


def usage(ans) -> Usage:
    n = len(ans.tokens)
    return Usage(prompt_tokens=ans.input_tokens, completion_tokens=n, total_tokens=ans.input_tokens + n)


def extension(ans, job: Job) -> dict:
    ext = ans.to_dict()
    ext.pop("text", None)
    ext["queue_ms"] = round(job.queue_s * 1000, 3)
    return ext


def completion(pipe, model_name: str, ans, job: Job) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model_name,
        choices=[Choice(message=ChatMessage(content=ans.text), finish_reason=finish_reason(pipe, ans))],
        usage=usage(ans),
        litevlm=extension(ans, job),
    )


class Chunks:
    """Server-sent events of one streamed answer: a role chunk, content chunks, the final chunk (with the
    litevlm extension, and usage unless the client asked for it apart), a usage chunk, [DONE]."""

    def __init__(self, model_name: str, include_usage: bool):
        self.base = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name)
        self.include_usage = include_usage

    def event(self, **fields) -> str:
        chunk = ChatCompletionStreamResponse(**self.base, **fields)
        return f"data: {chunk.model_dump_json(exclude_none=False)}\n\n"

    def delta(self, **delta) -> str:
        return self.event(choices=[StreamChoice(delta=DeltaMessage(**delta))])

    def final(self, pipe, ans, job: Job) -> list[str]:
        choice = StreamChoice(delta=DeltaMessage(), finish_reason=finish_reason(pipe, ans))
        out = [
            self.event(choices=[choice], litevlm=extension(ans, job), usage=None if self.include_usage else usage(ans))
        ]
        if self.include_usage:
            out.append(self.event(choices=[], usage=usage(ans)))
        return [*out, "data: [DONE]\n\n"]


# ------------------------------------------------------------------------------------------------
# The route
# ------------------------------------------------------------------------------------------------
class ChatCompletions:
    """The chat-completions endpoint of one app: `handle` is its Starlette request handler."""

    def __init__(self, pipe, model_name: str, limits: Limits, worker: Worker, metrics: Metrics):
        self.pipe, self.model_name, self.limits, self.worker, self.metrics = pipe, model_name, limits, worker, metrics

    async def handle(self, request):
        arrived = time.monotonic()
        check_content_type(request.headers)
        body = await read_body(request, self.limits.max_body_bytes, self.limits.body_timeout_s)
        # Shed load before parsing: under overload a 429 must cost next to nothing. (Admission is
        # checked again after parsing, when the slot is taken.)
        self.worker.check_capacity()
        check = getattr(self.pipe, "check_question", None)
        req = await asyncio.to_thread(
            parse_chat_request, body, model_name=self.model_name, limits=self.limits, check_question=check
        )
        job = self.worker.submit(req, arrived)
        if req.stream:
            return await self.stream(job, req)
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            async for _, ans in self.events(job):
                pass
        finally:
            watcher.cancel()
        self.metrics.request_latency.observe(time.monotonic() - arrived)
        body = completion(self.pipe, self.model_name, ans, job).model_dump_json()
        return Response(body, media_type="application/json")

    async def events(self, job: Job):
        """The job's ("delta", text) events, then ("done", Answer); APIError for a deadline passed (504), a
        client gone (499), or input the pipeline refused (400)."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), max(0.0, job.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                kind, value = "cancelled", "deadline"
            if kind == "cancelled":
                job.drop(value)
                if value == "disconnected":
                    raise APIError(CLIENT_CLOSED, "the client disconnected", code="client_disconnected")
                raise APIError(
                    504,
                    f"no answer within the server's {self.limits.timeout_s:g} s timeout; the server is overloaded "
                    "or the request is too large",
                    code="timeout",
                )
            if kind == "error":
                if isinstance(value, LiteVLMError):  # the pipeline refused the input (e.g. an image it cannot use)
                    raise APIError(400, str(value), code="invalid_request", param="messages")
                raise value
            if kind == "done":
                job.answered = True
            yield kind, value
            if kind == "done":
                return

    async def stream(self, job: Job, req: ChatRequest):
        """SSE as the model makes the text. Errors before the first piece are plain JSON errors; once
        streaming, a disconnect (Starlette cancels the body's generator) drops the job."""
        chunks = Chunks(self.model_name, req.include_usage)
        events = self.events(job)
        first = await events.__anext__()  # raises APIError before any byte is sent

        async def send():
            try:
                yield chunks.delta(role="assistant", content="")
                async for kind, value in _chain(first, events):
                    if kind == "delta":
                        yield chunks.delta(content=value)
                for event in chunks.final(self.pipe, value, job):
                    yield event
                self.metrics.request_latency.observe(time.monotonic() - job.arrived)
            except APIError as e:  # a deadline passed mid-stream: the client gets an error event
                self.metrics.count_error(e.code)
                yield f"data: {e.json_bytes().decode()}\n\n"

        return DroppingStream(job, send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class DroppingStream(StreamingResponse):
    """A streamed response that drops its job when it ends before the answer did: Starlette stops sending
    when the client disconnects, wherever the body's generator happens to be."""

    def __init__(self, job: Job, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.answered:
                self.job.drop("disconnected")


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item
