"""`litevlm serve` is alive at once and ready after its warm-up: /health answers while the pipeline's warm-up answer
runs as the worker's first job, /ready says 503 until it is done, then 200, and the first request waits behind it."""

import threading

import pytest

pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from litevlm import Pipeline  # noqa: E402
from litevlm.serve import ServerThread, build_app  # noqa: E402


def test_health_at_once_ready_after_the_warmup(tiny_model_dir):
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=4, warmup=False)
    assert not pipe.warmed
    release, started = threading.Event(), threading.Event()
    warm = pipe.warmup

    def held_warmup():  # the warm-up waits for the test, so that the server is seen before it ends
        started.set()
        release.wait(30)
        warm()

    pipe.warmup = held_warmup
    with ServerThread(build_app(pipe, model_name="tiny")) as server:
        assert started.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        not_yet = httpx.get(f"{server.url}/ready", timeout=10)
        assert not_yet.status_code == 503 and not_yet.json()["status"] == "warming up"
        release.set()
        for _ in range(300):
            ready = httpx.get(f"{server.url}/ready", timeout=10)
            if ready.status_code == 200:
                break
            threading.Event().wait(0.1)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert pipe.warmed and ready.json()["setup_ms"] > 0


def test_a_warmed_pipeline_is_ready_at_once(tiny_model_dir):
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=4)
    assert pipe.warmed
    with ServerThread(build_app(pipe, model_name="tiny")) as server:
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
