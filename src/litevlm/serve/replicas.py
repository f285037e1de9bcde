"""`litevlm serve --replicas N`: N copies of the server's app, one pipeline each, behind Ray Serve's HTTP proxy.

Two Ray Serve deployments. `Replica` (N copies, each on its own CPUs or GPU) builds its own pipeline
from the parsed options and the very app the one-process server runs (`build_app`), and runs each
HTTP request through that app in process, so every route, limit, refusal, streamed event and counter
is that app's. `Front` (one copy, no CPU reserved) is the ingress: it reads the body under the
server's body limits, passes the request to a replica through a Ray handle (Ray picks the less busy
of two), and plays the replica's ASGI messages back to the client as they come.

Why a front and not `@serve.ingress(app)`: under Ray's own ingress a replica that dies leaves its
requests a bare 500. Here a request whose replica is lost before it answered is retried on another
(answering has no side effects, so a retry is safe), or answered 503 with Retry-After
once its deadline has passed; one lost mid-stream ends its stream with an error event. Nothing waits
forever: every wait is bounded by the server's timeout. Differences from one process: connections
are Ray's proxy's (no header timeout or connection cap of ours), and `/metrics` and `/health` answer
for the replica that takes the request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import torch
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.responses import Response

from litevlm.errors import LiteVLMError
from litevlm.serve.chat import read_body
from litevlm.serve.limits import Limits
from litevlm.serve.protocol import APIError

logger = logging.getLogger("ray.serve")
APP_NAME = "litevlm"
# A lost replica's request waits this long before its retry: Ray needs a moment to stop routing to it.
RETRY_PAUSE_S = 0.2
# Past the server's timeout a replica answers 504 itself; the front waits this much longer for that answer.
DEADLINE_GRACE_S = 5.0
# Requests a replica may hold besides those its queue admits: /health, /metrics, and 429s being answered.
EXTRA_ONGOING = 8
# What a lost (or not yet replaced) replica raises at the caller.
LOST = (RayActorError, DeploymentUnavailableError, BackPressureError)
QUIET = {"enable_access_log": False, "log_level": "WARNING"}  # replicas log warnings and errors, not each request


@serve.deployment(logging_config=QUIET)
class Replica:
    """One pipeline and its app; `asgi` runs one HTTP request through the app and yields its ASGI messages."""

    def __init__(self, model: str, pipeline_options: dict, app_options: dict, threads: int):
        from litevlm.pipeline import Pipeline
        from litevlm.serve.app import build_app

        torch.set_num_threads(threads)
        self.app = build_app(Pipeline.from_pretrained(model, **pipeline_options), **app_options)

    async def asgi(self, scope: dict, body: bytes):
        """The app's ASGI messages for one request whose whole body is `body`. If the caller goes away
        (Ray cancels this generator), the app hears the client disconnect and drops the work."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(scope, receive, sent.put))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                yield message
            task.result()  # the app renders its own errors; anything raised here is a bug to surface
        finally:
            gone.set()

    def __del__(self):
        self.app.state.worker.close()


def _forwarded_scope(scope: dict) -> dict:
    """The parts of an HTTP request's ASGI scope the app reads (plain values: they travel to another process)."""
    keys = ("type", "http_version", "method", "scheme", "query_string", "client", "server")
    out = {k: scope[k] for k in keys if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    # the app is mounted at its own root: the route prefix the proxy matched is not part of its paths
    root, path = scope.get("root_path", ""), scope["path"]
    out["path"] = (path[len(root) :] or "/") if root and path.startswith(root) else path
    out["raw_path"] = out["path"].encode()
    out["asgi"], out["root_path"] = {"version": "3.0"}, ""
    return out


def _error(err: APIError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, headers=err.headers, media_type="application/json")


def _unavailable(why: str, retry_after_s: float) -> APIError:
    return APIError(
        503,
        f"{why}; retry after {retry_after_s:.0f} s",
        code="replica_unavailable",
        headers={"Retry-After": str(math.ceil(retry_after_s)), "retry-after-ms": str(int(retry_after_s * 1000))},
    )


@serve.deployment(logging_config=QUIET)
class Front:
    """The HTTP ingress: body limits, then a replica's answer relayed (see the module doc)."""

    def __init__(self, replica, limits: dict, retries: int):
        self.replica = replica.options(stream=True, method_name="asgi")
        self.limits = Limits(**limits)
        self.retries = retries

    async def __call__(self, request):
        arrived = time.monotonic()
        try:
            body = await read_body(request, self.limits.max_body_bytes, self.limits.body_timeout_s)
            head, rest = await self._first(_forwarded_scope(request.scope), body, arrived)
        except APIError as err:
            return _error(err)
        return Relay(head, rest)

    async def _first(self, scope: dict, body: bytes, arrived: float):
        """A replica's first messages for the request (the response start and first body chunk: a whole JSON
        answer, or a stream's first event) and the generator of the rest. A replica lost before that is
        replaced by another, up to `retries` times; past the deadline the request gets 503."""
        deadline = arrived + self.limits.timeout_s + DEADLINE_GRACE_S
        for attempt in range(self.retries + 1):
            rest = self.replica.remote(scope, body)
            try:
                head = await asyncio.wait_for(_head(rest), max(0.0, deadline - time.monotonic()))
                if head and head[-1]["type"] == "http.response.body":
                    return head, rest
                lost = "ended without a response"  # a replica stopped before its app sent a body
            except asyncio.TimeoutError:
                rest.cancel()
                raise _unavailable("no replica answered within the server's timeout", RETRY_PAUSE_S * 5) from None
            except LOST as e:
                lost = type(e).__name__
            rest.cancel()
            logger.warning(
                "a replica was lost before answering (%s); attempt %d of %d", lost, attempt + 1, self.retries + 1
            )
            if attempt == self.retries or time.monotonic() + RETRY_PAUSE_S > deadline:
                break
            await asyncio.sleep(RETRY_PAUSE_S)
        raise _unavailable("the replicas serving this request stopped", RETRY_PAUSE_S * 5)


async def _head(rest) -> list[dict]:
    """Messages up to the response start and the first body chunk (fewer if the stream ends first)."""
    head = []
    async for message in rest:
        head.append(message)
        if message["type"] == "http.response.body":
            return head
    return head


class Relay(Response):
    """A replica's response played back as its ASGI messages; a replica lost mid-stream ends the body with an
    error event (the status line, 200, is already sent)."""

    def __init__(self, head: list[dict], rest):
        self.head, self.rest = head, rest

    async def __call__(self, scope, receive, send):
        done = not self.head[-1].get("more_body", False)
        try:
            for message in self.head:
                await send(message)
            if done:
                return
            async for message in self.rest:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    done = True
        except Exception as e:  # the status line is sent: the stream ends with an error event instead
            if isinstance(e, LOST):
                err = _unavailable("the replica serving this stream stopped", RETRY_PAUSE_S * 5)
            else:
                logger.exception("relaying a replica's response failed")
                err = APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")
            await send({"type": "http.response.body", "body": b"data: " + err.json_bytes() + b"\n\n"})
            done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not done:  # the client left (Ray cancelled this task): the replica drops the work
                self.rest.cancel()


def deploy(
    model: str,
    pipeline_options: dict,
    app_options: dict,
    *,
    replicas: int,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = APP_NAME,
    route_prefix: str = "/",
) -> str:
    """Start Ray Serve's proxy on host:port (on the Ray instance `ray.init` joined) and deploy `replicas`
    copies of the app with `Front` before them, as the Serve application `name` at `route_prefix`; returns
    the server's URL. Each replica builds its own pipeline `Pipeline.from_pretrained(model,
    **pipeline_options)` on `cpus_per_replica` torch threads."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    limit_names = Limits.__dataclass_fields__
    limits = Limits(**{k: v for k, v in app_options.items() if k in limit_names})
    replica = Replica.options(
        num_replicas=replicas,
        max_ongoing_requests=limits.max_queue + 1 + EXTRA_ONGOING,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
    ).bind(model, pipeline_options, app_options, max(1, int(cpus_per_replica)))
    front = Front.options(
        num_replicas=1,
        max_ongoing_requests=limits.max_connections,
        ray_actor_options={"num_cpus": 0},
    ).bind(replica, {k: getattr(limits, k) for k in limit_names}, retries=replicas)
    serve.start(http_options={"host": host, "port": port})
    serve.run(front, name=name, route_prefix=route_prefix, blocking=False)
    return f"http://{host}:{port}" + route_prefix.rstrip("/")


def check_resources(replicas: int, cpus_per_replica: float, gpus_per_replica: float) -> None:
    """LiteVLMError unless the Ray instance has the CPUs and GPUs the replicas reserve (else they would wait
    for them forever)."""
    import ray

    have = ray.cluster_resources()
    for kind, per in (("CPU", cpus_per_replica), ("GPU", gpus_per_replica)):
        if replicas * per > have.get(kind, 0):
            raise LiteVLMError(
                f"serve: {replicas} replicas of {per:g} {kind} need {replicas * per:g} {kind}s; the Ray instance has "
                f"{have.get(kind, 0):g}: fewer --replicas, or less --{kind.lower()}s-per-replica"
            )


def serve_replicas(
    model: str,
    pipeline_options: dict,
    app_options: dict,
    *,
    replicas: int,
    address: str | None = None,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> None:
    """`litevlm serve --replicas N`: join the Ray cluster at `address` (default: start a new Ray instance on
    this machine), deploy, and serve until interrupted; then remove the app (and stop the Ray it started)."""
    import ray

    ray.init(address=address or "local", logging_level="warning")
    try:
        check_resources(replicas, cpus_per_replica, gpus_per_replica)
        url = deploy(
            model,
            pipeline_options,
            app_options,
            replicas=replicas,
            cpus_per_replica=cpus_per_replica,
            gpus_per_replica=gpus_per_replica,
            host=host,
            port=port,
        )
        print(f"litevlm serve: {replicas} replicas of {model!r} behind Ray Serve at {url}/v1", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(stop_serve=address is None)
        ray.shutdown()


def shutdown(stop_serve: bool = True, names: tuple[str, ...] = (APP_NAME,)) -> None:
    """Remove the apps; with stop_serve, stop Ray Serve as well (not on a shared cluster: other apps use it)."""
    for name in names:
        serve.delete(name)
    if stop_serve:
        serve.shutdown()
