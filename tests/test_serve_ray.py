"""`litevlm serve --replicas 2` on a local Ray instance: the same answers as the one-process server through the
openai client, and a replica killed under load loses no request (each gets 200 or 503 with Retry-After)."""

import json
import socket
import threading
import time

import pytest
import torch

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")
ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'litevlm[ray]'")
pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install 'litevlm[ray]'")
openai = pytest.importorskip("openai")

from litevlm import Pipeline  # noqa: E402
from litevlm.serve import ServerThread, build_app, image_data_url, user_message  # noqa: E402

MODEL, NEW_TOKENS = "drive-tiny", 8
QUESTIONS = (
    "Is there a red car to the front of the ego car?",
    "What are objects to the back left of the ego car?",
    "What should the ego vehicle do next?",
)
APP = {"model_name": MODEL, "max_queue": 32, "timeout_s": 60.0}


@pytest.fixture(scope="module")
def requests():
    """6 distinct chat requests: 2 frames x 3 questions."""
    from litevlm.data.synthetic import make_frame, render_views

    out = []
    for f in range(2):
        urls = {c: image_data_url(im) for c, im in render_views(make_frame(11, f), size=(160, 90)).items()}
        out += [[user_message(q, urls)] for q in QUESTIONS]
    return out


def _free_port() -> int:
    """A free port outside the kernel's ephemeral range (32768+) and Ray's worker ports (10002-19999): a port the
    kernel handed out and this test released could be taken by one of Ray's own processes before the proxy binds it
    (it failed CI once with "Failed to bind to address")."""
    import random

    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="module")
def replicas_url():
    """Two replicas of drive-tiny, one thread each, behind Ray Serve's proxy on a local two-CPU Ray instance."""
    from litevlm.serve import replicas

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    port = _free_port()
    try:
        yield replicas.deploy(MODEL, {"max_new_tokens": NEW_TOKENS}, APP, replicas=2, cpus_per_replica=1, port=port)
    finally:
        replicas.shutdown()
        ray.shutdown()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def _answers(client, requests) -> list:
    out = []
    for messages in requests:
        r = client.chat.completions.create(model=MODEL, messages=messages)
        pieces = client.chat.completions.create(model=MODEL, messages=messages, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        out.append((r.choices[0].message.content, r.model_extra["litevlm"]["views"], streamed))
    return out


def _refusals(url: str, messages) -> list:
    bad = [
        {"model": "nope", "messages": messages},  # an unknown model: 404
        {"model": MODEL, "messages": []},  # no question: 400
    ]
    out = []
    with httpx.Client(timeout=60) as http:
        for body in bad:
            r = http.post(url + "/v1/chat/completions", json=body)
            out.append((r.status_code, r.json()["error"]["code"]))
        r = http.post(url + "/v1/chat/completions", content=b"{", headers={"content-type": "text/plain"})
        out.append((r.status_code, r.json()["error"]["code"]))
    return out


def test_two_replicas_answer_as_the_one_process_server(replicas_url, requests):
    torch.set_num_threads(1)  # as each replica: the same kernels give the same greedy tokens
    pipe = Pipeline.from_pretrained(MODEL, max_new_tokens=NEW_TOKENS)
    with ServerThread(build_app(pipe, **APP)) as server:
        expected = _answers(_client(server.url), requests)
        expected_refusals = _refusals(server.url, requests[0])
    assert all(text and text == streamed for text, _, streamed in expected)
    assert _answers(_client(replicas_url), requests) == expected
    assert _refusals(replicas_url, requests[0]) == expected_refusals
    metrics = httpx.get(replicas_url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "litevlm_requests_total" in metrics.text


def _replica_actors() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "litevlm#Replica" in a["name"]
    ]


def test_a_replica_killed_under_load_loses_no_request(replicas_url, requests):
    from ray import serve

    bodies = [json.dumps({"model": MODEL, "messages": m, "stream": i % 2 == 1}) for i, m in enumerate(requests)]
    results: list = []
    answered = threading.Semaphore(0)
    lock = threading.Lock()

    def client(k: int):
        # Each request on a connection of its own: a pooled keep-alive connection that the proxy closes as the
        # replica dies reads as a reset when the next request goes out on it, which is the client's pool, not a
        # request the server lost. A reset on a fresh connection still fails the test. A request that hangs fails it
        # with a timeout.
        for i in range(6):
            body = bodies[(k + i) % len(bodies)]
            try:
                r = httpx.post(
                    replicas_url + "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=90,
                )
                result = (r.status_code, r.headers.get("retry-after"), r.text)
            except httpx.HTTPError as e:  # a timeout, a connection cut: reported by the assertions below
                result = (type(e).__name__, None, str(e))
            with lock:
                results.append(result)
            answered.release()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for _ in range(4):  # the load is under way: some answers are back, most are not
        assert answered.acquire(timeout=90)
    victims = _replica_actors()
    assert len(victims) == 2
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=180)
        assert not t.is_alive(), "a request hung"

    assert len(results) == 36
    for status, retry_after, text in results:
        assert status == 200 or (status == 503 and int(retry_after) >= 1), (status, text[:200])
        if status == 200 and text.startswith("data: "):  # a stream cut by the kill ends with an error event
            assert text.rstrip().endswith("data: [DONE]") or '"code":"replica_unavailable"' in text
    assert sum(s == 200 for s, _, _ in results) >= 18  # the other replica kept answering

    # Ray Serve replaces the lost replica, and the server answers as before
    end = time.monotonic() + 120
    while time.monotonic() < end:
        names = _replica_actors()
        status = serve.status().applications["litevlm"].deployments["Replica"]
        if victims[0] not in names and len(names) == 2 and status.status == "HEALTHY":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the killed replica was not replaced: {names}, {status}")
    r = httpx.post(
        replicas_url + "/v1/chat/completions",
        content=bodies[0],
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# -- the front's handling of a lost replica, with stand-in handles (no Ray instance) -------------------------------
class _Stream:
    """A stand-in for a streaming Ray handle call: yields `messages`, then raises `error` (if any)."""

    def __init__(self, messages, error=None):
        self.messages, self.error, self.cancelled = list(messages), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.messages:
            return self.messages.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self, streams):
        self.streams, self.calls = list(streams), 0

    def options(self, **kwargs):
        return self

    def remote(self, scope, body):
        self.calls += 1
        return self.streams.pop(0)


START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def _front(streams, retries=2):
    from litevlm.serve.limits import Limits
    from litevlm.serve.replicas import Front

    handle = _Handle(streams)
    return Front.func_or_class(handle, vars(Limits(timeout_s=5.0)), retries), handle  # the class under the deployment


async def _collect(relay) -> list:
    sent = []

    async def send(message):
        sent.append(message)

    await relay(None, None, send)
    return sent


def test_a_replica_lost_before_answering_is_retried_then_503():
    import asyncio

    from ray.exceptions import ActorDiedError

    from litevlm.serve.protocol import APIError

    ok = [START, {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}]
    lost = _Stream([], ActorDiedError())
    front, handle = _front([lost, _Stream(ok + [{"type": "http.response.body", "body": b"", "more_body": False}])])
    head, rest = asyncio.run(front._first({}, b"{}", time.monotonic()))
    assert head == ok and handle.calls == 2 and lost.cancelled  # the second replica answered

    # a replica that stops before its app sent anything ends its stream empty: retried as well
    front, handle = _front([_Stream([]), _Stream(ok)])
    assert asyncio.run(front._first({}, b"{}", time.monotonic()))[0] == ok and handle.calls == 2

    front, handle = _front([_Stream([], ActorDiedError()) for _ in range(3)], retries=2)
    with pytest.raises(APIError) as err:
        asyncio.run(front._first({}, b"{}", time.monotonic()))
    assert err.value.status == 503 and int(err.value.headers["Retry-After"]) >= 1 and handle.calls == 3


def test_a_stream_whose_replica_is_lost_ends_with_an_error_event():
    import asyncio

    from ray.exceptions import ActorDiedError

    from litevlm.serve.replicas import Relay

    first = {"type": "http.response.body", "body": b"data: a\n\n", "more_body": True}
    rest = _Stream([{"type": "http.response.body", "body": b"data: b\n\n", "more_body": True}], ActorDiedError())
    sent = asyncio.run(_collect(Relay([START, first], rest)))
    assert sent[:3] == [START, first, {"type": "http.response.body", "body": b"data: b\n\n", "more_body": True}]
    event = json.loads(sent[3]["body"].decode().removeprefix("data: "))
    assert event["error"]["code"] == "replica_unavailable"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
