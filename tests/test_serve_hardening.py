"""The server's defences, one test per defect they fix: inputs that used to give a 500, parameters
and bodies it cannot honour, redirects built from the Host header, work nobody waits for (a client
gone while queued or while answered, a request past its deadline), what a queue holds, slow clients
and connection floods."""

import json
import socket
import threading
import time

import pytest

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from test_serve import metric_samples  # noqa: E402

from litevlm import Pipeline  # noqa: E402
from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.pipeline import STAGES, Answer, Delta  # noqa: E402
from litevlm.serve import ServerThread, build_app, image_data_url, user_message  # noqa: E402

QUESTION = "Is there a red car to the front of the ego car?"


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(5, 0), size=(160, 90))


@pytest.fixture(scope="module")
def urls(images):
    return {c: image_data_url(im) for c, im in images.items()}


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, images):
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=4)
    pipe.answer(QUESTION, images)  # warm-up (a first answer may build native kernels): not within a deadline
    with ServerThread(build_app(pipe, model_name="tiny", max_queue=4, timeout_s=30)) as server:
        yield server


def post_raw(server, body: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)


# ------------------------------------------------------------------------------------------------
# Inputs that gave a 500
# ------------------------------------------------------------------------------------------------
def _with_surrogate(urls, where: str) -> dict:
    message = user_message(QUESTION, urls)
    if where == "role":
        message["role"] = "\ud800"
    elif where == "content string":
        message = {"role": "user", "content": "\ud800 " + QUESTION}
    elif where == "question":
        message["content"][0]["text"] = QUESTION + " \udfff"
    elif where == "camera label":
        message["content"][1]["text"] = "CAM_FRONT\ud800"
    return {"model": "tiny", "messages": [message]}


@pytest.mark.parametrize("where", ["role", "content string", "question", "camera label"])
def test_a_lone_surrogate_gets_a_400_whose_body_is_valid_json(tiny_server, urls, where):
    body = json.dumps(_with_surrogate(urls, where)).encode()  # ensure_ascii: the surrogate travels as \ud800
    assert b"\\ud800" in body or b"\\udfff" in body
    r = post_raw(tiny_server, body)
    assert r.status_code == 400
    err = json.loads(r.content.decode("utf-8"))["error"]  # strict UTF-8: the body itself is valid
    assert err["code"] == "invalid_unicode" and "surrogate" in err["message"] and err["param"].startswith("messages")


@pytest.mark.parametrize(
    "text", ["car \u0000 ahead?", "car \uffff?", "car \U0001f600?", "\u202ecar?", "\ufeffcar?", "\u0301"]
)
def test_any_character_json_can_carry_is_answered(tiny_server, urls, text):
    """NUL, a noncharacter, an astral emoji, a right-to-left override, a BOM, a lone combining mark: valid
    Unicode, so a question like any other."""
    message = user_message(text, urls)
    r = post_raw(tiny_server, json.dumps({"model": "tiny", "messages": [message]}).encode())
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_outside_the_samplers_range_gets_a_400(tiny_server, urls, seed):
    body = {"model": "tiny", "messages": [user_message(QUESTION, urls)], "seed": seed}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert r.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_the_samplers_extreme_seeds_are_answered(tiny_server, urls, seed):
    body = {"model": "tiny", "messages": [user_message(QUESTION, urls)], "seed": seed, "temperature": 1.0}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_an_unexpected_pipeline_error_is_a_500_with_a_json_body(urls):
    class Broken(StepPipe):
        def stream(self, question, images):
            raise ZeroDivisionError("a bug")
            yield  # a generator

    with ServerThread(build_app(Broken(), timeout_s=10)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(urls), timeout=30)
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "internal server error: ZeroDivisionError",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        assert httpx.get(server.url + "/health").json()["in_flight"] == 0


# ------------------------------------------------------------------------------------------------
# What the pipeline cannot honour, bodies that are not JSON, redirects
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, value",
    [("logit_bias", {"42": 5}), ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("top_logprobs", 3)],
)
def test_parameters_the_pipeline_cannot_honour_are_refused_by_name(tiny_server, urls, name, value):
    body = {"model": "tiny", "messages": [user_message(QUESTION, urls)], name: value}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unsupported_parameter" and err["param"] == name
    assert f"`{name}`" in err["message"]


def test_neutral_values_of_those_parameters_ask_for_nothing(tiny_server, urls):
    body = {"model": "tiny", "messages": [user_message(QUESTION, urls)]}
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "stop": []}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json={**body, **neutral}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "headers",
    [{"content-type": "text/plain"}, {}, {"content-type": "application/json", "content-encoding": "gzip"}],
    ids=["text/plain", "no content-type", "gzip over plain bytes"],
)
def test_a_body_not_declared_as_plain_json_gets_415(tiny_server, urls, headers):
    body = json.dumps({"model": "tiny", "messages": [user_message(QUESTION, urls)]}).encode()
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_no_redirect_is_built_from_the_host_header(tiny_server, method):
    r = httpx.request(
        method, tiny_server.url + "/v1/chat/completions/", headers={"Host": "evil.example"}, follow_redirects=False
    )
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["code"] == "not_found"


# ------------------------------------------------------------------------------------------------
# Work nobody waits for, with a stub pipeline whose steps the test releases one at a time
# ------------------------------------------------------------------------------------------------
class StepPipe:
    """Looks like a Pipeline to the server. `stream` makes one token per permit released on `steps`."""

    name = "stub"
    max_new_tokens, temperature, top_p = 8, 0.0, 1.0

    def __init__(self, n_tokens: int = 4):
        import torch

        self.generator = torch.Generator()
        self.steps = threading.Semaphore(0)
        self.n_tokens = n_tokens
        self.started = self.made = 0
        self.closed = False

    def stream(self, question, images):
        assert all(isinstance(raw, bytes) for raw in images.values())  # the pipeline decodes the views it needs
        self.started += 1
        try:
            for i in range(self.n_tokens):
                assert self.steps.acquire(timeout=20), "the test never released this step"
                self.made += 1
                yield Delta(f" w{i}" if i else "w0", [i])
        except GeneratorExit:
            self.closed = True
            raise
        text = " ".join(f"w{i}" for i in range(self.n_tokens))
        yield Answer(text, list(CAMERAS), 0, {s: 0.0 for s in (*STAGES, "total")}, tokens=list(range(self.n_tokens)))


def chat(urls, **extra) -> dict:
    return {"model": "stub", "messages": [user_message(QUESTION, urls)], **extra}


def wait_for(cond, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def open_request(server, body: dict) -> socket.socket:
    """A request sent whole over a raw socket whose answer is never read (the test closes it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection((server.host, server.port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def samples(server) -> dict:
    return metric_samples(httpx.get(server.url + "/metrics").text)


def cancelled(server, reason: str, where: str) -> float:
    return samples(server).get(("litevlm_cancelled_requests_total", (("reason", reason), ("where", where))), 0)


def statuses(server) -> dict:
    return {
        dict(k[1])["status"]: v
        for k, v in samples(server).items()
        if k[0] == "litevlm_requests_total" and dict(k[1])["endpoint"] == "/v1/chat/completions"
    }


def test_a_request_whose_client_left_while_queued_is_never_decoded_nor_run(urls):
    pipe = StepPipe()
    app = build_app(pipe, max_queue=4, timeout_s=30)
    with ServerThread(app) as server:
        out = {}
        first = threading.Thread(
            target=lambda: out.update(r=httpx.post(server.url + "/v1/chat/completions", json=chat(urls), timeout=30))
        )
        first.start()
        wait_for(lambda: pipe.started == 1)  # the first request holds the model
        gone = open_request(server, chat(urls))
        wait_for(lambda: app.state.worker.pending == 2)
        gone.close()
        wait_for(lambda: statuses(server).get("499") == 1)  # its handler answered at once, nobody read it
        for _ in range(pipe.n_tokens):
            pipe.steps.release()
        first.join()
        wait_for(lambda: app.state.worker.pending == 0)
        assert out["r"].status_code == 200
        assert pipe.started == 1 and app.state.worker.started == 1  # the second never ran: nothing of it decoded
        assert cancelled(server, "disconnected", "queued") == 1
        assert statuses(server) == {"200": 1, "499": 1}


def test_a_running_request_whose_client_left_stops_at_the_next_step(urls):
    pipe = StepPipe(n_tokens=50)
    app = build_app(pipe, timeout_s=30)
    with ServerThread(app) as server:
        gone = open_request(server, chat(urls))
        pipe.steps.release()
        wait_for(lambda: pipe.made == 1)
        gone.close()
        wait_for(lambda: statuses(server).get("499") == 1)
        for _ in range(pipe.n_tokens):
            pipe.steps.release()
        wait_for(lambda: app.state.worker.pending == 0)
        # The step under way when the disconnect was seen may finish (the model thread checks between steps);
        # no later one starts, and the pipeline's stream is closed.
        assert pipe.made in (1, 2) and pipe.closed
        assert cancelled(server, "disconnected", "running") == 1


def test_a_streaming_client_that_leaves_stops_the_work_at_the_next_step(urls):
    pipe = StepPipe(n_tokens=50)
    app = build_app(pipe, timeout_s=30)
    with ServerThread(app) as server:
        gone = open_request(server, chat(urls, stream=True))
        wait_for(lambda: app.state.worker.jobs)
        (job,) = app.state.worker.jobs
        pipe.steps.release()
        gone.settimeout(20)
        received = b""
        while b'"content":"w0"' not in received:  # the first token's chunk has reached the client
            received += gone.recv(65536)
        gone.close()
        wait_for(job.cancel.is_set)
        for _ in range(pipe.n_tokens):
            pipe.steps.release()
        wait_for(lambda: app.state.worker.pending == 0)
        assert pipe.made in (1, 2) and pipe.closed  # as above: at most the step under way finishes
        assert cancelled(server, "disconnected", "running") == 1


def test_after_a_504_the_work_is_dropped_and_health_shows_it_until_it_is(urls):
    pipe = StepPipe(n_tokens=50)
    app = build_app(pipe, max_queue=4, timeout_s=2.0)
    with ServerThread(app) as server:
        out = {}

        def post(i):
            out[i] = httpx.post(server.url + "/v1/chat/completions", json=chat(urls), timeout=30)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [out[i].status_code for i in range(2)] == [504, 504]
        assert out[0].json()["error"]["code"] == "timeout"
        # The model thread is still inside the first request (waiting for a step): both are still in flight.
        assert httpx.get(server.url + "/health").json()["in_flight"] == 2
        for _ in range(pipe.n_tokens):
            pipe.steps.release()
        wait_for(lambda: app.state.worker.pending == 0)
        assert pipe.started == 1 and pipe.made == 1 and pipe.closed  # one step, then dropped
        assert app.state.worker.started == 1  # the queued one was never decoded
        assert cancelled(server, "deadline", "running") == 1 and cancelled(server, "deadline", "queued") == 1
        assert statuses(server) == {"504": 2}

        # The next request is answered normally, with nothing left over from the others.
        pipe.n_tokens = 3
        for _ in range(3):
            pipe.steps.release()
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(urls), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "w0 w1 w2"


def test_queued_requests_hold_their_images_as_the_bytes_they_came_with(urls):
    """Six 2400x2400 PNGs compress to a few KB each; decoded they are 17 MB each. A queue of them must
    hold the bytes, so its memory is bounded by the queue length times the body limit."""
    from PIL import Image

    big = {c: image_data_url(Image.new("RGB", (2400, 2400), (i * 40, 90, 160))) for i, c in enumerate(CAMERAS)}
    pipe = StepPipe(n_tokens=1)
    limit = 2**20
    app = build_app(pipe, max_queue=4, timeout_s=30, max_body_bytes=limit, max_image_pixels=2400 * 2400)
    worker = app.state.worker
    with ServerThread(app) as server:
        out = {}

        def post(i):
            out[i] = httpx.post(server.url + "/v1/chat/completions", json=chat(big), timeout=30)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        wait_for(lambda: worker.pending == 5 and pipe.started == 1)
        queued = [job for job in worker.jobs if not job.started]
        assert len(queued) == 4 and worker.started == 1
        for job in queued:
            assert all(isinstance(raw, bytes) for raw in job.req.images.values())
            assert sum(len(raw) for raw in job.req.images.values()) <= limit
        for _ in range(5):
            pipe.steps.release()
        for t in threads:
            t.join()
        assert [out[i].status_code for i in range(5)] == [200] * 5 and worker.started == 5


# ------------------------------------------------------------------------------------------------
# Slow clients and connection floods
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(urls):
    pipe = StepPipe(n_tokens=1)
    app = build_app(pipe, timeout_s=30, header_timeout_s=1.0, body_timeout_s=1.0, max_connections=8)
    with ServerThread(app) as server:
        yield server, pipe


def read_until_closed(s: socket.socket, timeout_s: float = 20.0) -> bytes:
    """Everything the server sends until it closes the connection (a test failure after `timeout_s`)."""
    s.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"], ids=["nothing", "partial"]
)
def test_headers_that_do_not_arrive_in_time_get_408_and_a_closed_connection(guarded, sent):
    server, _ = guarded
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(sent)
        reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "header_timeout"


def test_a_body_that_does_not_arrive_in_time_gets_408(guarded):
    server, _ = guarded
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


def test_connections_beyond_the_cap_are_closed_and_idle_ones_expire(guarded, urls):
    server, pipe = guarded
    held = [socket.create_connection((server.host, server.port)) for _ in range(8)]
    extra = [socket.create_connection((server.host, server.port)) for _ in range(40)]
    try:
        for s in extra:
            assert read_until_closed(s) == b""  # closed on accept, before a byte was read
        for s in held:  # the header timeout frees the held ones
            assert read_until_closed(s).startswith(b"HTTP/1.1 408 ")
    finally:
        for s in held + extra:
            s.close()
    pipe.steps.release()
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(urls), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "w0"
