"""The FastAPI app: its routes, error rendering and request counting."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from litevlm.cameras import CAMERAS
from litevlm.serve.chat import CLIENT_CLOSED, ChatCompletions
from litevlm.serve.metrics import Metrics
from litevlm.serve.parse import Limits
from litevlm.serve.protocol import APIError, ModelCard, ModelList, short
from litevlm.serve.worker import Worker

if TYPE_CHECKING:
    from fastapi import FastAPI

ENDPOINTS = ("/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")


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
    max_batch: int = 8,
    view_cache_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `pipe` (a litevlm Pipeline) under the model id `model_name` (default: pipe.name).

    The connection limits (`header_timeout_s`, `max_connections`) are kept on `app.state.limits` for
    the HTTP server that runs the app (`ServerThread`, `run_server`). `view_cache_bytes` gives the pipeline a view
    cache of that bound (`litevlm.frame.ViewCache`: a frame sent again is not decoded nor encoded again; 0: none);
    None leaves the pipeline's own as it is."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
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
        max_batch=max_batch,
    )
    model_name = model_name or getattr(pipe, "name", None) or "litevlm"
    if view_cache_bytes is not None:
        from litevlm.frame import ViewCache

        pipe.view_cache = ViewCache(view_cache_bytes) if view_cache_bytes > 0 else None
    # The cache is read from the pipeline at each /metrics: `rebuild` clears it, a caller may replace it.
    metrics = Metrics(
        lambda: worker.pending,
        limits.max_queue,
        lambda: getattr(pipe, "view_cache", None),
        batch=lambda: worker.batch_live,
        waiting=lambda: worker.waiting.qsize(),
    )
    worker = Worker(pipe, limits, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

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
        status = {
            "status": "ok",
            "model": model_name,
            "in_flight": worker.pending,
            "max_queue": limits.max_queue,
            "timeout_s": limits.timeout_s,
        }
        return JSONResponse(status)

    # A pipeline built without its warm-up answer (`litevlm serve` builds it so, to be alive at once) warms up as the
    # worker's first job: requests queue behind it, and /ready says so until it is done.
    warming = None if getattr(pipe, "warmed", True) else worker.executor.submit(pipe.warmup)

    async def ready(request):
        """Ready for traffic once the pipeline's setup, its warm-up answer included, is done (503 before)."""
        if warming is not None and not warming.done():
            return JSONResponse({"status": "warming up", "model": model_name}, status_code=503)
        failed = warming.exception() if warming is not None else None
        if failed is not None:
            return JSONResponse({"status": "failed", "model": model_name, "error": str(failed)}, status_code=503)
        setup = getattr(pipe, "setup_ms", None)
        return JSONResponse({"status": "ready", "model": model_name, "setup_ms": setup and round(setup, 1)})

    async def prometheus(request):
        return Response(metrics.render(), media_type=metrics.content_type)

    chat = ChatCompletions(pipe, model_name, limits, worker, metrics)
    app.add_route("/v1/chat/completions", chat.handle, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/ready", ready, methods=["GET"])
    app.add_route("/metrics", prometheus, methods=["GET"])
    return app
