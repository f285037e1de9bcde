"""Running the app under uvicorn, with the connection bounds uvicorn does not offer itself.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) and the size of a request's
headers (`h11_max_incomplete_event_size`), but it has no timeout for a request's headers to arrive
and no cap on open connections (`limit_concurrency` answers 503 yet still accepts and holds every
connection). `guarded_protocol` adds both to uvicorn's h11 protocol: a connection whose request
headers are not complete `header_timeout_s` after it opened (or after its previous response) gets a
408 and is closed, and a connection beyond `max_connections` is closed on accept. The body read
timeout lives in the app (`read_body`: a 408 once `body_timeout_s` has passed).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from litevlm.serve.limits import Limits

_TIMEOUT_BODY = (
    b'{"error":{"message":"the request headers did not arrive in time","type":"timeout_error",'
    b'"param":null,"code":"header_timeout"}}'
)
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)
KEEP_ALIVE_S = 5
MAX_HEADER_BYTES = 64 * 1024


def guarded_protocol(limits: Limits):
    """uvicorn's h11 protocol with a header read timeout and a cap on open connections (see the module doc)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.abort()  # over the cap: closed before a byte is read
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # the next request on this connection gets its own header deadline
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE:  # not in the middle of answering a pipelined request
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, **kwargs):
    """A uvicorn Config for `app` (built by `build_app`) with the bounds of its `app.state.limits`."""
    import uvicorn

    limits: Limits = app.state.limits
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        timeout_keep_alive=min(KEEP_ALIVE_S, limits.header_timeout_s),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **kwargs,
    )


class ServerThread:
    """A uvicorn server for `app` on a background thread, on a free 127.0.0.1 port (tests, benchmarks).

    with ServerThread(build_app(pipe)) as server:
        httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.server = self.thread = self.sock = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        import uvicorn

        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it
        # every response waits for a delayed ACK (Nagle) between its header and body writes.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, self.port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="litevlm-serve"
        )
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self.sock.close()
            self.server = None

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(app, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` until interrupted."""
    import uvicorn

    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level)).run()
