"""Streaming over HTTP: a streamed answer's text leaves the server as the pipeline makes it, and the
streamed answer equals the plain one, with and without speculative decoding."""

import json
import threading
from contextlib import closing

import pytest

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from litevlm import Pipeline  # noqa: E402
from litevlm.pipeline import Delta  # noqa: E402
from litevlm.serve import ServerThread, build_app, image_data_url, user_message  # noqa: E402

QUESTION = "What are objects to the front of the ego car?"


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(1, 0))


def held_after_first(decode, gate: threading.Event, made: list):
    """`decode` (`Pipeline.decode`: token runs as they are made, then the Generation) whose runs after the first
    wait for `gate`: a decode held on purpose, so the test can look at the client's side while the answer is
    unfinished."""

    def run(*args, **kwargs):
        inner = decode(*args, **kwargs)
        while True:
            try:
                tokens = next(inner)
            except StopIteration as stop:
                return stop.value
            made.append(tokens)
            yield tokens
            if len(made) == 1:
                assert gate.wait(30), "the test never let the decode go on"

    return run


def sse_contents(lines) -> list:
    """The parsed chunks of server-sent event lines, up to [DONE]."""
    out = []
    for line in lines:
        if line == "data: [DONE]":
            return out
        if line.startswith("data: "):
            out.append(json.loads(line[len("data: ") :]))
    return out


@pytest.mark.parametrize("options", [{}, {"speculative": True}], ids=["plain", "speculative"])
def test_the_first_chunk_arrives_while_decoding_and_the_stream_equals_the_plain_answer(images, options, monkeypatch):
    expected = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options).answer(QUESTION, images)
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options)
    with closing(pipe.stream(QUESTION, images)) as probe:  # the first step makes text: a chunk can follow it
        assert next(d for d in probe if isinstance(d, Delta)).text
    assert len(expected.tokens) > 2  # more steps follow the first

    gate, made = threading.Event(), []
    monkeypatch.setattr(pipe, "decode", held_after_first(pipe.decode, gate, made))

    app = build_app(pipe, model_name="tiny", timeout_s=120)
    body = {"model": "tiny", "messages": [user_message(QUESTION, {c: image_data_url(im) for c, im in images.items()})]}
    with ServerThread(app) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            chunks = []
            while not any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks):
                chunks += sse_contents([next(lines)])
            # The first text is at the client while the pipeline has made at most one decoding run (an answer
            # opening accepted in the prefill may come before it) and waits before the next: still decoding.
            assert not gate.is_set() and len(made) <= 1 and app.state.worker.pending == 1
            gate.set()
            chunks += sse_contents(lines)
        plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()

    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == plain["choices"][0]["message"]["content"] == expected.text
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert final[0]["usage"] == plain["usage"]
    assert final[0]["litevlm"]["accept_lengths"] == plain["litevlm"]["accept_lengths"] == expected.accept_lengths
