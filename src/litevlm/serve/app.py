"""The FastAPI app: routes, body reading, responses (JSON and server-sent events), error rendering."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

from litevlm.cameras import CAMERAS
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
    ModelCard,
    ModelList,
    StreamChoice,
    Usage,
    short,
)
from litevlm.serve.worker import Job, Worker

if TYPE_CHECKING:
    from fastapi import FastAPI

ENDPOINTS = ("/v1/chat/completions", "/v1/models", "/health", "/metrics")
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
    from starlette.requests import ClientDisconnect

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
# The application
# ------------------------------------------------------------------------------------------------
class CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status (unknown paths as 'other')."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED  # no response started: the client left first

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(endpoint, status)


def build_app(
    pipe,
    *,
    model_name: str | None = None,
    max_queue: int = 16,
    timeout_s: float = 60.0,
    max_body_bytes: int = 32 * 2**20,
    max_image_pixels: int = 3200 * 1800,
    max_images: int = len(CAMERAS),
    max_prompt_chars: int = 4000,
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
    max_connections: int = 256,
) -> FastAPI:
    """The FastAPI app serving `pipe` (a litevlm Pipeline) under the model id `model_name` (default: pipe.name).

    The connection limits (`header_timeout_s`, `max_connections`) are kept on `app.state.limits` for
    the HTTP server that runs the app (`ServerThread`, `run_server`)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = Limits(
        max_queue=max_queue,
        timeout_s=timeout_s,
        max_body_bytes=max_body_bytes,
        max_image_pixels=max_image_pixels,
        max_images=max_images,
        max_prompt_chars=max_prompt_chars,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        max_connections=max_connections,
    )
    model_name = model_name or getattr(pipe, "name", None) or "litevlm"
    worker = Worker(pipe, limits)
    metrics = worker.metrics = Metrics(lambda: worker.pending, limits.max_queue)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="litevlm", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # a redirect would be built from the client's Host header
    app.state.metrics, app.state.limits, app.state.model_name, app.state.worker = metrics, limits, model_name, worker
    app.add_middleware(CountRequests, metrics=metrics)

    def json_response(model, status: int = 200) -> Response:
        return Response(model.model_dump_json(), status_code=status, media_type="application/json")

    def error_response(err: APIError) -> Response:
        return Response(err.json_bytes(), status_code=err.status, headers=err.headers, media_type="application/json")

    @app.exception_handler(APIError)
    async def on_api_error(request, err: APIError):
        metrics.count_error(err.code)
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, err):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        msg = f"{request.method} {short(request.url.path)}: {err.detail}"
        return error_response(APIError(err.status_code, msg, code=code, headers=dict(err.headers or {})))

    @app.exception_handler(Exception)
    async def on_bug(request, err):
        metrics.count_error("internal_error")
        return error_response(APIError(500, f"internal server error: {type(err).__name__}", code="internal_error"))

    async def answer_events(job: Job):
        """The job's events until its Answer; a 504 when its deadline passes first."""
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
                    f"no answer within the server's {limits.timeout_s:g} s timeout; the server is overloaded "
                    "or the request is too large",
                    code="timeout",
                )
            if kind == "error":
                if isinstance(value, LiteVLMError):  # the pipeline refused the input (e.g. an image it cannot use)
                    raise APIError(400, str(value), code="invalid_request", param="messages")
                raise value
            yield kind, value
            if kind == "done":
                return

    async def chat_completions(request):
        arrived = time.monotonic()
        check_content_type(request.headers)
        body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
        # Shed load before parsing: under overload a 429 must cost next to nothing. (Admission is
        # checked again after parsing, when the slot is taken.)
        worker.check_capacity()
        check = getattr(pipe, "check_question", None)
        req = await asyncio.to_thread(
            parse_chat_request, body, model_name=model_name, limits=limits, check_question=check
        )
        job = worker.submit(req, arrived)
        if req.stream:
            return await stream(job, req)
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            async for kind, ans in answer_events(job):
                pass
        finally:
            watcher.cancel()
        metrics.request_latency.observe(time.monotonic() - arrived)
        return json_response(completion(pipe, model_name, ans, job))

    async def stream(job: Job, req: ChatRequest):
        """SSE as the model makes the text. Errors before the first piece are plain JSON errors; once
        streaming, a disconnect (Starlette cancels this generator) drops the job."""
        chunks = Chunks(model_name, req.include_usage)
        events = answer_events(job)
        first = await events.__anext__()  # raises APIError before any byte is sent

        async def send():
            try:
                yield chunks.delta(role="assistant", content="")
                kind, value = first
                async for kind, value in _chain(first, events):
                    if kind == "delta":
                        yield chunks.delta(content=value)
                for event in chunks.final(pipe, value, job):
                    yield event
                metrics.request_latency.observe(time.monotonic() - job.arrived)
            except APIError as e:  # a deadline passed mid-stream: the client gets an error event
                metrics.count_error(e.code)
                yield f"data: {e.json_bytes().decode()}\n\n"
            finally:
                if not job.finished:
                    job.drop("disconnected")

        return StreamingResponse(send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def list_models(request):
        return json_response(ModelList(data=[ModelCard(id=model_name, created=created)]))

    async def get_model(request):
        model_id = request.path_params["model_id"]
        if model_id != model_name:
            raise APIError(
                404,
                f"the model {short(model_id)!r} does not exist; this server serves {model_name!r}",
                code="model_not_found",
                param="model",
            )
        return json_response(ModelCard(id=model_name, created=created))

    async def health(request):
        from fastapi.responses import JSONResponse

        status = {
            "status": "ok",
            "model": model_name,
            "in_flight": worker.pending,
            "max_queue": limits.max_queue,
            "timeout_s": limits.timeout_s,
        }
        return JSONResponse(status)

    async def prometheus(request):
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", prometheus, methods=["GET"])
    return app


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item
