"""Load on a live loopback server: 200 requests from 16 concurrent clients through a small queue.

Every request is answered (200, or 429 with Retry-After and then retried), nothing is a 5xx, and
every answer equals the one the same question and images got when asked one at a time."""

import json
import threading
import time
from collections import Counter

import pytest

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from litevlm import Pipeline  # noqa: E402
from litevlm.serve import ServerThread, build_app, image_data_url, user_message  # noqa: E402

REQUESTS, CLIENTS = 200, 16
QUESTIONS = (
    "Is there a red car to the front of the ego car?",
    "What is the state of the traffic light in front of the ego car?",
    "What are objects to the back left of the ego car?",
    "What should the ego vehicle do next?",
)


@pytest.fixture(scope="module")
def cases():
    """20 distinct (question, six views) requests: 5 frames x 4 questions."""
    from litevlm.data.synthetic import make_frame, render_views

    out = []
    for f in range(5):
        urls = {c: image_data_url(im) for c, im in render_views(make_frame(7, f), size=(160, 90)).items()}
        out += [{"model": "tiny", "messages": [user_message(q, urls)]} for q in QUESTIONS]
    return out


def test_200_requests_from_16_clients_all_answered_and_identical(tiny_model_dir, cases):
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=8)
    with ServerThread(build_app(pipe, model_name="tiny", max_queue=4, timeout_s=60)) as server:
        url = server.url + "/v1/chat/completions"
        with httpx.Client(timeout=30) as c:  # one at a time first: the reference answers
            t0 = time.perf_counter()
            alone = [c.post(url, json=body).json() for body in cases]
            one_at_a_time_s = (time.perf_counter() - t0) / len(cases)
        expected = [(r["choices"][0]["message"]["content"], r["litevlm"]["views"]) for r in alone]
        # The server answers what the library answers.
        q = cases[0]["messages"][0]["content"][0]["text"]
        from litevlm.data.synthetic import make_frame, render_views

        assert expected[0][0] == pipe.answer(q, render_views(make_frame(7, 0), size=(160, 90))).text

        bodies = [json.dumps(body).encode() for body in cases]  # serialised once: retries cost the client little
        statuses: Counter = Counter()
        answers: dict[int, tuple[str, list[str]]] = {}
        lock = threading.Lock()
        todo = iter(range(REQUESTS))
        start = threading.Barrier(CLIENTS)

        def client():
            with httpx.Client(timeout=30) as http:
                start.wait()
                while True:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    for _ in range(2000):
                        r = http.post(url, content=bodies[i % len(cases)], headers={"content-type": "application/json"})
                        with lock:
                            statuses[r.status_code] += 1
                        if r.status_code != 429:
                            break
                        assert int(r.headers["retry-after"]) >= 1
                        time.sleep(min(int(r.headers["retry-after-ms"]) / 1000, 0.25))  # capped for the test
                    body = r.json()
                    with lock:
                        answers[i] = (
                            r.status_code,
                            body["choices"][0]["message"]["content"] if r.status_code == 200 else body,
                        )

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        health = httpx.get(server.url + "/health").json()
        metrics = httpx.get(server.url + "/metrics").text

    assert len(answers) == REQUESTS
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] == REQUESTS
    assert statuses[429] > 0, "the queue never filled: the load did not exercise it"
    wrong = [i for i, (status, text) in answers.items() if (status, text) != (200, expected[i % len(cases)][0])]
    assert not wrong, f"{len(wrong)} answers differ from the one-at-a-time answers"
    assert health["in_flight"] == 0
    assert f'litevlm_requests_total{{endpoint="/v1/chat/completions",status="200"}} {REQUESTS + len(cases)}' in metrics
    print(
        f"\n{REQUESTS} requests, {CLIENTS} clients: {wall:.2f} s, statuses {dict(statuses)}; "
        f"alone {one_at_a_time_s * 1000:.1f} ms per request"
    )
